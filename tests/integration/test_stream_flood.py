"""A flood of stalled Get streams leaves the health check and other calls their threads:
Get and Put streams take at most three quarters of --workers (stream_gate.py), and one
past that is refused at once."""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore_client import KVStoreClient

from .test_faults import BIG, keys, pages, stalled_get


def test_health_and_lookups_answer_under_a_flood_of_stalled_streams(fresh_server):
    srv = fresh_server(dram="128MiB", workers=4, stream_timeout="60s")
    with KVStoreClient(srv.address, shared_memory=False, timeout=20, retries=0) as c:
        ns = c.register_layout(BIG)
        held = keys("flood", 32)
        c.put(ns, held, pages(held, BIG.page_bytes))
        opened, refused = [], 0
        try:
            for _ in range(12):
                try:
                    opened.append(stalled_get(srv.address, ns, held))
                except grpc.RpcError as err:
                    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
                    assert "Get/Put streams are open" in err.details()
                    refused += 1
            assert len(opened) == 3 and refused == 9       # 4 workers: 3 for streams
            with grpc.insecure_channel(srv.address) as channel:
                t0 = time.monotonic()
                health = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=2)
                assert health.status == health_pb2.HealthCheckResponse.SERVING
                assert c.lookup(ns, held) == 32
                assert time.monotonic() - t0 < 2
        finally:
            for channel, _ in opened:
                channel.close()
