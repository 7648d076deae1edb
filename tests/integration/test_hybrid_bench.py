"""`kvstore-bench hybrid --quick` on the CPU against the real server it starts: a windowed
full hit moves what the plan says (the full layers' every page, the sliding layers' window)
and fewer bytes than loading every page, and the bench checks the bytes it loaded."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from kvstore_bench import hybrid_bench

pytestmark = pytest.mark.slow


def test_plan_bytes_follows_the_window():
    shape = hybrid_bench.Shape(layers=6, full_every=3, window=64, kv_heads=2, head=64)
    lb = shape.layer_bytes
    assert lb == 2 * 16 * 2 * 64 * 2
    # 1,024 tokens = 64 pages: a 64-token window reaches 63 tokens back from the end, so
    # a sliding layer needs the last 4 pages (the page holding token 961 onwards).
    assert hybrid_bench.plan_bytes(shape, 64, True) == ((2 * 64 + 4 * 4) * lb, 4)
    assert hybrid_bench.plan_bytes(shape, 64, False) == (6 * 64 * lb, 64)
    # A prompt inside the window: every page either way.
    assert hybrid_bench.plan_bytes(shape, 3, True) == (6 * 3 * lb, 3)
    assert [kind for kind, _ in shape.groups()] == ["full", "sliding", "sliding"]
    assert [layers for _, layers in shape.groups()] == [[2, 5], [0, 1], [3, 4]]


def test_quick_run_on_cpu():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = hybrid_bench.main(["--quick", "--device", "cpu", "--tokens", "256,1024",
                                "--reps", "1", "--json"])
    assert rc == 0
    r = json.loads(out.getvalue())
    shape = hybrid_bench.QUICK
    for size in r["sizes"]:
        pages = size["tokens"] // shape.page_tokens
        assert size["windowed"]["bytes"] == hybrid_bench.plan_bytes(shape, pages, True)[0]
        assert size["every"]["bytes"] == shape.layers * pages * shape.layer_bytes
        assert size["windowed"]["bytes"] < size["every"]["bytes"]
        assert size["windowed"]["h2d_gbps"] is None          # no pinned copy on the CPU
    assert hybrid_bench.report(r).count("| windowed |") == 2
