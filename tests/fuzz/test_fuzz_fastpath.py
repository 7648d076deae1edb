"""Fuzzing the fast path: hostile frames on its TCP port and its Unix socket.

One real kvstore-server serves the module. Hypothesis makes (a) frames with a valid
header and hostile bodies for every op, (b) headers with hostile fields (op, version,
lengths up to 2^64-1, flags, status), (c) random bytes, each sent whole, cut short, or
followed by silence. Every answer must be a frame with a documented status (an error
never kills the connection unless it is PROTOCOL, and then the server must close it);
after every example the sentinel pages come back byte-exact through a well-behaved
client, and at the end the server's log holds no error and no connection is left open.
"""

from __future__ import annotations

import os
import re
import socket
import struct
import urllib.request

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvstore_testing.serverproc import ServerProcess, free_port

from kvstore_client import KVStoreClient, PageLayout
from kvstore_client import fastwire as fw

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
    import time
    deadline = time.monotonic() + 10
    while True:
        text = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics",
                                      timeout=5).read().decode()
        open_now = float(re.search(r"^kvstore_fast_connections (\S+)$", text, re.M).group(1))
        if open_now <= 1 or time.monotonic() > deadline:      # the good client's
            break
        time.sleep(0.1)
    assert open_now <= 1
    with KVStoreClient(srv.address, data_plane=False) as c:
        deadline = time.monotonic() + 10
        while c.stats().leases and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.stats().leases == 0
    sentinel_ok(srv)
