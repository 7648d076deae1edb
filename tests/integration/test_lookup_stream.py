"""LookupStream against a real server: same answers as Lookup, its errors, its limits, its
deadline, and a stop that does not wait for idle streams."""

import os
import signal
import time
import urllib.request

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore_client import KVStoreClient, KVStoreError, PageLayout
from kvstore_protocol._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore_protocol.keys import Packed
from kvstore_testing.serverproc import free_port, sigstop
from tests.waiting import wait_for

LAYOUT = dict(model="stream", num_layers=2, page_tokens=4, num_kv_heads=2, head_size=16)


def _keys(tag: str, n: int) -> list[bytes]:
    return [f"{tag}-{i:06d}".encode().ljust(16, b".") for i in range(n)]


def _open_streams(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text)
            for s in f.samples}["kvstore_lookup_streams"]


def _stored(client, ns, keys):
    client.put(ns, keys, np.zeros((len(keys), ns.page_bytes), dtype=np.uint8))


def test_lookups_share_one_stream_and_answer_as_lookup(fresh_server):
    port = free_port()
    srv = fresh_server(metrics_port=port)
    with KVStoreClient(srv.address, data_plane=False, shared_memory=False) as c, \
            KVStoreClient(srv.address, data_plane=False, shared_memory=False, lookup_stream=False) as unary:
        a = c.register_layout(PageLayout(**LAYOUT))
        b = c.register_layout(PageLayout(**LAYOUT, dtype="float16"))
        keys = _keys("share", 40)
        _stored(c, a, keys)
        _stored(c, b, keys[:25])
        c.delete(a, [keys[10]])                        # a hole at 10
        for ns, want in ((a, 10), (b, 25), ([a, b], 10)):
            assert c.lookup(ns, keys) == want
            assert unary.lookup(ns, keys) == want      # the same, over unary Lookup
        assert unary.lookup_stream is None
        assert c.lookup(a, keys[11:]) == 29
        assert c.lookup(a, Packed(b"".join(keys[:5]), 16)) == 5
        lease = c.lookup_lease(a, keys, 5000)          # leases over the stream too
        assert lease.count == 10 and lease.lease_id
        assert c.release_lease(lease)
        assert c.lookup_stream.opened == 1             # every lookup above on one stream
        assert _open_streams(port) == 1
    wait_for(lambda: _open_streams(port) == 0, "the close to reach the server")


def test_a_bad_request_gets_lookups_error_and_the_next_lookup_works(fresh_server):
    srv = fresh_server()
    with KVStoreClient(srv.address, data_plane=False, shared_memory=False, retries=0) as c:
        ns = c.register_layout(PageLayout(**LAYOUT))
        keys = _keys("bad", 8)
        _stored(c, ns, keys)
        assert c.lookup(ns, keys) == 8
        with pytest.raises(KVStoreError) as err:
            c.lookup([ns] * 300, keys)                 # the server takes 256 layouts
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "lookup names 300 layouts; at most 256" in err.value.message
        assert c.lookup(ns, keys) == 8
        assert c.lookup_stream.opened == 2             # the bad request ended the first
    # On the wire: the stream ends with the status Lookup gives, message and all.
    with grpc.insecure_channel(srv.address) as channel:
        call = channel.stream_stream("/kvstore.v1.KVStore/LookupStream")(
            iter([pb.LookupRequest(layout_ids=[ns.layout_id], keys=pb.PackedKeys(
                data=b"".join(keys), key_size=16)).SerializeToString(), b"\xff\xff\xff"]))
        assert pb.LookupResponse.FromString(next(call)).count == 8
        with pytest.raises(grpc.RpcError) as err:
            next(call)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "malformed request" in err.value.details()


def test_past_the_limit_clients_fall_back_to_lookup(fresh_server):
    port = free_port()
    srv = fresh_server(metrics_port=port, lookup_streams=1)
    with KVStoreClient(srv.address, data_plane=False, shared_memory=False) as first, \
            KVStoreClient(srv.address, data_plane=False, shared_memory=False) as second:
        ns = first.register_layout(PageLayout(**LAYOUT))
        keys = _keys("limit", 12)
        _stored(first, ns, keys)
        assert first.lookup(ns, keys) == 12
        for _ in range(3):
            assert second.lookup(ns, keys[:7] + [b"missing".ljust(16)]) == 7
        assert second.lookup_stream.opened == 1        # tried once, then unary calls
        assert first.lookup_stream.opened == 1 and _open_streams(port) == 1
    srv_off = fresh_server(lookup_streams=0)           # streams off: every lookup unary
    with KVStoreClient(srv_off.address, data_plane=False, shared_memory=False) as c:
        ns = c.register_layout(PageLayout(**LAYOUT))
        _stored(c, ns, keys)
        assert c.lookup(ns, keys) == 12 and c.lookup(ns, keys) == 12
        assert c.lookup_stream.opened == 1


def test_a_lookup_on_the_stream_keeps_its_deadline(fresh_server):
    srv = fresh_server()
    with KVStoreClient(srv.address, data_plane=False, shared_memory=False, retries=0, timeout=5.0) as c:
        ns = c.register_layout(PageLayout(**LAYOUT))
        keys = _keys("deadline", 4)
        _stored(c, ns, keys)
        assert c.lookup(ns, keys) == 4                 # the stream is open
        c.timeout = 0.4
        # Stopped, not gone: no reset. Waited for: the signal is delivered asynchronously,
        # and a lookup sent at once was answered before the stop in a CI run.
        sigstop(srv.proc.pid)
        try:
            start = time.monotonic()
            with pytest.raises(KVStoreError) as err:
                c.lookup(ns, keys)
            waited = time.monotonic() - start
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert 0.4 <= waited < 1.5
        c.timeout = 5.0
        assert c.lookup(ns, keys) == 4                 # a new stream
        assert c.lookup_stream.opened == 2


def test_stop_does_not_wait_for_idle_streams(fresh_server):
    srv = fresh_server()
    with KVStoreClient(srv.address, data_plane=False, shared_memory=False) as c:
        ns = c.register_layout(PageLayout(**LAYOUT))
        assert c.lookup(ns, _keys("stop", 3)) == 0     # an open, idle stream
        start = time.monotonic()
        assert srv.stop(signal.SIGTERM) == 0
        assert time.monotonic() - start < 4.0          # the grace is 5 s


def test_a_client_dropped_without_close_closes_its_stream(fresh_server):
    import gc
    port = free_port()
    srv = fresh_server(metrics_port=port)
    c = KVStoreClient(srv.address, data_plane=False, shared_memory=False)
    ns = c.register_layout(PageLayout(**LAYOUT))
    assert c.lookup(ns, _keys("drop", 2)) == 0 and _open_streams(port) == 1
    del c, ns
    gc.collect()
    wait_for(lambda: _open_streams(port) == 0, "the dropped client's stream closed",
             timeout=5, interval=0.05)
