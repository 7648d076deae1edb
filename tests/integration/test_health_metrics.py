"""Health checking, reflection and the Prometheus endpoint of a real server."""

import signal
import urllib.request

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from kvstore_client import KVStoreClient, PageLayout
from kvstore_testing.serverproc import free_port


def test_health_and_reflection(server):
    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "kvstore.v1.KVStore", "kvstore.v1.Admin"):
            resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
            list_services="")]), timeout=5)
        names = {s.name for a in answers for s in a.list_services_response.service}
        assert {"kvstore.v1.KVStore", "kvstore.v1.Admin", "grpc.health.v1.Health"} <= names


def test_metrics_scrape_parses(fresh_server):
    port = free_port()
    srv = fresh_server(metrics_port=port)
    with KVStoreClient(srv.address, data_plane=False) as c:  # counts gRPC calls
        ns = c.register_layout(PageLayout(model="m", num_layers=2, page_tokens=4,
                                          num_kv_heads=2, head_size=16))
        keys = [b"metric-key-%05d" % i for i in range(5)]
        c.put(ns, keys, np.zeros((5, ns.page_bytes), dtype=np.uint8))
        assert c.lookup(ns, keys + [b"z" * 16]) == 5
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in families.values() for s in f.samples}
    assert samples[("kvstore_pages", (("tier", "dram"),))] == 5
    assert samples[("kvstore_hits_total", (("tier", "dram"),))] == 5
    assert samples[("kvstore_misses_total", (("tier", "dram"),))] == 1
    assert samples[("kvstore_bytes_in_total", (("tier", "dram"),))] == 5 * ns.page_bytes
    assert "kvstore_evictions" in families and "kvstore_capacity_bytes" in families
    assert samples[("kvstore_rpc_duration_seconds_count", (("method", "Lookup"),))] == 1
    assert samples[("kvstore_rpc_total", (("code", "OK"), ("method", "Lookup")))] == 1


def test_sigterm_stops_gracefully_and_removes_the_region(fresh_server):
    import os
    srv = fresh_server()
    assert srv.stop(signal.SIGTERM) == 0
    log = srv.log()
    assert "stopped" in log
    region = next(w for w in log.split() if w.startswith("/dev/shm/kvstore-")).rstrip(";")
    assert not os.path.exists(region)
