"""The fast path's CALL frame against a real kvstore-server: a unary call with no frame of
its own carried whole (kvstore_protocol.carriage), served by the gRPC servicer's method.

What a client gets over CALL is what gRPC answers for the same request: the same answer,
the same refusal with the same status and message. A name the server does not carry, an
Admin call, bytes that do not parse and a body past the bound each get a clear error and
the connection goes on; a server that does not grant CALLS (an older one) is asked over
gRPC instead, with the fast path kept for the rest.
"""

from __future__ import annotations

import hashlib
import signal
import socket
import threading

import grpc
import pytest

from kvstore_client import KVStoreClient
from kvstore_client.fastpath import FastPath
from kvstore_client.transport import NotCarried
from kvstore_protocol import fastwire as fw
from kvstore_protocol._proto.kvstore.v1 import kvstore_pb2 as pb, kvstore_pb2_grpc
from kvstore_protocol.carriage import encode_call
from kvstore_testing.serverproc import ServerProcess, free_port
from tests.integration.test_fastpath import LAYOUTS, Raw, fast_address, keys, metric, pages
from tests.waiting import wait_for

FAST = 'kvstore_rpc_total{code="%s",method="FastCall"}'
GRPC = 'kvstore_rpc_total{code="%s",method="%s"}'


@pytest.fixture(scope="module")
def srv():
    port = free_port()
    with ServerProcess(dram="64MiB", metrics_port=port) as server:
        server.metrics_port = port
        yield server


def call(raw: Raw, method: str, request: bytes | pb.RetainRequest) -> tuple[int, bytes]:
    payload = request if isinstance(request, bytes) else request.SerializeToString()
    return raw.call(fw.Op.CALL, encode_call(method, payload))


def test_hello_grants_calls_to_a_client_that_offers_them(srv):
    raw = Raw(fast_address(srv), hello=False)
    raw.send(fw.Op.HELLO, flags=fw.CALLS | fw.QUIET)
    status, _, _ = raw.answer()
    assert status == 0
    raw.close()
    fast = FastPath(fast_address(srv))
    fast.check()
    assert fast.carries
    fast.close()


def test_retention_and_removals_ride_the_fast_path(srv):
    port = srv.metrics_port
    before = {m: metric(port, GRPC % ("OK", m)) for m in ("Retain", "Removals")}
    fast_before = metric(port, FAST % "OK")
    with KVStoreClient(srv.address, shared_memory=False, data_plane=True) as c:
        ns = c.register_layout(LAYOUTS["tiny"])
        c.put(ns, keys("carried", 4), pages(4, ns.page_bytes))
        start = c.removals([ns])
        kept = c.retain(ns, keys("carried", 4), "session-1", 30.0)
        assert (kept.pages, kept.retained) == (4, True)
        assert [r.pages for r in c.retain_many(ns, [("session-2", 30.0, keys("carried", 2)),
                                                    ("session-3", 30.0, keys("carried", 3))])
                ] == [2, 3]
        assert c.release_retention("session-1") == 4
        assert c.release_retention("no-such-session") == 0
        c.delete(ns, keys("carried", 1))
        got = c.removals([ns], start.next_seq, start.epoch)
        assert [e.key for e in got.entries] == keys("carried", 1)
    # Six calls went over CALL frames, none over gRPC.
    wait_for(lambda: metric(port, FAST % "OK") == fast_before + 6, "six carried calls")
    assert {m: metric(port, GRPC % ("OK", m)) for m in before} == before


def test_a_carried_call_answers_as_grpc_does_for_the_same_request(srv):
    """Byte for byte: the servicer's method serializes the one answer both doors send."""
    with KVStoreClient(srv.address, shared_memory=False, data_plane=False) as c:
        ns = c.register_layout(LAYOUTS["tiny"])
        c.put(ns, keys("same", 3), pages(3, ns.page_bytes))
        stub = kvstore_pb2_grpc.KVStoreStub(c._channel)
        request = pb.RemovalsRequest(layout_ids=[ns.layout_id])
        via_grpc = stub.Removals(request, timeout=10)
    raw = Raw(fast_address(srv))
    status, body = call(raw, "Removals", request)
    assert status == 0, body
    assert pb.RemovalsResponse.FromString(body) == via_grpc
    raw.close()


@pytest.mark.parametrize(("method", "payload", "status", "words"), [
    ("Frobnicate", b"", fw.Status.UNIMPLEMENTED, "no call named 'Frobnicate'"),
    ("Lookup", b"", fw.Status.UNIMPLEMENTED, "not carried on the fast path"),
    ("Attach", b"", fw.Status.UNIMPLEMENTED, "not carried on the fast path"),
    ("RegisterLayout", b"", fw.Status.UNIMPLEMENTED, "not carried on the fast path"),
    ("Get", b"", fw.Status.UNIMPLEMENTED, "not carried on the fast path"),
    ("LookupStream", b"", fw.Status.UNIMPLEMENTED, "not carried on the fast path"),
    ("Clear", b"", fw.Status.DENIED, "Clear is an Admin call"),
    ("Evict", pb.RetainRequest().SerializeToString(), fw.Status.DENIED, "Evict is an Admin call"),
    ("Retain", b"\xff\xff\xff", fw.Status.INVALID, "malformed request"),
    ("RetainMany", b"\x0a\x80", fw.Status.INVALID, "malformed request"),
    ("Retain", pb.RetainRequest(layout_id=b"x" * 16, session="s", ttl_ms=1000)
     .SerializeToString(), fw.Status.INVALID, "unknown layout"),
])
def test_refusals_are_clear_and_the_connection_goes_on(srv, method, payload, status, words):
    raw = Raw(fast_address(srv))
    got, body = call(raw, method, payload)
    assert (got, words in body.decode()) == (status, True), body
    # In step: the next call on the same connection is answered.
    got, body = call(raw, "ReleaseRetention", pb.ReleaseRetentionRequest(session="nobody"))
    assert got == 0 and pb.ReleaseRetentionResponse.FromString(body).pages == 0
    raw.close()


@pytest.mark.parametrize(("body", "words"), [
    (b"", "starts with its method's name"),
    (b"\x00Retain", "in 1..64 bytes"),
    (b"\x41Retain", "in 1..64 bytes"),           # says 65 bytes
    (b"\x20" + b"R" * 10, "holds 10"),            # says 32, holds 10
    (b"\x06Ret in", "not a name"),
    (b"\x06Ret\xffin", "not a name"),
])
def test_a_malformed_call_body_is_invalid_and_the_connection_goes_on(srv, body, words):
    raw = Raw(fast_address(srv))
    status, message = raw.call(fw.Op.CALL, body)
    assert (status, words in message.decode()) == (fw.Status.INVALID, True), message
    assert call(raw, "ReleaseRetention", pb.ReleaseRetentionRequest(session="x"))[0] == 0
    raw.close()


def test_a_call_past_the_message_bound_is_refused_before_it_is_parsed(fresh_server):
    srv = fresh_server(dram="16MiB", max_keys_per_request=1000)
    limit = 8 << 20                       # limits.request_message_bytes: at least 8 MiB
    raw = Raw(fast_address(srv))
    body = encode_call("Retain", bytes(limit + 66))
    status, message = raw.call(fw.Op.CALL, body)
    assert status == fw.Status.EXHAUSTED and b"over the limit" in message, message
    assert call(raw, "ReleaseRetention", pb.ReleaseRetentionRequest(session="x"))[0] == 0
    # gRPC refuses the same message past its bound with the same code.
    with KVStoreClient(srv.address, shared_memory=False, data_plane=False) as c, \
            pytest.raises(grpc.RpcError) as err:
        kvstore_pb2_grpc.KVStoreStub(c._channel).Retain(
            pb.RetainRequest(session="s" * (limit + 66)), timeout=30)
    assert err.value.code() == fw.GRPC_CODES[fw.Status.EXHAUSTED]
    raw.close()


def test_a_carried_call_meets_the_same_limits_as_grpc(fresh_server):
    """The rules are calls.py's, once: both doors refuse with one status and message."""
    srv = fresh_server(max_keys_per_request=1000, dram="16MiB")
    with KVStoreClient(srv.address, shared_memory=False, data_plane=False) as c:
        ns = c.register_layout(LAYOUTS["tiny"])
        stub = kvstore_pb2_grpc.KVStoreStub(c._channel)
        lid = ns.layout_id
        over = pb.PackedKeys(data=b"".join(keys("over", 1001)), key_size=20)
        cases = [
            ("Retain", stub.Retain, pb.RetainRequest(layout_id=lid, keys=over, session="s",
                                                     ttl_ms=1000)),
            ("RetainMany", stub.RetainMany, pb.RetainManyRequest(layout_id=lid, keys=over)),
            ("RetainMany", stub.RetainMany, pb.RetainManyRequest(
                layout_id=lid, keys=pb.PackedKeys(data=b"k" * 20, key_size=20),
                sessions=[pb.RetainSession(session=f"s{i}", ttl_ms=1000)
                          for i in range(1025)])),
            ("RetainMany", stub.RetainMany, pb.RetainManyRequest(
                layout_id=lid, keys=pb.PackedKeys(data=b"k" * 20, key_size=20),
                sessions=[pb.RetainSession(session="s", ttl_ms=1000, key_index=b"\1\0\0")])),
            ("Removals", stub.Removals, pb.RemovalsRequest(layout_ids=[lid] * 257)),
            ("Retain", stub.Retain, pb.RetainRequest(
                layout_id=b"?" * 16, keys=pb.PackedKeys(data=b"k" * 20, key_size=20),
                session="s", ttl_ms=1000)),
        ]
        raw = Raw(fast_address(srv))
        for method, grpc_call, request in cases:
            status, message = call(raw, method, request)
            with pytest.raises(grpc.RpcError) as err:
                grpc_call(request, timeout=30)
            assert status != 0, (method, message)
            assert fw.GRPC_CODES[fw.Status(status)] == err.value.code(), (method, message)
            assert message.decode() == err.value.details(), method
        raw.close()


def _auth(tmp_path, names: tuple[str, ...]) -> tuple[str, dict[str, str]]:
    tokens = {name: f"tok-carried-{name}" for name in names}
    path = tmp_path / "auth.toml"
    path.write_text("".join(
        f'[tenants.{n}]\ntoken_sha256 = "{hashlib.sha256(t.encode()).hexdigest()}"\n\n'
        for n, t in tokens.items()))
    return str(path), tokens


def test_a_carried_call_acts_for_the_connections_tenant(fresh_server, tmp_path):
    """Another tenant's layout is unknown over CALL as over gRPC; a session is the
    tenant's own; a revoked token stops carried calls on an open connection."""
    path, tokens = _auth(tmp_path, ("a", "b"))
    srv = fresh_server(dram="16MiB", auth_file=path)
    with KVStoreClient(srv.address, token=tokens["a"], shared_memory=False,
                       data_plane=True) as a, \
            KVStoreClient(srv.address, token=tokens["b"], shared_memory=False,
                          data_plane=True) as b:
        ns = a.register_layout(LAYOUTS["tiny"])
        a.put(ns, keys("mine", 2), pages(2, ns.page_bytes))
        assert a.retain(ns, keys("mine", 2), "a-session", 30.0).pages == 2
        raw = Raw(fast_address(srv), token=tokens["b"])
        status, message = call(raw, "Retain", pb.RetainRequest(
            layout_id=ns.layout_id, keys=pb.PackedKeys(data=keys("mine", 1)[0], key_size=20),
            session="b-session", ttl_ms=1000))
        assert (status, b"unknown layout" in message) == (fw.Status.INVALID, True), message
        raw.close()
        # b's client registers a layout it is told is unknown (its restart mend), as b's
        # own: none of a's pages are in it.
        assert b.retain(ns, keys("mine", 2), "b-session", 30.0).pages == 0
        assert b.release_retention("a-session") == 0        # not b's session
    raw = Raw(fast_address(srv), token=tokens["a"])
    assert call(raw, "ReleaseRetention", pb.ReleaseRetentionRequest(session="a-session")) \
        == (0, pb.ReleaseRetentionResponse(pages=2).SerializeToString())
    # Token a revoked (SIGHUP reloads the file): the open connection's next CALL is refused.
    _auth(tmp_path, ("b",))
    srv.send_signal(signal.SIGHUP)
    wait_for(lambda: call(raw, "ReleaseRetention", pb.ReleaseRetentionRequest(session="x"))[0]
             == fw.Status.UNAUTHENTICATED, "the revoked token refused", timeout=10)
    raw.close()


class _OldServer:
    """A TCP proxy to the fast path that clears CALLS from the HELLO answer: the server as
    one from before CALL frames answers (it grants only the flags it knows)."""

    def __init__(self, target: str) -> None:
        self.target = target.rsplit(":", 1)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection((self.target[0], int(self.target[1])))
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, hello: bool) -> None:
        try:
            if hello:                    # the HELLO answer's header: flags at bytes 6-7
                head = bytearray()
                while len(head) < fw.HEADER.size:
                    head += src.recv(fw.HEADER.size - len(head))
                flags = int.from_bytes(head[6:8], "little") & ~fw.CALLS
                head[6:8] = flags.to_bytes(2, "little")
                dst.sendall(head)
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                s.close()

    def close(self) -> None:
        self.listener.close()


def test_a_server_without_calls_is_asked_over_grpc_and_the_fast_path_stays(srv):
    port = srv.metrics_port
    old = _OldServer(fast_address(srv))
    try:
        fast = FastPath(old.address)
        fast.check()
        assert not fast.carries
        with pytest.raises(NotCarried):
            fast.unary("ReleaseRetention", pb.ReleaseRetentionRequest(session="x"))
        fast.close()
        grpc_before = metric(port, GRPC % ("OK", "ReleaseRetention"))
        exists_before = metric(port, 'kvstore_rpc_total{code="OK",method="FastExists"}')
        with KVStoreClient(srv.address, shared_memory=False, data_plane=True,
                           data_address=old.address) as c:
            ns = c.register_layout(LAYOUTS["tiny"])
            assert c.release_retention("nobody") == 0
            assert c.exists(ns, keys("none", 2)) == [False, False]
        wait_for(lambda: metric(port, GRPC % ("OK", "ReleaseRetention")) == grpc_before + 1
                 and metric(port, 'kvstore_rpc_total{code="OK",method="FastExists"}')
                 == exists_before + 1, "ReleaseRetention over gRPC, Exists over the fast path")
    finally:
        old.close()


def test_a_method_the_server_does_not_carry_goes_over_grpc(srv):
    fast = FastPath(fast_address(srv))
    fast.check()
    with pytest.raises(NotCarried):             # a unary KVStore call the server keeps
        fast.unary("RegisterLayout", pb.RegisterLayoutRequest())
    with pytest.raises(NotCarried):             # not a unary call of the service at all
        fast.unary("Get", pb.GetRequest())
    # The connection it used is still in step.
    assert fast.unary("ReleaseRetention", pb.ReleaseRetentionRequest(session="x")).pages == 0
    fast.close()


def test_a_call_added_in_four_files_rides_both_transports(fresh_server):
    """Limits was added by the proto, calls.py, service.py (its name in CARRIED) and
    client.py alone (docs/architecture.md, "Adding a call"): both transports answer it."""
    port = free_port()
    srv = fresh_server(dram="16MiB", max_keys_per_request=1000, metrics_port=port)
    with KVStoreClient(srv.address, shared_memory=False, data_plane=True) as fast, \
            KVStoreClient(srv.address, shared_memory=False, data_plane=False) as slow:
        got = fast.limits()
        assert got == slow.limits()
        assert (got.max_keys_per_request, got.max_request_bytes, got.max_lookup_layouts,
                got.max_retain_sessions) == (1000, 8 << 20, 256, 1024)
    wait_for(lambda: metric(port, FAST % "OK") == 1
             and metric(port, GRPC % ("OK", "Limits")) == 1, "one Limits on each door")
