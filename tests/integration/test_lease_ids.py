"""A client ends only the leases it was given: lease ids cannot be guessed from one it
holds, and a Put or Get stream's own lease is out of every client's reach.

Without an auth file every client is one tenant, so a lease's id is all that proves its
holder. With counted ids a client that took one lease named its neighbours: it aborted
another client's Put in flight, the freed slot went to a third client's page, and the
stalled writer's bytes then landed in that committed page."""

from __future__ import annotations

import threading

import grpc

from kvstore_client import KVStoreClient, PageLayout
from kvstore_protocol._proto.kvstore.v1 import kvstore_pb2 as pb, kvstore_pb2_grpc

LAYOUT = PageLayout(model="lease-ids", num_layers=2, page_tokens=4, num_kv_heads=2,
                    head_size=16, dtype="float32")       # 2 KiB pages
NEAR = 300          # ids tried on each side of one the attacker holds


def packed(*keys: bytes) -> pb.PackedKeys:
    return pb.PackedKeys(data=b"".join(keys), key_size=len(keys[0]))


def test_a_client_cannot_end_another_clients_put_or_get(fresh_server):
    srv = fresh_server(dram="64MiB")
    with KVStoreClient(srv.address) as client, grpc.insecure_channel(srv.address) as ch:
        ns = client.register_layout(LAYOUT)
        lid, page = ns.layout_id, ns.page_bytes
        stub = kvstore_pb2_grpc.KVStoreStub(ch)
        client.put(ns, [b"probe-key-000000"], bytes(page))
        many = [b"many-%011d" % i for i in range(400)]
        client.put(ns, many, b"\x11" * page * len(many))

        # Writer A: a Put whose header is in (its slot reserved) and whose bytes wait.
        go, result = threading.Event(), {}

        def messages():
            yield pb.PutRequest(header=pb.PutHeader(layout_id=lid,
                                                    keys=packed(b"writer-A-0000000")))
            go.wait(30)
            yield pb.PutRequest(data=b"\xAA" * page)

        def write_a():
            try:
                result["a"] = stub.Put(messages(), timeout=30).stored
            except grpc.RpcError as exc:
                result["a"] = exc.code()

        writer = threading.Thread(target=write_a)
        writer.start()
        # Reader R: a Get stream in flight (its pages pinned by the server's lease).
        reading = stub.Get(pb.GetRequest(layout_id=lid, keys=packed(*many)), timeout=30)
        first = next(reading)
        try:
            # The attacker takes one lease and tries the ids around it.
            held = stub.Lookup(pb.LookupRequest(layout_ids=[lid],
                                                keys=packed(b"probe-key-000000"),
                                                lease_ms=5000)).lease_id
            assert held
            ended = []
            for guess in range(max(1, held - NEAR), held + NEAR):
                if guess == held:
                    continue
                if stub.Abort(pb.AbortRequest(lease_id=guess)).aborted:
                    ended.append(("abort", guess))
                if stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=guess)).released:
                    ended.append(("release", guess))
                try:
                    stub.Commit(pb.CommitRequest(lease_id=guess))
                    ended.append(("commit", guess))
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, exc.details()
            assert not ended, f"another client's leases ended by guessed ids: {ended}"
            assert stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=held)).released
            # Deleting the read pages and storing others must not reach the Get's slots.
            client.delete(ns, many)
            client.put(ns, [b"client-B-0000000"], b"\xBB" * page)
            client.put(ns, [b"fill-%011d" % i for i in range(400)], b"\x77" * page * 400)
            rest = b"".join(m.data for m in reading)
        finally:
            go.set()
            writer.join(30)
        assert result["a"] == 1
        got = client.get(ns, [b"writer-A-0000000", b"client-B-0000000"])
        assert bytes(got[0]) == b"\xAA" * page and bytes(got[1]) == b"\xBB" * page
        assert set(first.data + rest) == {0x11}, "the Get sent bytes of other pages"
        assert client.stats().leases == 0
