"""kvstore-bench store --calls: every call it names runs against a real in-process store."""

from kvstore_bench import store_bench
from kvstore_bench.store_calls import CALLS, per_call_us, report_calls


def test_every_call_is_timed_and_reported():
    """A call that raised (a refused lease, a put into a full pool) would stop the run."""
    r = per_call_us(n=30, rounds=1)
    assert list(r) == list(CALLS)
    assert all(us > 0 for us in r.values())
    table = report_calls(r)
    assert all(name in table for name in CALLS)


def test_the_store_bench_runs_it_alone(capsys):
    assert store_bench.main(["--calls", "--quick", "--rounds", "1", "--json"]) == 0
    assert "leased lookup 16 + release" in capsys.readouterr().out
