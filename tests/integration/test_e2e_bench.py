"""`kvstore-bench e2e` on the CPU with the tiny preset, against the real server it starts:
recompute, miss+save and DRAM hit come from rounds of one each, their ratios are medians
of the rounds' ratios, and the disk hit is measured after --breakdown's hits too."""

from __future__ import annotations

import contextlib
import io
import json
import statistics

import pytest

from kvstore_bench import e2e_bench

pytestmark = pytest.mark.slow

pytest.importorskip("torch", reason="kvstore-bench e2e runs its model with torch (not installed)")

REPS = 3


@pytest.fixture(scope="module")
def run():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = e2e_bench.main(["--device", "cpu", "--preset", "tiny", "--prompt-lens", "200",
                             "--reps", str(REPS), "--breakdown", "--disk", "256MiB",
                             "--multi", "0", "--decode-steps", "0", "--json"])
    assert rc == 0
    return json.loads(out.getvalue())


def test_ratios_are_medians_of_the_rounds(run):
    (p,) = run["ttft"]
    rounds = p["rounds"]
    assert len(rounds) == REPS
    assert p["speedup"] == statistics.median(r["recompute_s"] / r["dram_hit_s"] for r in rounds)
    assert p["miss_save_ratio"] == statistics.median(r["miss_save_s"] / r["recompute_s"]
                                                     for r in rounds)
    for key in ("recompute_s", "miss_save_s", "dram_hit_s"):
        assert p[key] == statistics.median(r[key] for r in rounds)
    assert p["hit_tokens"] == 199 // 16 * 16
    assert p["max_abs_logit_diff"] == 0.0                 # float32 on the CPU: exact


def test_the_disk_hit_follows_the_breakdowns_hits(run):
    """The breakdown's last hit leaves its lookup lease pinning the pages until the next
    build: the disk phase sends the release first, else nothing could be evicted."""
    (p,) = run["ttft"]
    assert "breakdown" in p and "disk_skipped" not in p
    assert p["disk_hit_s"] is not None and p["disk_hit_tokens"] == p["hit_tokens"]


def test_the_half_hit_is_measured_from_a_store_holding_half(run):
    (p,) = run["ttft"]
    assert p["half_hit_tokens"] == 200 // 2 // 16 * 16
    assert p["half_max_abs_logit_diff"] == 0.0
