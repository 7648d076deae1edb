"""`kvstore-bench peers --quick`: the comparison runs against the servers it starts and
prints a figure and a ratio for every system and size. No figure is asserted (the
machine is shared): only that each system it can run was read, byte-exact (the bench
checks every reader's bytes before timing), and that what it cannot run is named."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import shutil

import pytest

from kvstore_bench import cli
from kvstore_bench.peers_bench import LMCACHE_SKIPPED

pytestmark = pytest.mark.slow

NUMBER = r"\d+(\.\d+)?"


def test_quick_peers_prints_every_system_and_says_what_it_skipped():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main(["peers", "--quick", "--turns", "2"])
    assert rc == 0
    text = out.getvalue()
    # Values of 1 MiB or more go round --turns connections to each system.
    assert "values of 1 MiB or more over 2 connections to each" in text.splitlines()[0], text
    rows = {r[0].strip(): r[1:] for r in (line.strip("|").split("|")
                                          for line in text.splitlines()
                                          if line.startswith("| ") and "---" not in line)}
    systems = {"raw", "kvstore"}
    if shutil.which("redis-server"):
        systems |= {"redis RESP", "redis glide"}
    else:
        assert "redis: redis-server is not on PATH; skipped" in text
    if importlib.util.find_spec("lmcache") is not None:
        systems.add("lmcache")              # its server, run by this Python
    else:
        assert LMCACHE_SKIPPED in text
    # Each system once in the figures, and every one but ours once in the ratios.
    assert set(rows) == systems | {"system", "against"}, text
    for name in systems:
        assert len(rows[name]) == 3, text
        assert all(re.fullmatch(NUMBER, cell.strip()) for cell in rows[name]), rows[name]
    assert text.count("| kvstore |") == 1
    # Two headers, a figure row per system, a ratio row per system but ours.
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(table) == 2 + len(systems) + len(systems) - 1, text


def test_rounds_below_one_are_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["peers", "--rounds", "-1"])
    assert exc.value.code == 2
    assert "--rounds must be at least 1" in capsys.readouterr().err


def test_turns_below_one_are_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["peers", "--turns", "0"])
    assert exc.value.code == 2
    assert "--turns must be at least 1" in capsys.readouterr().err


def test_a_python_without_lmcache_is_refused_before_anything_runs(capsys, tmp_path):
    missing = str(tmp_path / "no-python")
    with pytest.raises(SystemExit) as exc:
        cli.main(["peers", "--lmcache-python", missing])
    assert exc.value.code == 2
    assert f"--lmcache-python {missing}: the lmcache package is not installed" \
        in capsys.readouterr().err


def test_one_cpu_runs_every_server_on_this_process_s_cpu_and_says_so():
    """--one-cpu pins every thread of the servers and of this process to one CPU while
    the rounds are timed, and gives this process its CPUs back after."""
    mine = os.sched_getaffinity(0)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main(["peers", "--quick", "--one-cpu"])
    assert rc == 0
    assert "every thread of the servers and the client on one CPU (--one-cpu)" \
        in out.getvalue().splitlines()[0]
    assert os.sched_getaffinity(0) == mine
