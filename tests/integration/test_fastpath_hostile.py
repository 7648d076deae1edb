"""The fast path against peers that do not play along, on plain TCP, TLS and the Unix socket.

Each test stands for a way a peer was seen to take the server's memory, threads or pins:
a HELLO that declares a huge body, a HELLO trickled a byte at a time, a TLS peer that
shakes hands and says nothing, crowds of such peers, one tenant's idle connections, and
a Get whose reader stops reading. The bounds they check are the ones docs/fastpath.md
states under "Bounds".
"""

from __future__ import annotations

import socket
import ssl
import threading
import time

import numpy as np
import pytest

from kvstore_client import KVStoreClient
from kvstore_protocol import fastwire as fw
from kvstore_testing.serverproc import ServerProcess
from tests.integration.test_fastpath import (
    LAYOUTS,
    TOKENS,
    Raw,
    _auth_file,
    fast_address,
    keys,
    pages,
    pki,
    unix_path,
)
from tests.waiting import wait_for

__all__ = ["pki"]           # the fixture, imported so that the TLS tests here can use it

STREAM_TIMEOUT = 2.0        # --stream-timeout of the servers here: also the HELLO deadline


def rss(pid: int) -> int:
    """Resident bytes of a process (VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class TlsRaw(Raw):
    """Raw over TLS: the handshake done, then frames as the test builds them."""

    def __init__(self, address: str, ca: str, token: str = "", hello: bool = True) -> None:
        host, _, port = address.rpartition(":")
        ctx = ssl.create_default_context(cafile=ca)
        self.sock = ctx.wrap_socket(socket.create_connection((host, int(port))),
                                    server_hostname=host)
        self.sock.settimeout(10)
        if hello:
            status, body = self.call(fw.Op.HELLO, token.encode())
            assert status == 0, body


def _tls_server(pki, **flags) -> ServerProcess:
    from tests.integration.test_tls import creds
    return ServerProcess(credentials=creds(pki), tls_cert=pki / "server.pem",
                         tls_key=pki / "server.key", **flags).start()


def _connect(srv: ServerProcess, transport: str, pki, **kw) -> Raw:
    if transport == "tls":
        return TlsRaw(fast_address(srv), str(pki / "ca.pem"), **kw)
    return Raw(unix_path(srv) if transport == "unix" else fast_address(srv), **kw)


@pytest.fixture(params=["tcp", "unix", "tls"])
def hostile(request, pki):
    """(server, transport): a server with a short --stream-timeout, reached over one
    transport; the TLS one serves TLS on its TCP port."""
    flags = {"stream_timeout": f"{STREAM_TIMEOUT}s", "dram": "128MiB"}
    srv = _tls_server(pki, **flags) if request.param == "tls" else ServerProcess(**flags).start()
    try:
        yield srv, request.param
    finally:
        srv.stop()


def _answered_or_closed(raw: Raw, wait: float) -> tuple[int, bytes] | None:
    """The frame the server sent before it closed (status, body), (-1, b"") if it
    closed without one; None if it did neither within `wait` seconds. (Not select():
    a TLS socket is readable when the server sends a session ticket.)"""
    raw.sock.settimeout(max(wait, 0.01))
    try:
        status, body, _ = raw.answer()
    except TimeoutError:
        return None
    except (ConnectionError, OSError):
        return -1, b""
    finally:
        raw.sock.settimeout(10)
    return status, body


# -- memory before authentication ----------------------------------------------------------
def test_a_huge_hello_is_refused_before_its_body_is_allocated(hostile, pki):
    """A HELLO header declaring a 60 MiB body, twelve times over: before, each was
    allocated (zero-filled, so resident) before a byte of the token was read, +720 MiB.
    Now it is refused at once with a PROTOCOL frame that says why, and the server's RSS
    moves by at most the bound docs/fastpath.md states (a few MiB for 12 connections;
    32 MiB leaves room for the allocator and the interpreter's own noise)."""
    srv, transport = hostile
    _connect(srv, transport, pki).close()            # warm: the first connection's setup
    before = rss(srv.proc.pid)
    crowd = [_connect(srv, transport, pki, hello=False) for _ in range(12)]
    for raw in crowd:
        raw.sock.sendall(fw.encode_header(fw.Op.HELLO, 60 << 20) + b"tok")
    time.sleep(1.0)                          # what an allocation would take, and more
    grown = rss(srv.proc.pid) - before
    assert grown < 32 << 20, f"server RSS grew {grown >> 20} MiB for 12 HELLO headers"
    for raw in crowd:
        got = _answered_or_closed(raw, 10)
        assert got is not None and got[0] == fw.Status.PROTOCOL, got
        assert b"over the limit of 4096 bytes" in got[1]
        raw.close()
    good = _connect(srv, transport, pki)             # and the server serves on
    good.close()


# -- deadlines -------------------------------------------------------------------------------
def test_a_trickled_or_silent_hello_is_cut_off_at_its_deadline(hostile, pki):
    """A HELLO trickled a byte every 0.25 s had its per-receive timeout renewed by every
    byte and was never cut off; over TLS a peer that shook hands and sent nothing was
    open 20 s later with a 3 s timeout. Now the handshake and HELLO have one deadline
    (--stream-timeout here, at most 10 s): both are closed after it, the trickler long
    before its 24-byte header is through."""
    srv, transport = hostile
    trickler = _connect(srv, transport, pki, hello=False)
    silent = _connect(srv, transport, pki, hello=False)
    header = fw.encode_header(fw.Op.HELLO, 0)
    got = None
    for i, byte in enumerate(header):  # noqa: B007 - i is read after the loop
        try:
            trickler.sock.sendall(bytes([byte]))
        except OSError:
            got = (-1, b"")
            break
        got = _answered_or_closed(trickler, 0.25)
        if got is not None:
            break
    assert got is not None, "the whole trickled HELLO went through: no deadline"
    assert i < len(header) - 1
    assert got[0] in (fw.Status.UNAUTHENTICATED, -1), got
    # The silent one: closed by now, or within a little more than the deadline.
    got = _answered_or_closed(silent, 3 * STREAM_TIMEOUT)
    assert got is not None, "a silent connection outlived the HELLO deadline"
    for raw in (trickler, silent):
        raw.close()


def test_unauthenticated_peers_have_their_own_small_budget(pki):
    """Peers that connect and never authenticate take places of --data-hello-connections,
    not of --data-connections: 24 of them made every valid tenant's HELLO BUSY when they
    shared one budget. Past the hello budget, BUSY at once with the flag named; once their
    deadline has passed, their places are free again."""
    srv = ServerProcess(stream_timeout=f"{STREAM_TIMEOUT}s", data_connections=4,
                        data_hello_connections=26).start()
    try:
        silent = [Raw(fast_address(srv), hello=False) for _ in range(24)]
        good = Raw(fast_address(srv))                      # authenticated: a place of 4
        more = [Raw(fast_address(srv), hello=False) for _ in range(2)]
        over = Raw(fast_address(srv), hello=False)         # hello budget full
        got = _answered_or_closed(over, 5)
        assert got is not None and got[0] == fw.Status.BUSY, got
        assert b"--data-hello-connections" in got[1]
        with KVStoreClient(srv.address, shared_memory=False, data_plane=True) as c:
            wait_for(lambda: all(_answered_or_closed(r, 0) is not None
                                 for r in silent + more), "the silent peers' deadline",
                     timeout=10 * STREAM_TIMEOUT)
            ns = c.register_layout(LAYOUTS["tiny"])          # over the fast path again
            c.put(ns, keys("budget", 2), pages(2, ns.page_bytes))
            assert c.fast_path() is not None
        status, _ = good.call(fw.Op.EXISTS, fw.LAYOUT_HEAD.pack(ns.layout_id)
                              + fw.encode_keys(20, b"".join(keys("budget", 2))))
        assert status == 0
        for raw in (*silent, *more, over, good):
            raw.close()
    finally:
        srv.stop()


def test_one_tenant_holds_at_most_its_share_of_connections(tmp_path):
    """With an auth file a tenant may hold half of --data-connections, as it may half of
    the gRPC streams (stream_gate.tenant_share): tenant B's idle connections made tenant
    A's HELLO BUSY before."""
    path = tmp_path / "auth.toml"
    _auth_file(path, ["a", "b"])
    srv = ServerProcess(auth_file=str(path), data_connections=4).start()
    try:
        b = [Raw(fast_address(srv), TOKENS["b"]) for _ in range(2)]
        refused = Raw(fast_address(srv), hello=False)
        status, body = refused.call(fw.Op.HELLO, TOKENS["b"].encode())
        assert status == fw.Status.BUSY and b"'b' has 2 fast-path connections" in body
        assert refused.closed()
        a = Raw(fast_address(srv), TOKENS["a"])          # A is served
        for raw in (*b, refused, a):
            raw.close()
    finally:
        srv.stop()


@pytest.mark.parametrize("reader", ["stops", "crawls"])
@pytest.mark.parametrize("transport", ["tcp", "tls"])
def test_a_get_whose_reader_stops_or_crawls_releases_its_pins(pki, transport, reader):
    """A Get of 48 MiB whose reader reads nothing: its pins were held until the 300 s
    idle timeout on plain TCP, and without end over TLS (a blocking SSL socket retries
    after SO_SNDTIMEO). One whose reader takes 16 KiB every half second would have held
    them for the 25 minutes the Get takes at that pace. Now a Get's reader must take
    1 MiB within each --stream-timeout, gRPC's stream watchdog's rule: one that does not
    loses the connection and the pins within twice that."""
    flags = {"stream_timeout": f"{STREAM_TIMEOUT}s", "dram": "128MiB"}
    srv = _tls_server(pki, **flags) if transport == "tls" else ServerProcess(**flags).start()
    try:
        tls = {"tls_ca": str(pki / "ca.pem")} if transport == "tls" else {}
        with KVStoreClient(srv.address, shared_memory=False, data_plane=False, **tls) as c:
            ns = c.register_layout(LAYOUTS["1MiB"])
            ks = keys("stall", 48)
            c.put(ns, ks, pages(48, ns.page_bytes))
        raw = _connect(srv, transport, pki)
        if transport == "tcp":                       # as little as the kernel allows
            raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        raw.send(fw.Op.GET, fw.LAYOUT_HEAD.pack(ns.layout_id)
                 + fw.encode_keys(20, b"".join(ks)))
        crawling = threading.Event()

        def crawl() -> None:
            while not crawling.is_set():
                try:
                    if not raw.sock.recv(16 << 10):
                        return
                except OSError:
                    return
                time.sleep(0.5)

        if reader == "crawls":
            threading.Thread(target=crawl, daemon=True).start()
        def leases() -> int:
            with KVStoreClient(srv.address, data_plane=False, **tls) as admin:
                return admin.stats().leases

        wait_for(lambda: leases() == 1, "the Get's pins")
        started = time.monotonic()
        wait_for(lambda: leases() == 0, "the stalled Get's pins to go",
                 timeout=15 * STREAM_TIMEOUT)
        assert time.monotonic() - started < 300      # not the idle timeout's
        crawling.set()
        raw.close()
    finally:
        srv.stop()


# -- request limits --------------------------------------------------------------------------
def test_the_default_key_limit_is_the_servers_on_the_fast_path():
    """At the default --max-keys-per-request (16,384) a request of 16,385 keys is refused
    on the fast path with gRPC's status and message, and 16,384 are served."""
    import grpc

    from kvstore_protocol._proto.kvstore.v1 import kvstore_pb2 as pb, kvstore_pb2_grpc
    with ServerProcess() as srv, KVStoreClient(srv.address, data_plane=False) as c:
        ns = c.register_layout(LAYOUTS["tiny"])
        over = b"".join(keys("limit", 16_385))
        raw = Raw(fast_address(srv))
        status, message = raw.call(fw.Op.EXISTS, fw.LAYOUT_HEAD.pack(ns.layout_id)
                                   + fw.encode_keys(20, over))
        with pytest.raises(grpc.RpcError) as err:
            kvstore_pb2_grpc.KVStoreStub(c._channel).Exists(pb.ExistsRequest(
                layout_id=ns.layout_id, keys=pb.PackedKeys(data=over, key_size=20)),
                timeout=30)
        assert fw.GRPC_CODES[fw.Status(status)] == err.value.code()
        assert message.decode() == err.value.details()
        assert b"at most 16384 per request" in message
        status, answer = raw.call(fw.Op.EXISTS, fw.LAYOUT_HEAD.pack(ns.layout_id)
                                  + fw.encode_keys(20, over[:16_384 * 20]))
        assert status == 0 and fw.COUNT.unpack_from(answer) == (16_384,)
        assert not np.any(np.frombuffer(answer[fw.COUNT.size:], dtype=np.uint8))
        raw.close()


# -- whose reservation -----------------------------------------------------------------------
def test_a_reservation_is_its_tenants_to_end_on_any_of_its_connections(tmp_path):
    """Settled: a lease (a reservation too) belongs to its tenant, not to the connection
    that took it, and is ended by its id on any of the tenant's connections. The client
    library relies on it: a lease lane whose call timed out is retired with its leases,
    and they are ended over the lane that replaced it (kvstore_client/holdings.py).
    Another tenant's COMMIT reads as one of an unknown id and leaves the reservation be."""
    import hashlib
    path = tmp_path / "auth.toml"
    path.write_text("".join(
        f'[tenants.{name}]\ntoken_sha256 = "{hashlib.sha256(TOKENS[name].encode()).hexdigest()}"'
        "\nshared_memory = true\n" for name in ("a", "b")))
    srv = ServerProcess(auth_file=str(path)).start()
    try:
        with KVStoreClient(srv.address, token=TOKENS["a"], data_plane=False) as c:
            ns = c.register_layout(LAYOUTS["tiny"])
            region = c.region().token
            ks = keys("owned", 2)
            a1, a2 = Raw(fast_address(srv), TOKENS["a"]), Raw(fast_address(srv), TOKENS["a"])
            b = Raw(fast_address(srv), TOKENS["b"])
            status, answer = a1.call(fw.Op.RESERVE, fw.LEASED_HEAD.pack(
                ns.layout_id, region, 60_000) + fw.encode_keys(20, b"".join(ks)))
            assert status == 0, answer
            lease = fw.RESERVED.unpack_from(answer)[0]
            status, answer = b.call(fw.Op.COMMIT, fw.LEASE.pack(lease))
            assert status == fw.Status.EXPIRED and b"unknown" in answer, answer
            assert c.lookup(ns, ks) == 0
            status, answer = a2.call(fw.Op.COMMIT, fw.LEASE.pack(lease))
            assert status == 0 and fw.LEASE.unpack_from(answer)[0] == 2, answer
            assert c.lookup(ns, ks) == 2
            status, _ = a1.call(fw.Op.COMMIT, fw.LEASE.pack(lease))      # ended once
            assert status == fw.Status.EXPIRED
            for raw in (a1, a2, b):
                raw.close()
    finally:
        srv.stop()
