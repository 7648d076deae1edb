"""The fast path's wire format (kvstore_protocol.fastwire): headers, bounds, keys."""

from __future__ import annotations

import socket
import struct
import threading

import numpy as np
import pytest

from kvstore_client.errors import Reason
from kvstore_protocol import fastwire as fw
from kvstore_server.config import ConfigError, data_address, load_config
from kvstore_server.fastpath.io import IOV_BATCH, SEND_BYTES, runs, send_views


def test_one_status_table_agrees_with_the_grpc_path():
    """The fast path answers each data call's outcome with the gRPC code the gRPC path
    gives it (status.CODES), through the one table both ends import; the outcomes only
    Admin calls have (errors.ADMIN_ONLY) never reach it and would be a server defect."""
    from kvstore_server.errors import ADMIN_ONLY, Outcome, StoreError
    from kvstore_server.fastpath.ops import status_of
    from kvstore_server.rpc.status import CODES
    assert set(Outcome) > ADMIN_ONLY
    for outcome in set(Outcome) - ADMIN_ONLY:
        assert fw.GRPC_CODES[status_of(StoreError(outcome, ""))] is CODES[outcome], outcome
    for outcome in ADMIN_ONLY:
        assert status_of(StoreError(outcome, "")) is fw.Status.INTERNAL


def test_the_body_bound_follows_the_keys_limit():
    assert fw.request_body_bytes(16_384) == fw.MAX_BODY
    big = fw.request_body_bytes(100_000)
    raw = fw.HEADER.pack(fw.MAGIC, fw.VERSION, fw.Op.LOOKUP, 0, 0, fw.MAX_BODY + 1, 0)
    assert fw.decode_header(raw, request=True, max_body=big).body_len == fw.MAX_BODY + 1
    with pytest.raises(fw.WireError, match="over the limit of 1000"):
        fw.decode_header(raw, request=True, max_body=1000)


def test_header_round_trip():
    raw = fw.encode_header(fw.Op.PUT, 100, 1 << 33, status=0, flags=1)
    assert len(raw) == fw.HEADER.size == 24
    h = fw.decode_header(raw, request=True)
    assert (h.op, h.body_len, h.data_len, h.flags) == (fw.Op.PUT, 100, 1 << 33, 1)


@pytest.mark.parametrize("raw, words", [
    (b"GET / HTTP/1.1\r\nHost: x\r\n", "not a kvstore fast-path frame"),
    (fw.HEADER.pack(b"KF", 9, 2, 0, 0, 0, 0), "version 9"),
    # Version 1 answered PUT and RESERVE without the in-flight count: a version 1 peer
    # would read a version 2 RESERVE's offsets four bytes off, so it is refused.
    (fw.HEADER.pack(b"KF", 1, 2, 0, 0, 0, 0), "version 1"),
    # Version 2 answered errors without a reason in the flags: its client matched message
    # text, so a version 3 server's reworded message would break its recoveries.
    (fw.HEADER.pack(b"KF", 2, 2, 0, 0, 0, 0), "version 2"),
    (fw.HEADER.pack(fw.MAGIC, fw.VERSION, 200, 0, 0, 0, 0), "unknown op 200"),
    (fw.HEADER.pack(fw.MAGIC, fw.VERSION, fw.Op.LOOKUP, 0, 0, fw.MAX_BODY + 1, 0), "over the limit"),
    (fw.HEADER.pack(fw.MAGIC, fw.VERSION, fw.Op.LOOKUP, 0, 0, 0, 1), "only PUT carries data"),
    (fw.HEADER.pack(fw.MAGIC, fw.VERSION, fw.Op.PUT, 0, 0, 0, fw.MAX_DATA + 1), "only PUT carries data"),
])
def test_bad_headers_are_refused_before_any_allocation(raw, words):
    with pytest.raises(fw.WireError, match=words) as info:
        fw.decode_header(raw[:24].ljust(24, b"\0"), request=True)
    assert info.value.status is fw.Status.PROTOCOL


def test_answers_are_not_held_to_request_bounds():
    raw = fw.encode_header(fw.Op.GET, 0, fw.MAX_DATA * 2)
    assert fw.decode_header(raw, request=False).data_len == fw.MAX_DATA * 2


def test_keys_round_trip():
    packed = b"".join(i.to_bytes(16, "little") for i in range(5))
    body = memoryview(b"xx" + fw.encode_keys(16, packed))
    keys, end = fw.decode_keys(body, 2)
    assert (keys.key_size, keys.n, keys.data, end) == (16, 5, packed, len(body))


# Key blocks the decoder must refuse, and words its message must hold.
BAD_KEY_BLOCKS = [
    (struct.pack("<BI", 16, 1 << 30) + bytes(64), "need 17179869184"),
    (struct.pack("<BI", 0, 3), "key_size must be"),
    (struct.pack("<BI", 65, 1) + bytes(65), "key_size must be"),
    (struct.pack("<BI", 16, 3) + bytes(47), "need 48"),
    (b"\x10\x00", "ends before its keys"),
]


@pytest.mark.parametrize("block, words", BAD_KEY_BLOCKS)
def test_bad_keys_are_invalid_not_fatal(block, words):
    with pytest.raises(fw.WireError, match=words) as info:
        fw.decode_keys(memoryview(block), 0)
    assert info.value.status is fw.Status.INVALID


@pytest.mark.parametrize("keys", [
    b"", bytes(range(16)), bytes(range(48)) + b"trailing bytes are not keys",
])
def test_a_layout_and_its_keys_decode_in_one_unpack_as_in_two(keys):
    """decode_layout_keys (one unpack, what GET and PUT use) reads what LAYOUT_HEAD then
    decode_keys read, and answers no keys with size 0 (an unset size)."""
    layout = bytes(range(100, 116))
    packed = keys[:48] if len(keys) > 48 else keys
    body = memoryview(layout + fw.encode_keys(16, packed) + keys[48:])
    block, _ = fw.decode_keys(body, fw.LAYOUT_HEAD.size)
    assert fw.decode_layout_keys(body) == (layout, 16 if packed else 0, block.data)
    assert fw.decode_layout_keys(memoryview(layout + fw.encode_keys(0, b""))) == (layout, 0, b"")


@pytest.mark.parametrize("block, words", BAD_KEY_BLOCKS)
def test_a_layout_with_bad_keys_is_refused_as_decode_keys_refuses_it(block, words):
    with pytest.raises(fw.WireError, match=words) as info:
        fw.decode_layout_keys(memoryview(bytes(16) + block))
    assert info.value.status is fw.Status.INVALID
    with pytest.raises(fw.WireError, match="too short for this op") as info:
        fw.decode_layout_keys(memoryview(bytes(15)))
    assert info.value.status is fw.Status.INVALID


def test_runs_join_adjacent_offsets_and_isolate_skipped():
    offsets = np.array([0, 10, 20, 50, -1, -1, 60, 70], dtype=np.int64)
    assert list(runs(offsets, 10)) == [(0, 3, 0), (3, 4, 50), (4, 5, -1), (5, 6, -1),
                                       (6, 8, 60)]
    assert list(runs(np.array([], dtype=np.int64), 10)) == []


@pytest.mark.parametrize("n", [1, 2, 8, 63, 64, 65, 200])
def test_runs_are_the_same_walked_in_python_and_in_numpy(n):
    """Short lists are walked in Python ints, long ones with numpy: the same runs."""
    from kvstore_server.fastpath import io
    rng = np.random.default_rng(n)
    for _ in range(20):
        offsets = np.cumsum(rng.choice([10, 10, 10, 30], n)).astype(np.int64)
        offsets[rng.random(n) < 0.1] = -1
        expected = []
        i = 0
        while i < n:                      # the definition, one entry at a time
            j = i + 1
            while (offsets[i] >= 0 and j < n and offsets[j] >= 0
                   and offsets[j] == offsets[j - 1] + 10):
                j += 1
            expected.append((i, j, int(offsets[i])))
            i = j
        assert list(runs(offsets, 10)) == expected
        assert list(io.runs_of(offsets.tolist(), 10)) == expected


@pytest.mark.parametrize("value, expected", [
    ("auto", ("127.0.0.1", 50052)), ("off", None), ("127.0.0.1:7000", ("127.0.0.1", 7000))])
def test_data_listen(value, expected):
    assert data_address(load_config(["--data-listen", value], environ={})) == expected


def test_data_listen_off_loopback_needs_auth():
    with pytest.raises(ConfigError, match=r"data_listen 0\.0\.0\.0:7000 is not loopback"):
        load_config(["--data-listen", "0.0.0.0:7000"], environ={})
    with pytest.raises(ConfigError, match="HOST:PORT, auto or off"):
        load_config(["--data-listen", "nonsense"], environ={})


def test_an_error_answers_flags_name_its_reason_and_unknown_flags_name_none():
    for reason in Reason:
        assert fw.reason_of_flags(fw.reason_flags(reason)) is reason
    assert fw.reason_flags(None) == 0 and fw.reason_of_flags(0) is None
    assert fw.reason_of_flags(999) is None


class _CountingSocket(socket.socket):
    """A real socket that notes the bytes each sendmsg was handed."""

    calls: list[tuple[int, int]]        # (bytes, views) of each sendmsg

    def sendmsg(self, buffers, *args):
        self.calls.append((sum(memoryview(b).nbytes for b in buffers), len(buffers)))
        return super().sendmsg(buffers, *args)


def test_send_views_sends_every_byte_in_order_in_bounded_calls():
    """Views larger than one call's bound go in pieces, many small ones are joined: the
    receiver gets exactly the bytes in order, and no sendmsg is handed more than
    SEND_BYTES or more than IOV_BATCH views."""
    a, b = socket.socketpair()
    sender = _CountingSocket(fileno=a.detach())
    sender.calls = []
    rng = np.random.default_rng(1)
    sizes = [1, SEND_BYTES * 3 + 5, *([100] * (IOV_BATCH + 7)), SEND_BYTES - 1, 2, 0, 70_000]
    blobs = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    expected = b"".join(blobs)
    got = bytearray()

    def drain() -> None:
        while len(got) < len(expected):
            chunk = b.recv(1 << 20)
            if not chunk:
                return
            got.extend(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    send_views(sender, [memoryview(x) for x in blobs])
    reader.join(30)
    sender.close()
    b.close()
    assert bytes(got) == expected
    assert max(n for n, _ in sender.calls) <= SEND_BYTES
    assert max(v for _, v in sender.calls) <= IOV_BATCH
    assert len(sender.calls) >= len(expected) // SEND_BYTES


@pytest.mark.parametrize(("pages", "alone"), [(1, False), (7, False), (8, True), (16, True)])
def test_a_large_page_major_get_sends_its_header_alone(pages, alone):
    """From HEAD_ALONE_BYTES of pages the 24-byte header goes in a sendmsg of its own, so
    the pages keep their source's alignment (copied at about half speed 24 bytes off, on
    some CPUs); below it header and pages share one sendmsg (one system call). Either
    way the receiver gets the header, then exactly the stored bytes."""
    from kvstore_client import PageLayout
    from kvstore_server.auth import ANONYMOUS
    from kvstore_server.fastpath.io import Reader
    from kvstore_server.fastpath.ops import HEAD_ALONE_BYTES, Ops, Session
    from kvstore_server.region import HEADER_BYTES, Region
    from kvstore_server.store import Store

    layout = PageLayout(model="head-alone-64k", num_layers=32, page_tokens=16,
                        num_kv_heads=1, head_size=32)
    store = Store(Region((32 << 20) + HEADER_BYTES))
    info = store.register_layout(layout)
    pb = info.page_bytes
    assert pb == 64 << 10 and 8 * pb == HEAD_ALONE_BYTES
    keys = [i.to_bytes(16, "little") for i in range(pages)]
    data = np.random.default_rng(pages).integers(0, 256, pages * pb, dtype=np.uint8)
    res = store.reserve(info.layout_id, keys)
    for i, off in enumerate(res.offsets):
        store.mem.data[off:off + pb] = data[i * pb:(i + 1) * pb].tobytes()
    store.commit(res.lease_id)
    ops = Ops(store, auth_on=False)
    a, b = socket.socketpair()
    sender = _CountingSocket(fileno=a.detach())
    sender.calls = []
    got = bytearray()
    want = fw.HEADER.size + pages * pb

    def drain() -> None:
        while len(got) < want:
            chunk = b.recv(1 << 20)
            if not chunk:
                return
            got.extend(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    body = memoryview(info.layout_id + fw.encode_keys(16, b"".join(keys)))
    session = Session(sender, Reader(sender), True, memoryview(bytearray(16)), ANONYMOUS)
    head = fw.Header(fw.Op.GET, 0, fw.PAGE_MAJOR, len(body), 0)
    try:
        ops.get(session, head, body)
        reader.join(30)
    finally:
        sender.close()
        b.close()
        ops.close()
    answer = fw.decode_header(got[:fw.HEADER.size], request=False)
    assert (answer.op, answer.status, answer.data_len) == (fw.Op.GET, 0, pages * pb)
    assert bytes(got[fw.HEADER.size:]) == data.tobytes()
    # The header sent alone goes by sendall, so the sendmsg calls carry only the pages.
    sent_by_sendmsg = sum(n for n, _ in sender.calls)
    if alone:
        assert sent_by_sendmsg == pages * pb
    else:
        assert [n for n, _ in sender.calls] == [want]


class _CutShortSocket(socket.socket):
    """A real socket whose first sendmsg takes only part of what it is handed, as one
    that SO_SNDTIMEO cuts short does."""

    cut: int

    def sendmsg(self, buffers, *args):
        if not self.cut:
            return super().sendmsg(buffers, *args)
        joined = b"".join(bytes(b) for b in buffers)[:self.cut]
        self.cut = 0
        self.sendall(joined)
        return len(joined)


@pytest.mark.parametrize("cut", [10, 24 + fw.ALIGN_PAD + 100])    # in the header; a page
def test_a_get_cut_short_sends_the_rest_not_all_again(cut):
    """A Get whose one sendmsg a send timeout cut short goes on from where it stopped:
    the receiver gets the header, the pad and the page once each (the whole batch was
    sent again after the part already sent, and the connection fell out of step)."""
    from kvstore_client import PageLayout
    from kvstore_server.auth import ANONYMOUS
    from kvstore_server.fastpath.io import Reader
    from kvstore_server.fastpath.ops import Ops, Session
    from kvstore_server.region import HEADER_BYTES, Region
    from kvstore_server.store import Store

    layout = PageLayout(model="cut-short", num_layers=1, page_tokens=16, num_kv_heads=1,
                        head_size=64)
    store = Store(Region((4 << 20) + HEADER_BYTES))
    info = store.register_layout(layout)
    pb = info.page_bytes
    key = b"k".ljust(16, b".")
    data = np.random.default_rng(cut).integers(0, 256, pb, dtype=np.uint8)
    res = store.reserve(info.layout_id, [key])
    store.mem[int(res.offsets[0]):int(res.offsets[0]) + pb] = data
    store.commit(res.lease_id)
    ops = Ops(store, auth_on=False)
    a, b = socket.socketpair()
    sender = _CutShortSocket(fileno=a.detach())
    sender.cut = cut
    body = memoryview(info.layout_id + fw.encode_keys(16, key))
    pad = bytes(fw.ALIGN_PAD)
    session = Session(sender, Reader(sender), True, memoryview(bytearray(16)), ANONYMOUS, pad)
    try:
        ops.get(session, fw.Header(fw.Op.GET, 0, fw.PAGE_MAJOR, len(body), 0), body)
        sender.shutdown(socket.SHUT_WR)
        got = bytearray()
        while chunk := b.recv(1 << 20):
            got.extend(chunk)
    finally:
        sender.close()
        b.close()
        ops.close()
        store.region.close()
    answer = fw.decode_header(got[:fw.HEADER.size], request=False)
    assert (answer.op, answer.status, answer.body_len, answer.data_len) == (
        fw.Op.GET, 0, len(pad), pb)
    assert bytes(got[fw.HEADER.size:]) == pad + data.tobytes()


def test_a_connections_scratch_starts_on_a_page_boundary():
    """A small Put's pages are copied from it into page-aligned pool slots: a source a few
    bytes short of a page boundary made that copy many times slower (connection.py)."""
    import ctypes

    from kvstore_server.fastpath.connection import SCRATCH_BYTES, _scratch

    scratch = _scratch()
    assert len(scratch) == SCRATCH_BYTES and not scratch.readonly
    assert ctypes.addressof(ctypes.c_char.from_buffer(scratch)) % 4096 == 0
    scratch[-1] = 7
    assert scratch[-1] == 7
