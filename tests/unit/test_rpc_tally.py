"""RPC counts kept per thread: every call counted once, from live and ended threads."""

from __future__ import annotations

import threading

import grpc
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvstore_server.rpc_tally import RpcTally


def _samples(tally: RpcTally) -> dict:
    registry = CollectorRegistry()
    registry.register(tally)
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_calls_of_many_threads_add_up_and_outlive_their_threads():
    tally = RpcTally()

    def serve(n: int) -> None:
        for _ in range(n):
            tally.observe("FastGet", 0.0002, grpc.StatusCode.OK)

    threads = [threading.Thread(target=serve, args=(1000,)) for _ in range(8)]
    for t in threads:
        t.start()
    before = _samples(tally)                 # read while they run: never more than done
    assert before.get(("kvstore_rpc_total", (("code", "OK"), ("method", "FastGet"))),
                      0) <= 8000
    for t in threads:
        t.join()
    tally.observe("FastGet", 3.0, grpc.StatusCode.NOT_FOUND)
    for _ in range(2):                       # ended threads folded in once, not twice
        s = _samples(tally)
        assert s[("kvstore_rpc_total", (("code", "OK"), ("method", "FastGet")))] == 8000
        assert s[("kvstore_rpc_total", (("code", "NOT_FOUND"), ("method", "FastGet")))] == 1
        assert s[("kvstore_rpc_duration_seconds_count", (("method", "FastGet"),))] == 8001
        assert s[("kvstore_rpc_duration_seconds_bucket",
                  (("le", "0.00025"), ("method", "FastGet")))] == 8000
        assert s[("kvstore_rpc_duration_seconds_bucket",
                  (("le", "2.5"), ("method", "FastGet")))] == 8000
        assert s[("kvstore_rpc_duration_seconds_bucket",
                  (("le", "5.0"), ("method", "FastGet")))] == 8001
        assert abs(s[("kvstore_rpc_duration_seconds_sum", (("method", "FastGet"),))]
                   - (1.6 + 3.0)) < 1e-6


def test_a_refused_call_is_counted_without_a_latency():
    tally = RpcTally()
    tally.refused("Lookup", grpc.StatusCode.UNAUTHENTICATED)
    s = _samples(tally)
    assert s[("kvstore_rpc_total", (("code", "UNAUTHENTICATED"), ("method", "Lookup")))] == 1
    assert ("kvstore_rpc_duration_seconds_count", (("method", "Lookup"),)) not in s


def test_a_latency_on_a_bound_falls_in_that_bucket():
    tally = RpcTally()
    tally.observe("Lookup", 0.001, grpc.StatusCode.OK)
    s = _samples(tally)
    assert s[("kvstore_rpc_duration_seconds_bucket", (("le", "0.001"), ("method", "Lookup")))] == 1
    assert s[("kvstore_rpc_duration_seconds_bucket",
              (("le", "0.0005"), ("method", "Lookup")))] == 0
