"""`kvstore-bench`, the installed command: every benchmark answers --help on stdout under its
own name, a name it does not know is refused by name, and the quick runs run."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

from kvstore_bench.cli import BENCHES
from kvstore_testing.clusterproc import server_binaries

# The console script pip installed next to this interpreter: what a user runs.
BENCH = shutil.which("kvstore-bench", path=os.path.dirname(sys.executable)) or "kvstore-bench"


def bench(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([BENCH, *args], capture_output=True, text=True, timeout=timeout,
                          check=False)


@pytest.mark.parametrize("name", list(BENCHES))
def test_help_of_each_benchmark(name):
    out = bench(name, "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: kvstore-bench {name} "), out.stdout
    assert out.stderr == ""


def test_help_lists_the_benchmarks():
    out = bench("--help")
    assert out.returncode == 0 and out.stderr == ""
    assert all(name in out.stdout for name in BENCHES)


def test_unknown_benchmark_is_named():
    out = bench("bogus")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("kvstore-bench: unknown benchmark 'bogus'"), out.stderr


def test_no_benchmark_is_usage():
    out = bench()
    assert out.returncode == 2 and out.stderr.startswith("usage: kvstore-bench")


def test_bad_option_names_the_benchmark():
    out = bench("hash", "--bogus")
    assert out.returncode == 2 and "usage: kvstore-bench hash" in out.stderr


# The benchmarks with a --quick smoke run; sglang's needs SGLang (make test-sglang's venv).
QUICK = ["store", "fastpath", "shm", "disk", "sglang", "far", "peers", "remote-load",
         "hooks"]
# Benches whose quick run has a test file of its own (it needs arguments or checks more).
QUICK_ELSEWHERE = {"hybrid": "tests/integration/test_hybrid_bench.py"}


@pytest.mark.slow
@pytest.mark.parametrize("name", QUICK)
def test_quick_run(name, tmp_path):
    if name == "sglang" and importlib.util.find_spec("sglang") is None:
        pytest.skip("needs SGLang (scripts/venv-sglang.sh)")
    if name == "far" and server_binaries() is None and not os.environ.get("CI"):
        pytest.skip("needs valkey-server or redis-server (CI installs redis-server)")
    args = ["--dir", str(tmp_path)] if name == "disk" else []
    out = bench(name, "--quick", *args, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip(), "printed no figures"


def test_every_benchmark_with_quick_is_tested():
    quick = {name for name in BENCHES if "--quick" in bench(name, "--help").stdout}
    assert quick == set(QUICK) | set(QUICK_ELSEWHERE)


def test_record_keeps_what_a_bench_printed_and_report_renders_it(tmp_path):
    records = tmp_path / "perf"
    out = bench("--record", str(records), "hash", "--runs", "3")
    assert out.returncode == 0, out.stderr
    files = list(records.glob("hash-*.json"))
    assert len(files) == 1
    doc = tmp_path / "performance.md"
    assert bench("report", "--records", str(records), "--out", str(doc)).returncode == 0
    text = doc.read_text()
    assert "`kvstore-bench hash --runs 3`" in text and "cores" in text
    assert out.stdout.strip().splitlines()[-1] in text      # the figures, verbatim
    # The same command again replaces its record; --check sees the document is stale.
    assert bench("--record", str(records), "hash", "--runs", "3").returncode == 0
    assert list(records.glob("hash-*.json")) == files
    check = bench("report", "--records", str(records), "--out", str(doc), "--check")
    assert check.returncode in (0, 1)       # the date may or may not have changed
    (doc).write_text("edited by hand\n")
    check = bench("report", "--records", str(records), "--out", str(doc), "--check")
    assert check.returncode == 1 and "kvstore-bench report" in check.stderr


def test_a_failed_run_records_nothing(tmp_path):
    out = bench("--record", str(tmp_path), "hash", "--bogus")
    assert out.returncode == 2 and not list(tmp_path.iterdir())


def test_the_performance_doc_is_current_with_its_records():
    """docs/performance.md is what `kvstore-bench report` renders from docs/perf/."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([BENCH, "report", "--check", "--records",
                          os.path.join(root, "docs", "perf"), "--out",
                          os.path.join(root, "docs", "performance.md")],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr


def test_a_record_names_no_path_of_the_machine(tmp_path, monkeypatch):
    from kvstore_bench.record import _argv_out
    monkeypatch.chdir(tmp_path)
    assert _argv_out(["--out", "/elsewhere/out", "--dir", str(tmp_path / "d"), "-n", "3"]) \
        == ["--out", "DIR", "--dir", "d", "-n", "3"]


@pytest.mark.slow
def test_admit_shows_both_lookup_modes_side_by_side():
    out = bench("admit", "--requests", "4", "--system-len", "64", "--user-len", "16",
                "--reps", "1", "--gap-ms", "5", timeout=120)
    assert out.returncode == 0, out.stderr
    rows = {line.split("|")[1].strip(): line for line in out.stdout.splitlines()
            if line.startswith("| ")}
    assert {"sync", "sync, gRPC", "prefetch"} <= set(rows), out.stdout
    assert all(r.rstrip(" |").endswith("256") for k, r in rows.items()
               if k.startswith(("sync", "prefetch"))), out.stdout     # 4 x 64 tokens hit
    assert "loop ms, sync / prefetch at a 5 ms step:" in out.stdout


@pytest.mark.slow
def test_admit_with_retention_asks_sends_every_ask():
    out = bench("admit", "--requests", "4", "--system-len", "64", "--user-len", "16",
                "--reps", "1", "--gap-ms", "5", "--retain", timeout=120)
    assert out.returncode == 0, out.stderr
    # 4 requests x 2 reps (one warm-up) x 2 bursts (one untimed before the timed one)
    # x 3 cases, each retaining its 4 stored pages.
    assert "retention asks: 48, retained 48, refused 0, failed 0, dropped 0" in out.stdout, \
        out.stdout
