"""`kvstore-bench fastpath --sweep --quick`: the smallest sweep runs against the real server
and raw peer it starts, and prints a ratio to the raw peer for every pattern it measured.
No figure is asserted: the machine is shared, only the shape of the report is checked."""

from __future__ import annotations

import contextlib
import io
import os
import re

import pytest

from kvstore_bench import fastpath_bench
from kvstore_bench.fastpath_sweep import Sweep

pytestmark = pytest.mark.slow

NUMBER = r"\d+(\.\d+)?"


def test_quick_sweep_prints_a_ratio_for_every_pattern():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = fastpath_bench.main(["--sweep", "--quick", "--turns", "2"])
    assert rc == 0
    text = out.getvalue()
    spec = Sweep.quick()
    assert text.startswith(f"medians of {spec.rounds} rounds"), text
    # Calls of 1 MiB or more go round --turns connections a side (fastpath_sweep._Turns).
    assert "of 1 MiB or more go round 2 connections a side," in text.splitlines()[0], text
    rows = [line.strip("|").split("|") for line in text.splitlines()
            if line.startswith("| ") and not line.startswith(("| page", "| one call"))]
    grid = [r for r in rows if len(r) == 8]
    # One row per page size and pages a call, each with a get and a put ratio.
    assert len(grid) == len(spec.page_sizes) * len(spec.pages_a_call), text
    for row in grid:
        assert all(re.fullmatch(NUMBER, cell.strip()) for cell in row[1:]), row
    calls = {r[0].strip(): r for r in rows if len(r) == 4}
    assert {"get of one 64 KiB page", "lookup of 16 keys",
            "leased lookup of 16 keys + release",
            "leased lookup of 16 keys + release not waited for"} <= set(calls), text
    for row in calls.values():
        assert all(re.fullmatch(NUMBER, cell.strip()) for cell in row[1:]), row
    # Where the kernel counts it, the CPU a get costs each end, for 1 and 8 pages a call.
    if os.path.exists("/proc/self/schedstat"):
        cpu = {r[0].strip(): r for r in rows if len(r) == 6 and "CPU" not in r[0]}
        want = {f"{n} x 64 KiB" for n in spec.pages_a_call if n in (1, 8)}
        assert want <= set(cpu), text
        for row in cpu.values():
            assert all(re.fullmatch(NUMBER, cell.strip()) for cell in row[1:]), row
    assert "iperf3" in text


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin to one")
def test_one_cpu_sweep_says_so_and_gives_this_process_its_cpus_back():
    before = os.sched_getaffinity(0)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = fastpath_bench.main(["--sweep", "--quick", "--one-cpu", "--rounds", "1"])
    assert rc == 0
    text = out.getvalue()
    assert "every thread of both ends on one CPU (--one-cpu)" in text.splitlines()[0], text
    assert "lookup of 16 keys" in text
    # The bench pinned this process's threads for its rounds, and only for them.
    assert os.sched_getaffinity(0) == before
    for task in os.listdir("/proc/self/task"):
        assert os.sched_getaffinity(int(task)) == before, task
