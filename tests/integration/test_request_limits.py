"""One request cannot take the server's memory, its lock, or its pool for longer than the
documented bounds (kvstore_server/rpc/limits.py, SECURITY.md): keys per request, bytes of a
request and of a Get's response, and leases capped at the server's --lease-ttl."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from kvstore_client import KVStoreClient, KVStoreError, PageLayout, PutResult
from kvstore_protocol import fastwire as fw
from kvstore_protocol._proto.kvstore.v1 import kvstore_pb2 as pb, kvstore_pb2_grpc
from tests.integration.test_fastpath import Raw, unix_path
from tests.waiting import wait_for

# 64 KiB pages: 1,025 of them are more than the 64 MiB pool.
LAYOUT = PageLayout(model="limits", num_layers=2, page_tokens=16, num_kv_heads=4,
                    head_size=128, dtype="float32")
MiB = 1 << 20


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def code_of(call, request) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        result = call(request, timeout=30)
        for _ in (result if hasattr(result, "__next__") else ()):
            pass
    return err.value.code(), err.value.details()


@pytest.fixture
def small(fresh_server, request):
    srv = fresh_server(**request.param)
    client = KVStoreClient(srv.address)
    ns = client.register_layout(LAYOUT)
    channel = grpc.insecure_channel(srv.address)
    yield srv, client, ns, kvstore_pb2_grpc.KVStoreStub(channel)
    channel.close()
    client.close()


@pytest.mark.parametrize("small", [{"max_keys_per_request": 1000}], indirect=True,
                         ids=["keys"])
def test_too_many_keys_are_refused_by_every_call(small):
    _srv, client, ns, stub = small
    keys = pb.PackedKeys(data=b"k" * 16 * 1001, key_size=16)
    lid = ns.layout_id
    token = client.region().token
    for call, request in [
            (stub.Lookup, pb.LookupRequest(layout_ids=[lid], keys=keys)),
            (stub.Exists, pb.ExistsRequest(layout_id=lid, keys=keys)),
            (stub.Get, pb.GetRequest(layout_id=lid, keys=keys)),
            (stub.Delete, pb.DeleteRequest(layout_id=lid, keys=keys)),
            (stub.Acquire, pb.AcquireRequest(layout_id=lid, keys=keys, token=token)),
            (stub.Reserve, pb.ReserveRequest(layout_id=lid, keys=keys, token=token))]:
        code, details = code_of(call, request)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (call, details)
        assert "1001 keys; at most 1000" in details
    put = iter([pb.PutRequest(header=pb.PutHeader(layout_id=lid, keys=keys))])
    code, details = code_of(stub.Put, put)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "at most 1000" in details
    # 1000 keys is fine, in up to 4 layouts: each is one more pass over the keys.
    ks = [b"k%015d" % i for i in range(1000)]
    assert client.lookup([ns] * 4, ks) == 0
    code, details = code_of(stub.Lookup, pb.LookupRequest(
        layout_ids=[lid] * 5, keys=pb.PackedKeys(data=b"".join(ks), key_size=16)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "layouts x keys" in details


def test_a_get_of_one_key_repeated_past_the_pool_is_refused(server):
    client = KVStoreClient(server.address)
    try:
        ns = client.register_layout(LAYOUT)
        key = b"repeated-key-000"
        client.put(ns, [key], np.full((1, ns.page_bytes), 7, np.uint8))
        stub = kvstore_pb2_grpc.KVStoreStub(client._channel)
        code, details = code_of(stub.Get, pb.GetRequest(
            layout_id=ns.layout_id, keys=pb.PackedKeys(data=key * 1025, key_size=len(key))))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "more than the pool" in details
        assert client.get(ns, [key] * 3).shape == (3, ns.page_bytes)    # repeats are fine
    finally:
        client.close()


def test_requests_of_any_size_leave_the_memory_bounded(server):
    """The attack of the issue: a Get naming one stored key millions of times. Past the
    message limit gRPC refuses it; at the key limit it is refused by bytes; the largest
    request allowed costs a bounded amount of memory."""
    client = KVStoreClient(server.address)
    try:
        small = PageLayout(model="limits-small", num_layers=1, page_tokens=1, num_kv_heads=1,
                           head_size=4, dtype="uint8")
        ns = client.register_layout(small)
        key = b"k" * 16
        client.put(ns, [key], np.full((1, ns.page_bytes), 7, np.uint8))
        stub = kvstore_pb2_grpc.KVStoreStub(client._channel)
        before = rss_bytes(server.proc.pid)
        code, _ = code_of(stub.Get, pb.GetRequest(
            layout_id=ns.layout_id, keys=pb.PackedKeys(data=key * 3_000_000, key_size=16)))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED           # 48 MiB: over 8 MiB
        code, _ = code_of(stub.Get, pb.GetRequest(
            layout_id=ns.layout_id, keys=pb.PackedKeys(data=key * 16_385, key_size=16)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        for _ in range(3):    # the largest Get allowed: 65,536 repeats of a 4-byte page
            got = sum(len(m.data) for m in stub.Get(pb.GetRequest(
                layout_id=ns.layout_id,
                keys=pb.PackedKeys(data=key * 16_384, key_size=16)), timeout=60))
            assert got == 16_384 * ns.page_bytes
            assert stub.Lookup(pb.LookupRequest(
                layout_ids=[ns.layout_id], keys=pb.PackedKeys(data=key * 16_384, key_size=16)),
                timeout=60).count == 16_384
        grew = rss_bytes(server.proc.pid) - before
        assert grew < 64 * MiB, f"RSS grew {grew / MiB:.1f} MiB"
    finally:
        client.close()


@pytest.mark.parametrize("small", [{"lease_ttl": "1s"}], indirect=True, ids=["ttl"])
def test_leases_are_capped_at_the_servers_ttl(small):
    _srv, client, ns, _stub = small
    keys = [b"lease-%010d" % i for i in range(4)]
    client.put(ns, keys, np.zeros((4, ns.page_bytes), np.uint8))
    lease = client.lookup_lease(ns, keys, lease_ms=2**32 - 1)
    assert lease.count == 4
    region = client.region()
    assert region is not None
    res = client.reserve(ns, [b"held-%011d" % i for i in range(8)], lease_ms=2**32 - 1)
    acq = client.acquire(ns, keys, lease_ms=2**32 - 1)
    assert client.stats().leases == 3
    # The client "dies": nothing is released. The server's ttl is 1 s.
    wait_for(lambda: not client.stats().leases, "the leases to expire", timeout=10,
             interval=0.2)
    # Expired, their slots are held back for another --lease-ttl (1 s).
    wait_for(lambda: not client.stats().held_back_pages, "the held-back slots to go",
             timeout=10, interval=0.2)
    s = client.stats()
    assert s.leases == 0 and s.leased_pages == 0 and s.held_back_pages == 0, s
    assert s.tiers[0].used_bytes == 4 * ns.page_bytes     # the reservation's slots freed
    del res, acq


def test_admin_force_breaks_a_dead_clients_reservations(fresh_server):
    """A client that reserved the pool and died: `clear` leaves its reservation in place
    until --lease-ttl, `clear --force` and `evict --force` end it now."""
    from .test_admin_cli import admin_json

    srv = fresh_server(lease_ttl="60s")
    with KVStoreClient(srv.address) as client:
        ns = client.register_layout(LAYOUT)
        client.reserve(ns, [b"dead-%011d" % i for i in range(64)])     # never committed
        stored = [b"live-%011d" % i for i in range(4)]
        client.put(ns, stored, np.zeros((4, ns.page_bytes), np.uint8))
        client.acquire(ns, stored)                                     # never released
        admin_json(srv.address, "clear", "--yes")          # leased: freed at release
        s = client.stats()
        assert s.leases == 2 and s.tiers[0].used_bytes == 68 * ns.page_bytes
        assert admin_json(srv.address, "clear", "--yes", "--force")["leases_broken"] == 2
        s = client.stats()
        assert s.leases == 0 and s.tiers[0].used_bytes == 0
        client.reserve(ns, [b"dead-%011d" % i for i in range(8)])
        assert admin_json(srv.address, "evict", "--all", "--force")["leases_broken"] == 1
        assert client.stats().tiers[0].used_bytes == 0


def test_a_put_of_keys_another_client_is_writing_says_in_flight(server):
    with KVStoreClient(server.address) as writer, \
            KVStoreClient(server.address, shared_memory=False) as other:
        ns = writer.register_layout(LAYOUT)
        ks = [b"inflight-%07d" % i for i in range(3)]
        res = writer.reserve(ns, ks[:2])
        try:
            stub = kvstore_pb2_grpc.KVStoreStub(other._channel)
            other.register_layout(LAYOUT)
            reply = stub.Put(iter([
                pb.PutRequest(header=pb.PutHeader(layout_id=ns.layout_id, keys=pb.PackedKeys(
                    data=b"".join(ks), key_size=len(ks[0])))),
                pb.PutRequest(data=bytes(3 * ns.page_bytes))]), timeout=10)
            assert (reply.stored, reply.skipped, reply.in_flight) == (1, 0, 2)
            # The client says it too, on each of its put paths.
            assert other.put(ns, ks, bytes(3 * ns.page_bytes)) == PutResult(0, 1, 2)
            with KVStoreClient(server.address) as third:
                again = third.reserve(third.register_layout(LAYOUT), ks)
                assert (again.skipped, again.in_flight) == (1, 2)
                again.abort()
        finally:
            res.abort()


@pytest.mark.parametrize("small", [{"lease_memory": "1MiB"}], indirect=True, ids=["leases"])
def test_leases_past_lease_memory_are_not_given(small):
    """A leased Lookup naming one page 16,384 times keeps a 128 KiB lease: unbounded, a
    client grew a server by 1.3 GB in 24 s so. Past --lease-memory a leased Lookup
    answers its count without a lease, Acquire is refused, and room comes back as leases
    end."""
    srv, client, ns, stub = small
    key = b"flood-key-000000"
    client.put(ns, [key], np.zeros((1, ns.page_bytes), np.uint8))
    flood = pb.LookupRequest(layout_ids=[ns.layout_id], keys=pb.PackedKeys(
        data=key * 16_384, key_size=len(key)), lease_ms=30_000)
    answers = [stub.Lookup(flood, timeout=30) for _ in range(40)]
    assert all(a.count == 16_384 for a in answers)
    held = [a.lease_id for a in answers if a.lease_id]
    assert 1 <= len(held) <= 8, f"{len(held)} leases of 128 KiB under 1 MiB"
    assert client.stats().leases == len(held)
    with pytest.raises(KVStoreError) as refused:
        client.acquire(ns, [key] * 16_384)
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--lease-memory" in refused.value.message
    assert "leased Lookup answered without a lease" in srv.log()
    for lease_id in held:
        assert stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease_id)).released
    client.acquire(ns, [key] * 16_384).release()
    wait_for(lambda: client.stats().leases == 0, "the release, which is sent async")


@pytest.mark.parametrize("small", [{"lease_memory": "1MiB"}], indirect=True, ids=["leases"])
def test_a_quiet_release_ahead_of_an_acquire_makes_its_room_first(small):
    """The leases fill --lease-memory; a quiet RELEASE of one and an ACQUIRE of as much
    come in one send. A quiet release is held back for the frame behind it
    (fastpath/connection.py), but not for an ACQUIRE, which the leases' memory can
    refuse: the release applies first and the acquire is granted."""
    srv, client, ns, stub = small
    key = b"ahead-key-000000"
    client.put(ns, [key], np.zeros((1, ns.page_bytes), np.uint8))
    flood = pb.LookupRequest(layout_ids=[ns.layout_id], keys=pb.PackedKeys(
        data=key * 16_384, key_size=len(key)), lease_ms=600_000)
    held = [a.lease_id for a in (stub.Lookup(flood, timeout=30) for _ in range(40))
            if a.lease_id]
    with pytest.raises(KVStoreError) as refused:               # full
        client.acquire(ns, [key] * 16_384)
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    raw = Raw(unix_path(srv), hello=False)
    try:
        raw.send(fw.Op.HELLO, flags=fw.QUIET)
        status, _, _ = raw.answer()
        assert status == 0
        acquire = fw.LEASED_HEAD.pack(ns.layout_id, client.region().token, 30_000) \
            + fw.encode_keys(len(key), key * 16_384)
        raw.sock.sendall(fw.encode_header(fw.Op.RELEASE, fw.LEASE.size, flags=fw.QUIET)
                         + fw.LEASE.pack(held[0])
                         + fw.encode_header(fw.Op.ACQUIRE, len(acquire)) + acquire)
        status, answer, _ = raw.answer()
        assert status == 0, bytes(answer)
        (lease_id,) = fw.LEASE.unpack_from(answer)
        assert lease_id and client.stats().leases == len(held)    # one out, one in
    finally:
        raw.close()
    for lease_id in held[1:]:
        assert stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease_id)).released
