"""The fast path beside gRPC against a real kvstore-server: bytes, auth, bounds, faults.

Every page that comes back is compared byte for byte with what went in. The raw frames
here are built with kvstore_protocol.fastwire, so a test can send what no client would.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import signal
import socket
import threading
import time
import urllib.request

import numpy as np
import pytest

from kvstore_client import KVStoreClient, KVStoreError, PageLayout
from kvstore_client.fastpath import FastPath, FastPathUnavailable
from kvstore_protocol import fastwire as fw
from kvstore_testing.serverproc import ServerProcess, free_port, sigstop
from tests.waiting import wait_for

LAYOUTS = {
    "tiny": PageLayout(model="fp-tiny", num_layers=1, page_tokens=1, num_kv_heads=1,
                       head_size=8, dtype="int8"),                       # 16-byte pages
    "odd": PageLayout(model="fp-odd", num_layers=3, page_tokens=5, num_kv_heads=3,
                      head_size=24, dtype="float16"),                    # not 4 KiB-aligned
    "mla": PageLayout(model="fp-mla", num_layers=4, page_tokens=16, num_kv_heads=1,
                      head_size=576, kv_factor=1),
    "1MiB": PageLayout(model="fp-1m", num_layers=32, page_tokens=16, num_kv_heads=8,
                       head_size=64),
}


def keys(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode().ljust(20, b".") for i in range(n)]


def pages(n: int, page_bytes: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, page_bytes), dtype=np.uint8)


def fast_address(srv: ServerProcess) -> str:
    return f"127.0.0.1:{srv.port + 1}"


def unix_path(srv: ServerProcess) -> str:
    # The line comes once the fast path is up, which may be just after the server answers
    # its first health check (a loaded machine: CI once read the log before it).
    wait_for(lambda: re.search(r"unix socket (\S+)", srv.log()), "the fast path's unix socket",
             timeout=30)
    return re.search(r"unix socket (\S+)", srv.log()).group(1)


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


class Raw:
    """A fast-path connection with no client logic: frames as the test builds them."""

    def __init__(self, address: str, token: str = "", hello: bool = True) -> None:
        if "/" in address:
            self.sock = socket.socket(socket.AF_UNIX)
            self.sock.connect(address)
        else:
            host, _, port = address.rpartition(":")
            self.sock = socket.create_connection((host, int(port)))
        self.sock.settimeout(10)
        if hello:
            status, body = self.call(fw.Op.HELLO, token.encode())
            assert status == 0, body

    def send(self, op: int, body: bytes = b"", data_len: int = 0, flags: int = 0) -> None:
        self.sock.sendall(fw.encode_header(op, len(body), data_len, flags=flags) + body)

    def recv_exact(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            got = self.sock.recv(n - len(out))
            if not got:
                raise ConnectionError(f"closed after {len(out)} of {n} bytes")
            out += got
        return bytes(out)

    def answer(self) -> tuple[int, bytes, int]:
        h = fw.decode_header(self.recv_exact(24), request=False)
        return h.status, self.recv_exact(h.body_len), h.data_len

    def call(self, op: int, body: bytes = b"", flags: int = 0) -> tuple[int, bytes]:
        self.send(op, body, flags=flags)
        status, body, _ = self.answer()
        return status, body

    def closed(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except OSError:
            return True

    def close(self) -> None:
        self.sock.close()


def keys_body(layout_id: bytes, ks: list[bytes]) -> bytes:
    return fw.LAYOUT_HEAD.pack(layout_id) + fw.encode_keys(len(ks[0]), b"".join(ks))


@pytest.fixture(scope="module")
def srv():
    port = free_port()
    with ServerProcess(dram="256MiB", metrics_port=port) as server:
        server.metrics_port = port
        yield server


# -- bytes ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_round_trip_is_byte_exact(srv, name, transport):
    address = fast_address(srv) if transport == "tcp" else unix_path(srv)
    n = 40 if name == "1MiB" else 300
    with KVStoreClient(srv.address, shared_memory=False, data_plane=True,
                       data_address=address) as c, \
            KVStoreClient(srv.address, shared_memory=False, data_plane=False) as grpc_only:
        ns = c.register_layout(LAYOUTS[name])
        ks = keys(f"{name}-{transport}", n)
        data = pages(n, ns.page_bytes, seed=n)
        assert c.put(ns, ks[:1], data[:1]).stored == 1              # one page
        result = c.put(ns, ks, data)
        assert (result.stored, result.skipped) == (n - 1, 1)
        assert c.lookup(ns, ks) == n
        assert c.exists(ns, [ks[0], b"missing".ljust(20), ks[-1]]) == [True, False, True]
        assert np.array_equal(c.get(ns, ks), data)
        assert np.array_equal(c.get(ns, ks[7:8]), data[7:8])
        assert np.array_equal(grpc_only.get(ns, ks), data)           # the same pages
        lb = ns.layer_bytes
        seen = []
        for layer, slab in c.get_layers(ns, ks):
            assert np.array_equal(slab, data[:, layer * lb:(layer + 1) * lb])
            seen.append(layer)
        assert seen == list(range(ns.layout.num_layers))
        assert c.delete(ns, ks) == n
        assert c.lookup(ns, ks) == 0


def test_a_large_get_is_striped_and_exact(srv):
    with KVStoreClient(srv.address, shared_memory=False, data_plane=True,
                       data_connections=4) as c:
        ns = c.register_layout(LAYOUTS["1MiB"])
        n = 96
        ks = keys("striped", n)
        data = pages(n, ns.page_bytes, seed=3)
        c.put(ns, ks, data)
        fast = c.fast_path()
        out = c.get(ns, ks)
        assert np.array_equal(out, data)
        assert len(fast._idle) >= 2, "a 96 MiB get should have used several connections"
        c.delete(ns, ks)


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_one_gib_round_trip_is_byte_exact(transport):
    """The largest size the acceptance names: 1,024 pages of 1 MiB in one put and one
    get, every byte compared (3.2 GiB of memory: the pool, the pages and the copy)."""
    with ServerProcess(dram="1100MiB") as big:
        address = fast_address(big) if transport == "tcp" else unix_path(big)
        with KVStoreClient(big.address, shared_memory=False, data_plane=True,
                           data_address=address, timeout=120) as c:
            ns = c.register_layout(LAYOUTS["1MiB"])
            n = 1024
            assert n * ns.page_bytes == 1 << 30
            ks = keys(f"gib-{transport}", n)
            data = pages(n, ns.page_bytes, seed=17)
            assert c.put(ns, ks, data).stored == n
            out = c.get(ns, ks)
            assert out.shape == data.shape and np.array_equal(out, data)
            del out
            assert np.array_equal(c.get(ns, ks[511:512]), data[511:512])


def test_missing_key_is_a_key_error_and_the_connection_goes_on(srv):
    with KVStoreClient(srv.address, shared_memory=False, data_plane=True) as c:
        ns = c.register_layout(LAYOUTS["odd"])
        ks = keys("missing", 3)
        c.put(ns, ks[:2], pages(2, ns.page_bytes))
        with pytest.raises(KeyError, match="not stored"):
            c.get(ns, ks)
        assert np.array_equal(c.get(ns, ks[:2]), pages(2, ns.page_bytes))


def test_a_restarted_server_is_reached_again_and_the_layout_registered_again(fresh_server):
    srv = fresh_server()
    with KVStoreClient(srv.address, shared_memory=False, data_plane=True) as c:
        ns = c.register_layout(LAYOUTS["odd"])
        ks = keys("restart", 3)
        data = pages(3, ns.page_bytes)
        c.put(ns, ks, data)
        srv.stop()
        fresh_server(port=srv.port)
        # The pooled connection is dead: a fresh one, then "unknown layout" -> again.
        assert c.lookup(ns, ks) == 0
        assert c.put(ns, ks, data).stored == 3
        assert np.array_equal(c.get(ns, ks), data)
        assert c.fast_path() is not None


# -- same-host control --------------------------------------------------------------------
def test_same_host_control_goes_over_the_unix_socket(srv):
    with KVStoreClient(srv.address, data_plane=True) as c:
        ns = c.register_layout(LAYOUTS["odd"])
        assert c.fast_path().address.endswith(".sock")
        ks = keys("shm", 5)
        data = pages(5, ns.page_bytes, seed=9)
        with c.reserve(ns, ks) as res:
            for view, page in zip(res.views, data, strict=True):
                view[:] = page
        with c.acquire(ns, ks) as acq:
            assert all(np.array_equal(v, p) for v, p in zip(acq.views, data, strict=True))
        lease = c.lookup_lease(ns, ks, 5000)
        assert lease.count == 5 and c.release_lease(lease)
        assert np.array_equal(c.get(ns, ks), data)


def test_a_client_that_maps_nothing_finds_the_unix_socket_when_asked(srv):
    """local_socket: the connector's scheduler half maps no pool but still reaches the
    fast path over the Unix socket beside it; without the flag it goes over TCP."""
    with KVStoreClient(srv.address, shared_memory=False, local_socket=True) as c:
        ns = c.register_layout(LAYOUTS["odd"])
        assert c.lookup(ns, keys("uds", 2)) == 0
        assert c.fast_path().address.endswith(".sock")
        assert c.region() is None                    # nothing mapped
    with KVStoreClient(srv.address, shared_memory=False) as c:
        ns = c.register_layout(LAYOUTS["odd"])
        assert c.lookup(ns, keys("uds", 2)) == 0
        assert not c.fast_path().address.endswith(".sock")


def test_acquire_and_release_on_a_raw_connection(srv):
    with KVStoreClient(srv.address, data_plane=False) as c:
        ns = c.register_layout(LAYOUTS["tiny"])
        ks = keys("acq", 4)
        c.put(ns, ks, pages(4, ns.page_bytes))
        token = c.region().token
        leases = c.stats().leases
    raw = Raw(unix_path(srv))
    body = fw.LEASED_HEAD.pack(ns.layout_id, token, 0) + fw.encode_keys(20, b"".join(ks))
    status, answer = raw.call(fw.Op.ACQUIRE, body)
    assert status == 0
    (lease_id,) = fw.LEASE.unpack_from(answer)
    assert len(fw.unpack_u64(answer[8:])) == 4
    bad = fw.LEASED_HEAD.pack(ns.layout_id, b"\0" * 16, 0) + fw.encode_keys(20, b"".join(ks))
    status, answer = raw.call(fw.Op.ACQUIRE, bad)
    assert status == fw.Status.EXPIRED and b"shared-memory token" in answer
    status, answer = raw.call(fw.Op.RELEASE, fw.LEASE.pack(lease_id))
    assert status == 0 and fw.LEASE.unpack(answer) == (1,)
    raw.close()
    with KVStoreClient(srv.address, data_plane=False) as c:
        assert c.stats().leases == leases


def test_quiet_releases_get_no_answer_and_keep_the_connection_in_step(srv):
    with KVStoreClient(srv.address, data_plane=False) as c:
        ns = c.register_layout(LAYOUTS["tiny"])
        ks = keys("quiet", 2)
        c.put(ns, ks, pages(2, ns.page_bytes))
        token = c.region().token
    before = _leases(srv)
    released = 'kvstore_rpc_total{code="OK",method="FastRelease"}'
    counted = metric(srv.metrics_port, released)
    old = Raw(unix_path(srv))                    # offered nothing: granted nothing
    raw = Raw(unix_path(srv), hello=False)
    raw.send(fw.Op.HELLO, flags=fw.QUIET)
    h = fw.decode_header(raw.recv_exact(24), request=False)
    raw.recv_exact(h.body_len)
    assert h.status == 0 and h.flags == fw.QUIET
    acquire = fw.LEASED_HEAD.pack(ns.layout_id, token, 0) + fw.encode_keys(20, b"".join(ks))
    for conn in (old, raw):
        status, answer = conn.call(fw.Op.ACQUIRE, acquire)
        assert status == 0
        (lease_id,) = fw.LEASE.unpack_from(answer)
        flags = fw.QUIET if conn is raw else 0   # what each client may send
        conn.send(fw.Op.RELEASE, fw.LEASE.pack(lease_id), flags=flags)
        conn.send(fw.Op.RELEASE, fw.LEASE.pack(lease_id + 10**6), flags=flags)  # unknown
        conn.send(fw.Op.EXISTS, keys_body(ns.layout_id, ks))
        if conn is old:      # a client that did not offer QUIET gets every answer
            assert [conn.answer()[1] for _ in range(2)] == [fw.LEASE.pack(1), fw.LEASE.pack(0)]
        status, answer, _ = conn.answer()     # quiet: the first answer is EXISTS'
        assert status == 0 and fw.COUNT.unpack_from(answer) == (2,)
    raw.close()
    old.close()
    wait_for(lambda: _leases(srv) == before, "the released leases to go")
    # Quiet ones counted too. A call is counted after its answer is sent: wait for it.
    wait_for(lambda: metric(srv.metrics_port, released) == counted + 4, "the releases' count")


# -- faults: no pin, reservation or thread outlives a connection ------------------------------
def _leases(srv) -> int:
    with KVStoreClient(srv.address, data_plane=False) as c:
        return c.stats().leases


def _connections(srv) -> float:
    """Open fast-path connections: one serving thread each (server.py)."""
    return metric(srv.metrics_port, "kvstore_fast_connections")


def _nothing_left(srv, leases: int, connections: float, what: str) -> None:
    """No pin or reservation (the admin stats' leases) and no connection thread (the
    fast-connections gauge) is left of a connection that ended mid-transfer."""
    wait_for(lambda: _leases(srv) == leases, f"the leases of {what} to go")
    wait_for(lambda: _connections(srv) <= connections, f"the thread of {what} to end")


@pytest.mark.parametrize("n", [1, 12])           # one sendmsg; past HEAD_ALONE_BYTES
def test_aligned_get_answers_only_to_a_client_that_offers_them(srv, n):
    """A client that offers ALIGNED gets its Get answers with ALIGN_PAD zero bytes of body
    before the pages (so the kernel copies them at full speed); one that does not gets
    the answer it always had. The pages are the same, byte for byte."""
    with KVStoreClient(srv.address, shared_memory=False, data_plane=True) as c:
        ns = c.register_layout(LAYOUTS["mla"])
        ks = keys(f"aligned{n}", n)
        data = pages(n, ns.page_bytes, seed=n)
        c.put(ns, ks, data)
        assert c.fast_path()._idle[-1].pad == fw.ALIGN_PAD    # our client offers it
        assert np.array_equal(c.get(ns, ks), data)
    for offer, pad in ((0, b""), (fw.ALIGNED, bytes(fw.ALIGN_PAD))):
        raw = Raw(fast_address(srv), hello=False)
        raw.send(fw.Op.HELLO, flags=offer | fw.QUIET)
        h = fw.decode_header(raw.recv_exact(24), request=False)
        raw.recv_exact(h.body_len)
        assert h.status == 0 and h.flags == offer | fw.QUIET
        raw.send(fw.Op.GET, keys_body(ns.layout_id, ks))
        status, body, data_len = raw.answer()
        assert (status, body, data_len) == (0, pad, n * ns.page_bytes)
        assert raw.recv_exact(data_len) == data.tobytes()
        # A layer-major Get is padded alike (Conn.answer_head reads the pad); an error
        # answer is a message, never padded.
        raw.send(fw.Op.GET, keys_body(ns.layout_id, ks), flags=fw.LAYER_MAJOR)
        status, body, data_len = raw.answer()
        assert (status, body) == (0, pad)
        raw.recv_exact(data_len)
        status, body = raw.call(fw.Op.GET, keys_body(ns.layout_id, [b"missing".ljust(20)]))
        assert status == fw.Status.NOT_FOUND and body and body != pad
        raw.close()


def test_connection_cut_mid_put_leaves_nothing(srv):
    with KVStoreClient(srv.address, shared_memory=False, data_plane=False) as c:
        ns = c.register_layout(LAYOUTS["1MiB"])
    before, threads = _leases(srv), _connections(srv)
    ks = keys("cut-put", 8)
    raw = Raw(fast_address(srv))
    raw.send(fw.Op.PUT, keys_body(ns.layout_id, ks), data_len=8 * ns.page_bytes)
    raw.sock.sendall(bytes(3 * ns.page_bytes + 1000))      # then the connection is cut
    wait_for(lambda: _leases(srv) == before + 1, "the put's reservation")
    assert _connections(srv) == threads + 1
    raw.close()
    _nothing_left(srv, before, threads, "the cut put")
    with KVStoreClient(srv.address, shared_memory=False, data_plane=True) as c:
        assert c.lookup(ns, ks) == 0
        assert c.put(ns, ks, pages(8, ns.page_bytes)).stored == 8   # the keys are free
        c.delete(ns, ks)


def test_connection_cut_mid_get_and_held_leases_are_released(srv):
    with KVStoreClient(srv.address, data_plane=False) as c:
        ns = c.register_layout(LAYOUTS["1MiB"])
        ks = keys("cut-get", 64)
        c.put(ns, ks, pages(64, ns.page_bytes))
        token = c.region().token
    before, threads = _leases(srv), _connections(srv)
    raw = Raw(fast_address(srv))
    body = fw.LEASED_HEAD.pack(ns.layout_id, token, 60000) + fw.encode_keys(20, b"".join(ks))
    assert raw.call(fw.Op.ACQUIRE, body)[0] == 0               # held for a minute...
    raw.send(fw.Op.GET, keys_body(ns.layout_id, ks))
    raw.recv_exact(24 + 1000)                                  # ...and a get half read
    assert _leases(srv) >= before + 1
    raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
    raw.close()                                                # RST: the client died
    _nothing_left(srv, before, threads, "the cut connection")
    # Room for the next tests' pages of 1 MiB: the module's server has 256 MiB, and a
    # killed client's Get below stores 200 more (with these 64 still stored, that Put
    # evicted 32 pages and left the pool at 232 MiB).
    with KVStoreClient(srv.address, data_plane=False) as c:
        assert c.delete(ns, ks) == 64


@pytest.mark.parametrize("call", ["put", "get"])
def test_a_killed_client_process_leaves_nothing(srv, tmp_path, call):
    import subprocess
    import sys
    n = 200
    with KVStoreClient(srv.address, shared_memory=False, data_plane=False) as c:
        ns = c.register_layout(LAYOUTS["1MiB"])
        ks = [str(i).encode().ljust(20, b"g") for i in range(n)]
        if call == "get":
            c.put(ns, ks, pages(n, ns.page_bytes, seed=2))
    before, threads = _leases(srv), _connections(srv)
    script = tmp_path / "client.py"
    # The get's reader is slow on purpose: its pages sit pinned while the server sends.
    script.write_text(f"""
import socket, time
import numpy as np
from kvstore_client.fastpath import FastPath
f = FastPath("{fast_address(srv)}")
key = b"g" if "{call}" == "get" else b"k"
ks = b"".join(str(i).encode().ljust(20, key) for i in range({n}))
data = memoryview(np.ones({n} * {ns.page_bytes}, dtype=np.uint8))
print("go", flush=True)
if "{call}" == "put":
    f.put({ns.layout_id!r}, 20, ks, data)
else:
    f.get_into({ns.layout_id!r}, 20, ks, data, {ns.page_bytes})
""")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"go"
        wait_for(lambda: _leases(srv) > before, f"the {call} to be under way", timeout=20)
        proc.kill()
        proc.wait(10)
        _nothing_left(srv, before, threads, f"the killed client's {call}")
    finally:
        proc.kill()
        if call == "get":       # 200 MiB of the module server's 256, failed or not
            with KVStoreClient(srv.address, shared_memory=False, data_plane=False) as c:
                deleted = c.delete(ns, ks)
    if call == "get":
        assert deleted == n


# -- one thread's failure never ends another thread's leases ----------------------------------
def _held_by_a_and_b_fails(srv, failure, what: str) -> None:
    """Thread A holds an acquire or a reservation over the fast path; B's call on the
    same client fails; A's lease must still be the server's, and its bytes A's. The
    server ends a connection's leases when it closes, and one lane carries the leases of
    all a client's threads: closing it on B's failure let A's slots be reused under it."""
    with KVStoreClient(srv.address, shared_memory=True, timeout=30) as c, \
            KVStoreClient(srv.address, data_plane=False) as other:
        ns = c.register_layout(LAYOUTS["tiny"])
        mine = keys(f"held-{what}", 8)
        data = pages(8, ns.page_bytes, seed=7)
        if what == "acquire":
            c.put(ns, mine, data)
            held = c.acquire(ns, mine)
        else:
            held = c.reserve(ns, mine)
        before = other.stats().leases
        failure(c, ns)
        # At least A's: a Reserve that timed out on B's side may have been answered
        # after, on the connection set aside; that lease ends when the connection closes.
        assert other.stats().leases >= before, "B's failure ended A's lease"
        o = other.register_layout(LAYOUTS["tiny"])
        other.evict(everything=True)                       # unleased pages only
        other.put(o, keys(f"filler-{what}", 512), pages(512, o.page_bytes, seed=8))
        if what == "acquire":
            assert np.array_equal(np.stack([v.copy() for v in held.views]), data)
            held.release()
        else:
            for view, page in zip(held.views, data):
                view[:] = page
            assert held.commit() == 8
            assert np.array_equal(other.get(o, mine), data)
        wait_for(lambda: other.stats().leases == 0, "every lease to end")


@pytest.mark.parametrize("what", ["acquire", "reserve"])
def test_a_lane_call_that_times_out_keeps_the_other_threads_leases(fresh_server, what):
    srv = fresh_server(dram="64MiB")

    def b_times_out(c, ns):
        c.timeout = 0.5
        sigstop(srv.proc.pid)                   # a stall longer than B's timeout
        try:
            with pytest.raises(KVStoreError) as err:
                if what == "acquire":
                    c.acquire(ns, keys("b", 1))
                else:
                    c.reserve(ns, keys("b", 1))
            assert err.value.code.name == "DEADLINE_EXCEEDED"
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
            c.timeout = 30
        c.exists(ns, keys("b", 1))               # the lane goes on, on a new connection

    _held_by_a_and_b_fails(srv, b_times_out, what)


@pytest.mark.parametrize("what", ["acquire", "reserve"])
def test_a_dropped_fast_path_keeps_the_other_threads_leases(fresh_server, what):
    """B's pooled call finds the server's fast-path connections all taken (BUSY): the
    client drops its fast path and B goes on over gRPC, with no error anywhere."""
    srv = fresh_server(dram="64MiB", data_connections=3)

    def b_meets_busy(c, ns):
        hogs = [socket.create_connection(("127.0.0.1", srv.port + 1)) for _ in range(3)]
        try:
            time.sleep(0.2)
            assert c.exists(ns, keys("b", 1)) == [False]      # over gRPC
        finally:
            for hog in hogs:
                hog.close()

    _held_by_a_and_b_fails(srv, b_meets_busy, what)


# -- bounds and malformed frames ----------------------------------------------------------------
@pytest.mark.parametrize("frame, words", [
    (b"\x16\x03\x01\x02\x00" + bytes(200), b"not a kvstore fast-path frame"),
    (fw.HEADER.pack(fw.MAGIC, fw.VERSION, fw.Op.LOOKUP, 0, 0, 1 << 60, 0), b"over the limit"),
    (fw.HEADER.pack(fw.MAGIC, fw.VERSION, fw.Op.GET, 0, 0, 0, 1 << 20), b"only PUT carries data"),
    (fw.HEADER.pack(fw.MAGIC, fw.VERSION, 77, 0, 0, 0, 0), b"unknown op"),
    (fw.encode_header(fw.Op.HELLO, 0), b"HELLO comes once"),
])
def test_malformed_frames_get_an_error_and_close(srv, frame, words):
    raw = Raw(fast_address(srv))
    raw.sock.sendall(frame)
    status, body, _ = raw.answer()
    assert status == fw.Status.PROTOCOL and words in body, body
    assert raw.closed()
    raw.close()


def test_bad_requests_get_an_error_and_the_connection_goes_on(srv):
    with KVStoreClient(srv.address, shared_memory=False, data_plane=False) as c:
        ns = c.register_layout(LAYOUTS["tiny"])
    raw = Raw(fast_address(srv))
    too_many = fw.LAYOUT_HEAD.pack(ns.layout_id) + fw.encode_keys(16, bytes(16 * 16_385))
    for body, words in ((too_many, b"16385 keys; at most 16384"), (b"short", b"too short"),
                        (fw.LAYOUT_HEAD.pack(ns.layout_id) + struct_keys(0, 3),
                         b"key_size must be")):
        status, answer = raw.call(fw.Op.EXISTS, body)
        assert status == fw.Status.INVALID and words in answer, answer
    # A PUT whose data does not match its keys is drained and refused.
    ks = keys("mismatch", 2)
    raw.send(fw.Op.PUT, keys_body(ns.layout_id, ks), data_len=3 * ns.page_bytes)
    raw.sock.sendall(bytes(3 * ns.page_bytes))
    status, answer, _ = raw.answer()
    assert status == fw.Status.INVALID and b"needs 32 bytes" in answer, answer
    status, answer = raw.call(fw.Op.EXISTS, keys_body(ns.layout_id, ks))
    assert status == 0 and fw.COUNT.unpack_from(answer) == (2,)
    raw.close()


def test_the_same_request_limits_as_grpc(fresh_server):
    """--max-keys-per-request bounds the fast path as it bounds gRPC: the same requests
    are refused, with the same status and message (kvstore_server/rpc/limits.py)."""
    import grpc

    from kvstore_protocol._proto.kvstore.v1 import kvstore_pb2 as pb, kvstore_pb2_grpc
    srv = fresh_server(max_keys_per_request=1000, dram="64MiB")
    with KVStoreClient(srv.address, data_plane=False) as c:
        ns = c.register_layout(LAYOUTS["1MiB"])
        c.put(ns, keys("limit", 1), pages(1, ns.page_bytes))
        token = c.region().token
        stub = kvstore_pb2_grpc.KVStoreStub(c._channel)
        lid = ns.layout_id
        over = b"".join(keys("over", 1001))
        packed = pb.PackedKeys(data=over, key_size=20)

        def grpc_refusal(call, request) -> tuple[grpc.StatusCode, str]:
            with pytest.raises(grpc.RpcError) as err:
                answer = call(request, timeout=30)
                for _ in (answer if hasattr(answer, "__next__") else ()):   # Get streams
                    pass
            return err.value.code(), err.value.details()

        raw = Raw(unix_path(srv))
        cases = [
            (fw.Op.EXISTS, fw.LAYOUT_HEAD.pack(lid) + fw.encode_keys(20, over),
             stub.Exists, pb.ExistsRequest(layout_id=lid, keys=packed)),
            (fw.Op.DELETE, fw.LAYOUT_HEAD.pack(lid) + fw.encode_keys(20, over),
             stub.Delete, pb.DeleteRequest(layout_id=lid, keys=packed)),
            (fw.Op.GET, fw.LAYOUT_HEAD.pack(lid) + fw.encode_keys(20, over),
             stub.Get, pb.GetRequest(layout_id=lid, keys=packed)),
            (fw.Op.LOOKUP, fw.LOOKUP_HEAD.pack(0, 1) + lid + fw.encode_keys(20, over),
             stub.Lookup, pb.LookupRequest(layout_ids=[lid], keys=packed)),
            (fw.Op.ACQUIRE, fw.LEASED_HEAD.pack(lid, token, 0) + fw.encode_keys(20, over),
             stub.Acquire, pb.AcquireRequest(layout_id=lid, keys=packed, token=token)),
            (fw.Op.RESERVE, fw.LEASED_HEAD.pack(lid, token, 0) + fw.encode_keys(20, over),
             stub.Reserve, pb.ReserveRequest(layout_id=lid, keys=packed, token=token)),
            # 1000 keys in 5 layouts: past 4 x the limit.
            (fw.Op.LOOKUP, fw.LOOKUP_HEAD.pack(0, 5) + lid * 5
             + fw.encode_keys(20, over[:20_000]), stub.Lookup,
             pb.LookupRequest(layout_ids=[lid] * 5,
                              keys=pb.PackedKeys(data=over[:20_000], key_size=20))),
            # One stored 1 MiB page named 65 times: more than the 64 MiB pool.
            (fw.Op.GET, fw.LAYOUT_HEAD.pack(lid) + fw.encode_keys(20, keys("limit", 1)[0] * 65),
             stub.Get, pb.GetRequest(layout_id=lid, keys=pb.PackedKeys(
                 data=keys("limit", 1)[0] * 65, key_size=20))),
        ]
        for op, body, call, request in cases:
            status, message = raw.call(op, body)
            code, details = grpc_refusal(call, request)
            assert status != 0, (op, message)
            assert fw.GRPC_CODES[fw.Status(status)] == code, (op, message, details)
            assert message.decode() == details, (op, message, details)
        # A PUT past the limit: its data is drained, the connection goes on.
        raw.send(fw.Op.PUT, fw.LAYOUT_HEAD.pack(lid) + fw.encode_keys(20, over),
                 data_len=1001 * ns.page_bytes)
        raw.sock.sendall(bytes(1001 * ns.page_bytes))
        status, message, _ = raw.answer()
        assert status == fw.Status.INVALID and b"1001 keys; at most 1000" in message
        # The limit itself is fine. A body past what 1000 keys can fill is read past and
        # refused, and the connection goes on with its leases: closing it ended the
        # leases of every thread whose lane it was. Past what any server's limit allows,
        # it is a malformed frame (test_malformed_frames_get_an_error_and_close).
        status, _ = raw.call(fw.Op.EXISTS, fw.LAYOUT_HEAD.pack(lid)
                             + fw.encode_keys(20, over[:20_000]))
        assert status == 0
        status, message = raw.call(fw.Op.ACQUIRE, fw.LEASED_HEAD.pack(lid, token, 60_000)
                                   + fw.encode_keys(20, keys("limit", 1)[0]))
        assert status == 0
        held = fw.LEASE.unpack_from(message)[0]
        status, message = raw.call(fw.Op.EXISTS, bytes(fw.request_body_bytes(1000) + 1))
        assert status == fw.Status.INVALID and b"over the limit" in message
        assert b"at most 1000 keys per request" in message
        status, message = raw.call(fw.Op.RELEASE, fw.LEASE.pack(held))
        assert status == 0 and fw.LEASE.unpack_from(message)[0] == 1   # it was still held
        raw.close()


def struct_keys(key_size: int, n: int) -> bytes:
    import struct
    return struct.pack("<BI", key_size, n)


def test_garbage_truncation_and_slow_senders_leave_the_server_serving(srv):
    with KVStoreClient(srv.address, shared_memory=False, data_plane=True) as good:
        ns = good.register_layout(LAYOUTS["odd"])
        ks = keys("survivor", 10)
        data = pages(10, ns.page_bytes, seed=5)
        good.put(ns, ks, data)
        rng = np.random.default_rng(7)
        bad = []
        for i in range(30):
            raw = Raw(fast_address(srv), hello=i % 3 == 0)
            junk = rng.integers(0, 256, int(rng.integers(1, 300)), dtype=np.uint8).tobytes()
            if i % 2:
                junk = fw.encode_header(int(rng.integers(1, 12)), 1000)[:int(rng.integers(1, 30))] + junk[:50]
            raw.sock.sendall(junk)
            bad.append(raw)                       # left open: truncated, a slow sender
            assert np.array_equal(good.get(ns, ks), data)
        for raw in bad:
            raw.close()
        assert np.array_equal(good.get(ns, ks), data)
        assert good.lookup(ns, ks) == 10


def test_64_concurrent_clients_every_byte_checked(srv):
    with KVStoreClient(srv.address, shared_memory=False, data_plane=False) as c:
        ns = c.register_layout(LAYOUTS["odd"])
    errors = []

    def one(i: int) -> None:
        try:
            f = FastPath(fast_address(srv))
            ks = keys(f"conc-{i}", 20)
            packed = b"".join(ks)
            data = pages(20, ns.page_bytes, seed=i)
            for _ in range(3):
                f.put(ns.layout_id, 20, packed, memoryview(data.reshape(-1)))
                out = np.zeros_like(data)
                f.get_into(ns.layout_id, 20, packed, memoryview(out.reshape(-1)),
                           ns.page_bytes)
                assert np.array_equal(out, data), f"client {i} read other bytes"
                assert f.lookup([ns.layout_id], 20, packed) == (20, 0, None)
            f.close()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
    wait_for(lambda: metric(srv.metrics_port, "kvstore_fast_connections") <= 2,
             "the 64 connections' threads to end")


def test_metrics_count_calls_and_connections(srv):
    with KVStoreClient(srv.address, shared_memory=False, data_plane=True) as c:
        ns = c.register_layout(LAYOUTS["tiny"])
        c.lookup(ns, keys("m", 2))
        text = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics",
                                      timeout=5).read().decode()
    assert 'kvstore_rpc_total{code="OK",method="FastLookup"}' in text
    assert metric(srv.metrics_port, "kvstore_fast_accepted_total") >= 1


# -- auth -----------------------------------------------------------------------------------
TOKENS = {"a": "fast-tok-a", "b": "fast-tok-b", "ops": "fast-tok-ops"}


def _auth_file(path, names) -> None:
    out = []
    for name in names:
        table = "admins" if name == "ops" else "tenants"
        out.append(f'[{table}.{name}]\ntoken_sha256 = '
                   f'"{hashlib.sha256(TOKENS[name].encode()).hexdigest()}"\n')
    path.write_text("\n".join(out))


def test_auth_refuses_and_counts_and_isolates_tenants(fresh_server, tmp_path):
    path = tmp_path / "auth.toml"
    _auth_file(path, ["a", "b", "ops"])
    port = free_port()
    srv = fresh_server(auth_file=str(path), metrics_port=port)
    for token, status in (("", fw.Status.UNAUTHENTICATED), ("nope", fw.Status.UNAUTHENTICATED),
                          (TOKENS["ops"], fw.Status.DENIED)):
        raw = Raw(fast_address(srv), hello=False)
        raw.send(fw.Op.HELLO, token.encode())
        got, body, _ = raw.answer()
        assert got == status, body
        assert raw.closed()
        raw.close()
    for frame in (fw.encode_header(fw.Op.LOOKUP, 0),):      # no HELLO first
        raw = Raw(fast_address(srv), hello=False)
        raw.sock.sendall(frame)
        assert raw.answer()[0] == fw.Status.PROTOCOL
        raw.close()
    wait_for(lambda: metric(port, 'kvstore_fast_refused_total{reason="unauthenticated"}') == 2
             and metric(port, 'kvstore_fast_refused_total{reason="denied"}') == 1,
             "the refusals to be counted")
    with pytest.raises(KVStoreError, match="invalid token"):
        KVStoreClient(srv.address, token="nope", shared_memory=False, data_plane=True,
                      retries=0).lookup(_handle(srv), [b"k" * 16])

    with KVStoreClient(srv.address, token=TOKENS["a"], shared_memory=False,
                       data_plane=True) as a, \
            KVStoreClient(srv.address, token=TOKENS["b"], shared_memory=False,
                          data_plane=True) as b:
        ns = a.register_layout(LAYOUTS["odd"])
        ks = keys("tenant-a", 4)
        data = pages(4, ns.page_bytes)
        a.put(ns, ks, data)
        assert a.fast_path().tenant == "a"
        # b names a's layout id: unknown to b, whoever else has it.
        raw = Raw(fast_address(srv), TOKENS["b"])
        refused_gets = metric(port, 'kvstore_rpc_total{code="INVALID_ARGUMENT",'
                                    'method="FastGet"}')
        status, body = raw.call(fw.Op.GET, keys_body(ns.layout_id, ks))
        assert status == fw.Status.INVALID and b"unknown layout" in body
        wait_for(lambda: metric(port, 'kvstore_rpc_total{code="INVALID_ARGUMENT",'
                                      'method="FastGet"}') == refused_gets + 1,
                 "the refused get to be counted")
        status, body = raw.call(fw.Op.EXISTS, keys_body(ns.layout_id, ks))
        assert status == fw.Status.INVALID
        # A tenant without shared_memory may not acquire.
        status, body = raw.call(fw.Op.ACQUIRE, fw.LEASED_HEAD.pack(ns.layout_id, bytes(16), 0)
                                + fw.encode_keys(20, b"".join(ks)))
        assert status == fw.Status.DENIED, body
        nb = b.register_layout(LAYOUTS["odd"])
        assert b.lookup(nb, ks) == 0
        assert np.array_equal(a.get(ns, ks), data)
        # Revoked: the open connection's next request and new connections are refused.
        _auth_file(path, ["b", "ops"])
        srv.send_signal(signal.SIGHUP)
        wait_for(lambda: "auth reloaded" in srv.log(), "the reload")
        status, body = raw.call(fw.Op.EXISTS, keys_body(ns.layout_id, ks))
        assert status == 0 and body[4:] == b"\0"   # b's own layout now: none of a's pages
        raw.close()
        with pytest.raises(KVStoreError, match="invalid token"):
            a.lookup(ns, ks)
        # ...counted as the call's outcome on the open connection, as a refusal on a new one.
        # The server counts a call after its answer is sent: wait for the count.
        wait_for(lambda: metric(
            port, 'kvstore_rpc_total{code="UNAUTHENTICATED",method="FastLookup"}') >= 1,
            "the refused lookup to be counted")
        refused = metric(port, 'kvstore_fast_refused_total{reason="unauthenticated"}')
        raw = Raw(fast_address(srv), hello=False)
        raw.send(fw.Op.HELLO, TOKENS["a"].encode())
        assert raw.answer()[0] == fw.Status.UNAUTHENTICATED
        raw.close()
        wait_for(lambda: metric(port, 'kvstore_fast_refused_total{reason="unauthenticated"}')
                 == refused + 1, "the refused HELLO to be counted")


def _handle(srv):
    from kvstore_client.client import LayoutHandle
    layout = LAYOUTS["tiny"]
    return LayoutHandle(layout, layout.layout_id, layout.page_bytes, layout.layer_bytes)


# -- fallback and limits --------------------------------------------------------------------
def test_falls_back_to_grpc_when_the_fast_path_is_off(fresh_server, caplog):
    srv = fresh_server(data_listen="off", data_socket="false")
    with caplog.at_level(logging.WARNING, logger="kvstore_client.dataplane"):
        with KVStoreClient(srv.address, shared_memory=False) as c:
            ns = c.register_layout(LAYOUTS["odd"])
            ks = keys("fallback", 6)
            data = pages(6, ns.page_bytes)
            c.put(ns, ks, data)
            assert np.array_equal(c.get(ns, ks), data)
            assert c.lookup(ns, ks) == 6
    warnings = [r for r in caplog.records if "fast path not reachable" in r.getMessage()]
    assert len(warnings) == 1
    with pytest.raises(KVStoreError, match="fast path was required"):
        with KVStoreClient(srv.address, shared_memory=False, data_plane=True) as c:
            c.lookup(c.register_layout(LAYOUTS["odd"]), ks)
    with pytest.raises(FastPathUnavailable):
        FastPath(fast_address(srv)).check()


def test_falls_back_to_grpc_when_the_data_port_is_closed(srv, caplog):
    closed = f"127.0.0.1:{free_port()}"                 # nothing listens there
    with caplog.at_level(logging.WARNING, logger="kvstore_client.dataplane"):
        with KVStoreClient(srv.address, shared_memory=False, data_address=closed) as c:
            ns = c.register_layout(LAYOUTS["odd"])
            ks = keys("closed-port", 4)
            data = pages(4, ns.page_bytes, seed=4)
            assert c.put(ns, ks, data).stored == 4
            assert np.array_equal(c.get(ns, ks), data)
            assert c.lookup(ns, ks) == 4
            assert c.fast_path() is None
            c.delete(ns, ks)
    warnings = [r for r in caplog.records if "fast path not reachable" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]


def test_a_server_at_its_connection_limit_says_busy(fresh_server):
    srv = fresh_server(data_connections=2)
    held = [Raw(fast_address(srv)), Raw(fast_address(srv))]
    raw = Raw(fast_address(srv), hello=False)
    status, body = raw.call(fw.Op.HELLO)          # the place is taken after HELLO
    assert status == fw.Status.BUSY and b"--data-connections" in body
    raw.close()
    with KVStoreClient(srv.address, shared_memory=False) as c:       # gRPC instead
        ns = c.register_layout(LAYOUTS["tiny"])
        c.put(ns, keys("busy", 2), pages(2, ns.page_bytes))
        assert c.fast_path() is None
    for h in held:
        h.close()


def test_the_unix_socket_is_as_private_as_the_pool(srv):
    path = unix_path(srv)
    with KVStoreClient(srv.address) as c:
        pool = c.region().path
    assert os.stat(path).st_mode & 0o777 == os.stat(pool).st_mode & 0o777 & 0o660
    # ... in a folder of the server's own that nobody else may write (unixsock.py)
    folder = os.lstat(os.path.dirname(path))
    assert folder.st_uid == os.geteuid() and folder.st_mode & 0o777 == 0o750


def test_a_stale_socket_after_sigkill_does_not_stop_a_restart(tmp_path):
    """SIGKILL leaves the pool and its socket's folder behind; the next start removes
    both and serves the fast path on its own socket."""
    with ServerProcess(shm_dir=tmp_path) as first:
        first_sock = unix_path(first)
        assert os.path.exists(first_sock)
        first.proc.kill()                                     # SIGKILL: no clean-up
        first.proc.wait(10)
        assert os.path.exists(first_sock)
        with ServerProcess(shm_dir=tmp_path) as second:
            assert not os.path.exists(os.path.dirname(first_sock))
            sock = unix_path(second)
            with KVStoreClient(second.address) as probe:
                pool = probe.region().path
            assert sorted(os.listdir(tmp_path)) == sorted(
                [os.path.basename(os.path.dirname(sock)), os.path.basename(pool)])
            with KVStoreClient(second.address, data_plane=True) as c:
                assert c.fast_path().address == unix_path(second)
                ns = c.register_layout(LAYOUTS["tiny"])
                with c.reserve(ns, keys("stale", 2)) as res:
                    for view in res.views:
                        view[:] = 7
                assert c.lookup(ns, keys("stale", 2)) == 2


# -- TLS ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    import shutil
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make certificates")
    from tests.integration import test_tls
    return test_tls.pki.__wrapped__(tmp_path_factory)


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mtls"])
def test_tls_and_mutual_tls_on_the_tcp_port(pki, mutual):
    import ssl

    from tests.integration.test_tls import creds
    ca = str(pki / "ca.pem")
    mine = {"tls_cert": str(pki / "client.pem"), "tls_key": str(pki / "client.key")}
    flags = {"tls_client_ca": pki / "ca.pem"} if mutual else {}
    with ServerProcess(credentials=creds(pki, client_cert=mutual), tls_cert=pki / "server.pem",
                       tls_key=pki / "server.key", **flags) as srv:
        assert "(TLS)" in srv.log()
        with KVStoreClient(srv.address, tls_ca=ca, shared_memory=False, data_plane=True,
                           **(mine if mutual else {})) as c:
            assert not c.fast_path().address.endswith(".sock")
            ns = c.register_layout(LAYOUTS["odd"])
            ks = keys("tls", 50)
            data = pages(50, ns.page_bytes, seed=11)
            c.put(ns, ks, data)
            assert np.array_equal(c.get(ns, ks), data)
            for layer, slab in c.get_layers(ns, ks[:3]):
                lb = ns.layer_bytes
                assert np.array_equal(slab, data[:3, layer * lb:(layer + 1) * lb])
            assert c.lookup(ns, ks) == 50
        # Plain text on the TLS port: refused.
        raw = Raw(fast_address(srv), hello=False)
        raw.send(fw.Op.HELLO)
        assert raw.closed()
        raw.close()
        # A client that does not trust the server's certificate: refused.
        with pytest.raises(FastPathUnavailable):
            FastPath(fast_address(srv), tls=ssl.create_default_context()).check()
        server_only = FastPath(fast_address(srv), tls=ssl.create_default_context(cafile=ca))
        if mutual:          # TLS without a client certificate: refused
            with pytest.raises(FastPathUnavailable):
                server_only.check()
        else:
            server_only.check()
            server_only.close()
        # The Unix socket stays plain: it is local and owner-only.
        raw = Raw(unix_path(srv))
        raw.close()


def test_a_stalled_server_is_a_deadline_not_a_hang(fresh_server):
    srv = fresh_server()
    with KVStoreClient(srv.address, shared_memory=False, data_plane=True, retries=0) as c:
        ns = c.register_layout(LAYOUTS["tiny"])
        ks = keys("stall", 2)
        c.put(ns, ks, pages(2, ns.page_bytes))
        c.timeout = 0.3                      # obeyed at once, as gRPC calls obey it
        sigstop(srv.proc.pid)
        try:
            start = time.monotonic()
            with pytest.raises(KVStoreError) as info:
                c.lookup(ns, ks)
            assert info.value.code.name == "DEADLINE_EXCEEDED"
            assert time.monotonic() - start < 2.0
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        c.timeout = 10.0
        assert c.lookup(ns, ks) == 2          # a fresh connection
        assert np.array_equal(c.get(ns, ks), pages(2, ns.page_bytes))


def test_an_acquire_does_not_wait_behind_a_reserve_in_flight(srv, monkeypatch):
    """Acquires and Reserves go over two connections (the lease lanes): an engine's
    Acquire is answered while its step's Reserve is still out."""
    with KVStoreClient(srv.address, data_plane=True) as c:
        ns = c.register_layout(LAYOUTS["odd"])
        stored, fresh = keys("lane-stored", 3), keys("lane-fresh", 3)
        data = pages(3, ns.page_bytes, seed=21)
        c.put(ns, stored, data)
        in_flight, go_on = threading.Event(), threading.Event()
        simple = FastPath._simple

        def held(conn, op, body, method):
            if op == fw.Op.RESERVE:         # the Reserve is sent; its answer waits here
                conn.send(op, body)
                in_flight.set()
                go_on.wait(10)
                conn.settle()
                return conn.answer(op, method)[1]
            return simple(conn, op, body, method)
        monkeypatch.setattr(FastPath, "_simple", staticmethod(held))
        reserved = []
        reserver = threading.Thread(target=lambda: reserved.append(c.reserve(ns, fresh)))
        reserver.start()
        try:
            assert in_flight.wait(10)
            start = time.monotonic()
            with c.acquire(ns, stored) as acq:
                took = time.monotonic() - start
                assert all(np.array_equal(v, p) for v, p in zip(acq.views, data, strict=True))
            assert reserver.is_alive()          # the Reserve is still out
            assert took < 5.0
        finally:
            go_on.set()
            reserver.join(10)
        (res,) = reserved
        new = pages(3, ns.page_bytes, seed=22)
        for view, page in zip(res.views, new, strict=True):
            view[:] = page
        res.commit()
        assert np.array_equal(c.get(ns, fresh), new)
        assert np.array_equal(c.get(ns, stored), data)


def test_a_new_connection_to_a_stalled_server_is_a_deadline_not_a_fallback(fresh_server):
    """A connection opened for a call on a fast path already in use, to a server that
    accepts it but does not answer its HELLO, costs the call its timeout once; it is not
    taken for an unreachable fast path and tried again over gRPC (a second timeout).
    Finding the path, the same silence means "unavailable"."""
    srv = fresh_server()
    fast = FastPath(fast_address(srv), timeout=0.3)
    fast.check()
    held = fast.take()                       # no idle connection left: the next call opens one
    sigstop(srv.proc.pid)
    try:
        start = time.monotonic()
        with pytest.raises(KVStoreError) as info:
            fast.exists(b"\0" * 16, 4, b"abcd")
        assert info.value.code.name == "DEADLINE_EXCEEDED"
        assert time.monotonic() - start < 2.0
        with pytest.raises(FastPathUnavailable):
            FastPath(fast_address(srv), timeout=0.3).check()
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)
    held.close()
    fast.close()
