"""`kvstore-bench fastpath --split --quick`: against the real server and raw peer it starts,
each pattern's CPU a call at each end, split into user and system time. No figure is
asserted (the machine is shared); the report's shape is, and that the calls cost CPU."""

from __future__ import annotations

import contextlib
import io
import os

import pytest

from kvstore_bench import fastpath_bench

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.path.exists("/proc/self/stat"),
                                 reason="needs /proc/PID/stat")]


def test_quick_split_prints_user_and_system_time_of_each_end():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = fastpath_bench.main(["--split", "--quick"])
    assert rc == 0
    text = out.getvalue()
    rows = [line.strip("|").split("|") for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| call")]
    ends = {(r[0].strip(), r[1].strip()): [float(x) for x in r[2:6]] for r in rows}
    calls = ("get 1 x 64 KiB", "get 8 x 64 KiB", "lookup of 16 keys")
    assert set(ends) == {(c, e) for c in calls for e in ("far end", "client")}, text
    for figures in ends.values():
        assert all(x >= 0 for x in figures)
    # Each side made its calls: the client's and the far end's CPU, both sides, over
    # the three patterns, is more than nothing (a 64 KiB page's copies alone cost it).
    for call in calls:
        assert sum(ends[(call, "client")]) > 0, text
        assert sum(ends[(call, "far end")]) > 0, text
