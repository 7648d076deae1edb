"""Fuzzing the fast path: hostile frames on its TCP port and its Unix socket.

One real kvstore-server serves the module. Hypothesis makes (a) frames with a valid
header and hostile bodies for every op, (b) headers with hostile fields (op, version,
lengths up to 2^64-1, flags, status), (c) random bytes, each sent whole, cut short, or
followed by silence. Every answer must be a frame with a documented status (an error
never kills the connection unless it is PROTOCOL, and then the server must close it);
after every example the sentinel pages come back byte-exact through a well-behaved
client, and at the end the server's log holds no error and no connection is left open.

Then crowds of peers that are slow, silent or hostile before and after HELLO, on TCP, TLS
and the Unix socket, against the bounds docs/fastpath.md states ("Before and after
HELLO"): RSS, the HELLO deadline, a stalled Get's pins, and a tenant served throughout.
"""

from __future__ import annotations

import os
import re
import socket
import struct
import urllib.request

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from kvstore_client import KVStoreClient, PageLayout
from kvstore_protocol import fastwire as fw
from kvstore_testing.serverproc import ServerProcess, free_port
from tests.waiting import wait_for

SCALE = float(os.environ.get("KVSTORE_FUZZ_SCALE", "1"))
FUZZ = settings(deadline=None, derandomize=True, database=None, print_blob=False,
                suppress_health_check=list(HealthCheck))
LAYOUT = PageLayout(model="fuzz-fast", num_layers=2, page_tokens=4, num_kv_heads=2,
                    head_size=16, dtype="float32")                        # 2 KiB pages
KEYS = [b"fuzz-fast-%06d" % i for i in range(8)]
PAGES = np.random.default_rng(17).integers(0, 256, (8, LAYOUT.page_bytes), dtype=np.uint8)


def examples(n: int) -> settings:
    return settings(FUZZ, max_examples=max(1, int(n * SCALE)))


@pytest.fixture(scope="module")
def srv():
    port = free_port()
    with ServerProcess(dram="64MiB", metrics_port=port, lease_ttl="2s") as server:
        server.metrics_port = port
        with KVStoreClient(server.address, shared_memory=False, data_plane=True) as c:
            server.ns = c.register_layout(LAYOUT)
            c.put(server.ns, KEYS, PAGES)
            server.region_token = b""
        with KVStoreClient(server.address, data_plane=False) as c:
            server.region_token = c.region().token
        server.good = KVStoreClient(server.address, shared_memory=False, data_plane=True)
        yield server
        server.good.close()
        assert not re.search(r" (ERROR|CRITICAL) ", server.log()), server.log()[-3000:]


def sentinel_ok(srv) -> None:
    assert np.array_equal(srv.good.get(srv.ns, KEYS), PAGES)


def exchange(srv, frame: bytes, *, shut: bool) -> None:
    """Send frame (then half-close when shut) and read every answer until the server
    closes or goes quiet; each answer must be a well-formed frame."""
    with socket.create_connection(("127.0.0.1", srv.port + 1), timeout=5) as s:
        s.settimeout(0.2)
        try:
            s.sendall(frame)
            if shut:
                s.shutdown(socket.SHUT_WR)
        except OSError:
            return                              # the server closed first: fine
        buf = b""
        while True:
            try:
                got = s.recv(1 << 16)
            except TimeoutError:
                return                          # waiting for more of our frame
            except ConnectionResetError:
                return
            if not got:
                break
            buf += got
        while buf:                              # the answers, back to back
            assert len(buf) >= fw.HEADER.size, buf
            h = fw.decode_header(buf[:fw.HEADER.size], request=False)
            assert h.status in fw.Status._value2member_map_
            assert h.status != fw.Status.INTERNAL, buf
            end = fw.HEADER.size + h.body_len + (h.data_len if not h.status else 0)
            assert len(buf) >= end, "a frame cut short by the server"
            buf = buf[end:]


hello = fw.encode_header(fw.Op.HELLO, 0)
ops = st.sampled_from(list(fw.Op))
keys_block = st.builds(
    lambda size, n, extra: struct.pack("<BI", size, n) + os.urandom(min(n * size, 4096))[:extra],
    st.integers(0, 255), st.integers(0, 16_384 + 2), st.integers(0, 4096))


@st.composite
def bodies(draw, op):
    layout = draw(st.sampled_from([LAYOUT.layout_id, bytes(16), os.urandom(16)]))
    # The sentinel's own keys, except for DELETE: only the sentinel check may miss them.
    real = KEYS[:3] if op != fw.Op.DELETE else [b"fuzz-other-%05d" % i for i in range(3)]
    keys = draw(st.one_of(keys_block, st.just(fw.encode_keys(16, b"".join(real))),
                          st.binary(max_size=64)))
    lease = draw(st.integers(0, 2**64 - 1))
    token = draw(st.sampled_from([bytes(16), b"srv-token"]))
    if op == fw.Op.LOOKUP:
        n = draw(st.integers(0, 300))
        return struct.pack("<IH", draw(st.integers(0, 2**32 - 1)), n % 65536) + \
            layout * min(n, 3) + keys
    if op in (fw.Op.ACQUIRE, fw.Op.RESERVE):
        return layout + token.ljust(16, b"\0")[:16] + struct.pack(
            "<I", draw(st.integers(0, 2**32 - 1))) + keys
    if op in (fw.Op.COMMIT, fw.Op.ABORT, fw.Op.RELEASE):
        return struct.pack("<Q", lease)[:draw(st.integers(0, 8))]
    if op == fw.Op.CALL:
        # A carried name, one not carried, an Admin one, a stranger, or a wrong length;
        # then bytes that may or may not parse as its request (a layout and keys inside).
        name = draw(st.sampled_from([b"Retain", b"RetainMany", b"ReleaseRetention",
                                     b"Removals", b"Lookup", b"Attach", b"Clear", b"Evict",
                                     b"Nope", b"\xff\x00"]))
        size = draw(st.sampled_from([len(name), 0, 65, 255]))
        message = draw(st.one_of(st.binary(max_size=256), st.just(
            b"\x0a\x10" + layout + b"\x12" + bytes((min(len(keys), 127),)) + keys[:127])))
        return bytes((size,)) + name + message
    return layout + keys


@given(st.data())
@examples(300)
def test_hostile_bodies_for_every_op(srv, data):
    op = data.draw(ops.filter(lambda o: o != fw.Op.HELLO))
    body = data.draw(bodies(op))
    if op in (fw.Op.ACQUIRE, fw.Op.RESERVE) and data.draw(st.booleans()):
        body = body[:16] + srv.region_token + body[32:]       # the real token sometimes
    data_len = data.draw(st.sampled_from([0, LAYOUT.page_bytes, 3 * LAYOUT.page_bytes, 7]))
    if op != fw.Op.PUT:
        data_len = data.draw(st.sampled_from([0, 0, 0, 1]))
    payload = bytes(min(data_len, 1 << 16))
    frame = hello + fw.encode_header(op, len(body), data_len,
                                     flags=data.draw(st.integers(0, 3))) + body + payload
    exchange(srv, frame, shut=data.draw(st.booleans()))
    sentinel_ok(srv)


@given(op=st.integers(0, 255), version=st.integers(0, 3), status=st.integers(0, 65535),
       flags=st.integers(0, 65535),
       body_len=st.one_of(st.integers(0, 64), st.integers(0, 2**64 - 1)),
       data_len=st.one_of(st.integers(0, 64), st.integers(0, 2**64 - 1)),
       magic=st.sampled_from([b"KF", b"KG", b"\0\0"]), after_hello=st.booleans(),
       cut=st.integers(0, 24), shut=st.booleans())
@examples(300)
def test_hostile_headers(srv, op, version, status, flags, body_len, data_len, magic,
                         after_hello, cut, shut):
    header = fw.HEADER.pack(magic, version, op, status, flags, body_len, data_len)
    frame = (hello if after_hello else b"") + header[:cut or 24] + bytes(min(body_len, 64))
    exchange(srv, frame, shut=shut)
    sentinel_ok(srv)


@given(junk=st.binary(min_size=1, max_size=512), after_hello=st.booleans(),
       shut=st.booleans())
@examples(200)
def test_random_bytes(srv, junk, after_hello, shut):
    exchange(srv, (hello if after_hello else b"") + junk, shut=shut)
    sentinel_ok(srv)


def test_nothing_is_left_open(srv):
    def open_now() -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics",
                                      timeout=5).read().decode()
        return float(re.search(r"^kvstore_fast_connections (\S+)$", text, re.M).group(1))
    wait_for(lambda: open_now() <= 1, "no connection open but the good client's",
             timeout=10, interval=0.1)
    with KVStoreClient(srv.address, data_plane=False) as c:
        wait_for(lambda: c.stats().leases == 0, "no lease in the server", timeout=10,
                 interval=0.1)
    sentinel_ok(srv)


# -- crowds of slow, silent and hostile peers, on TCP, TLS and the Unix socket ---------------
# Bounds of docs/fastpath.md ("Before and after HELLO") that a crowd must not pass:
CROWD_TIMEOUT = 2.0             # --stream-timeout of the crowd's servers: the HELLO deadline
CROWD_RSS = 32 << 20            # growth of the server's RSS while a crowd is at it
# Every place a crowd took is free by: the HELLO deadline, or a stalled Get's send timeout
# (at most twice --stream-timeout: the header's send, then the pages'), and some slack
# for a loaded machine.
CROWD_FREE_BY = 2 * CROWD_TIMEOUT + 8.0
BIG = PageLayout(model="fuzz-crowd", num_layers=4, page_tokens=16, num_kv_heads=8,
                 head_size=128, dtype="bfloat16")                        # 256 KiB pages
BIG_KEYS = [b"fuzz-crowd-%06d" % i for i in range(64)]                   # 16 MiB
BEHAVIOURS = ("silent", "trickle", "huge_hello", "garbage", "part_body", "stall_get",
              "bare_tcp")


@pytest.fixture(scope="module")
def crowd_servers(tmp_path_factory):
    """kind ("plain": TCP and the Unix socket; "tls": TLS on TCP) -> a server started on
    first use, with a short --stream-timeout, the sentinel and 16 MiB of big pages."""
    import shutil
    servers: dict[str, ServerProcess] = {}

    def get(kind: str) -> ServerProcess:
        if kind in servers:
            return servers[kind]
        flags = {"dram": "128MiB", "stream_timeout": f"{CROWD_TIMEOUT}s",
                 "data_hello_connections": 16, "metrics_port": free_port()}
        tls: dict = {}
        if kind == "tls":
            if shutil.which("openssl") is None:
                pytest.skip("needs the openssl command to make certificates")
            from tests.integration import test_tls
            pki = test_tls.pki.__wrapped__(tmp_path_factory)
            flags |= {"tls_cert": pki / "server.pem", "tls_key": pki / "server.key"}
            tls = {"tls_ca": str(pki / "ca.pem")}
            server = ServerProcess(credentials=test_tls.creds(pki), **flags)
        else:
            server = ServerProcess(**flags)
        server.start()
        server.metrics_port = flags["metrics_port"]
        server.tls = tls
        server.good = KVStoreClient(server.address, shared_memory=False, data_plane=True,
                                    **tls)
        server.ns = server.good.register_layout(LAYOUT)
        server.good.put(server.ns, KEYS, PAGES)
        server.big = server.good.register_layout(BIG)
        server.good.put(server.big, BIG_KEYS, np.zeros((64, BIG.page_bytes), np.uint8))
        servers[kind] = server
        return server

    yield get
    for server in servers.values():
        server.good.close()
        log = server.log()
        server.stop()
        assert not re.search(r" (ERROR|CRITICAL) ", log), log[-3000:]


def _gauge(srv, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics",
                                  timeout=5).read().decode()
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _unix_path(srv) -> str:
    return re.search(r"unix socket (\S+)", srv.log()).group(1)


def _peer(srv, transport: str, behaviour: str):
    """A connected socket as the behaviour wants it: TLS shaken hands where the transport
    is TLS, except for bare_tcp, which never starts the handshake."""
    import ssl
    if transport == "unix":
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(_unix_path(srv))
    else:
        sock = socket.create_connection(("127.0.0.1", srv.port + 1))
        if transport == "tls" and behaviour != "bare_tcp":
            ctx = ssl.create_default_context(cafile=srv.tls["tls_ca"])
            sock = ctx.wrap_socket(sock, server_hostname="127.0.0.1")
    sock.settimeout(1.0)
    return sock


crowds = st.lists(st.tuples(st.sampled_from(BEHAVIOURS), st.binary(max_size=48),
                            st.one_of(st.integers(4097, 64 << 20), st.integers(4097, 2**64 - 1))),
                  min_size=4, max_size=12)


@pytest.mark.parametrize("transport", ["tcp", "unix", "tls"])
def test_crowds_of_slow_silent_and_hostile_peers(crowd_servers, transport):
    """Hypothesis makes crowds of peers that are silent, trickle a HELLO, declare a huge
    HELLO body, send junk, send part of a body, or authenticate and stall a 16 MiB Get;
    each crowd works at the server for 3 s while a well-behaved tenant's calls go on.
    Every call of the tenant is served byte-exact; the server's RSS grows by less than
    CROWD_RSS; every place and pin a crowd took is free within CROWD_FREE_BY of its
    start, while its sockets are still open (the server cut them, nobody closed them)."""
    import time
    srv = crowd_servers("tls" if transport == "tls" else "plain")

    # No shrinking: an example takes seconds, and the first failing crowd says enough.
    @given(crowd=crowds)
    @settings(FUZZ, max_examples=max(1, int(3 * SCALE)),
              phases=[Phase.explicit, Phase.reuse, Phase.generate])
    def run(crowd):
        before = _rss(srv.proc.pid)
        base = _gauge(srv, "kvstore_fast_connections")          # the good client's
        start = time.monotonic()
        peers = []
        for behaviour, junk, huge in crowd:
            sock = _peer(srv, transport, behaviour)
            token = b""
            if behaviour == "huge_hello":
                sock.sendall(fw.encode_header(fw.Op.HELLO, huge) + junk)
            elif behaviour == "garbage":
                sock.sendall(junk or b"\xff")
            elif behaviour == "part_body":
                sock.sendall(fw.encode_header(fw.Op.HELLO, len(junk) + 10) + junk)
            elif behaviour == "stall_get":
                sock.sendall(fw.encode_header(fw.Op.HELLO, len(token)) + token)
                sock.recv(fw.HEADER.size + 64)                  # the HELLO's answer
                body = fw.LAYOUT_HEAD.pack(srv.big.layout_id) + fw.encode_keys(
                    len(BIG_KEYS[0]), b"".join(BIG_KEYS))
                sock.sendall(fw.encode_header(fw.Op.GET, len(body)) + body)
            peers.append((behaviour, sock, bytearray(hello + junk)))
        served = 0
        while time.monotonic() < start + 3.0:
            for behaviour, sock, rest in peers:
                if behaviour == "trickle" and rest:
                    try:
                        sock.sendall(rest[:1])
                    except OSError:
                        rest.clear()
                    del rest[:1]
            assert np.array_equal(srv.good.get(srv.ns, KEYS), PAGES)
            assert srv.good.lookup(srv.ns, KEYS) == len(KEYS)
            served += 1
            time.sleep(0.2)
        assert served and srv.good.fast_path() is not None      # on the fast path still
        grown = _rss(srv.proc.pid) - before
        assert grown < CROWD_RSS, f"RSS grew {grown >> 20} MiB under a crowd of {len(crowd)}"
        with KVStoreClient(srv.address, data_plane=False, **srv.tls) as admin:
            while True:
                hello_open = _gauge(srv, "kvstore_fast_hello_connections")
                open_now = _gauge(srv, "kvstore_fast_connections")
                leases = admin.stats().leases
                if (hello_open == 0 and open_now <= base and leases == 0) \
                        or time.monotonic() > start + CROWD_FREE_BY:
                    break
                time.sleep(0.2)
        assert hello_open == 0, f"{hello_open} unauthenticated connections outlived the deadline"
        assert open_now <= base, f"{open_now - base} of the crowd's connections are still open"
        assert leases == 0, f"{leases} leases outlived --stream-timeout"
        for _, sock, _ in peers:
            sock.close()

    run()
