"""A small Get's answer sent under the store's lock (Ops.send_now) against a socket that
takes all, part or none of it without waiting: the bytes on the wire are the answer
exactly once, and the page is pinned whenever its bytes go out after the lock is dropped."""

import functools
import socket

import numpy as np
import pytest

from kvstore_protocol import fastwire as fw
from kvstore_protocol.keys import Packed
from kvstore_protocol.layout import PageLayout
from kvstore_server.auth import ANONYMOUS
from kvstore_server.fastpath.ops import Ops, Session
from kvstore_server.region import Region
from kvstore_server.store import Store

MiB = 1 << 20
LAYOUT = PageLayout(model="fewsend", num_layers=4, page_tokens=16, num_kv_heads=1,
                    head_size=32)


class FakeSocket:
    """Takes `now` bytes of a send that may not wait (None: refuses it, EAGAIN), all of
    a blocking one; records what the store looked like at each send."""

    def __init__(self, store: Store, slot: int, now: int | None) -> None:
        self.store, self.slot, self.now = store, slot, now
        self.out = bytearray()
        self.seen: list[tuple[bool, int, bool]] = []    # (may wait, pins, lock held)

    def sendmsg(self, buffers, ancdata=(), flags=0, address=None):
        data = b"".join(bytes(b) for b in buffers)
        waits = not flags & socket.MSG_DONTWAIT
        self.seen.append((waits, int(self.store._slots.pins[self.slot]),
                          self.store._s.lock._lock.locked()))
        if not waits:
            if self.now is None:
                raise BlockingIOError("EAGAIN")
            data = data[:self.now]
        self.out += data
        return len(data)


@pytest.fixture
def store():
    region = Region(16 * MiB)
    yield Store(region)
    region.close()


@pytest.mark.parametrize("takes", [None, 0, 5, 32, 1000, "all"])
def test_the_answer_goes_out_once_whole_and_pinned_after_the_lock(store, takes):
    ops = Ops(store, auth_on=False)
    layout = ops.calls.layout(ANONYMOUS, LAYOUT.layout_id)
    info = store.register_layout(LAYOUT)
    key = b"k" * 16
    page = np.random.default_rng(1).integers(0, 256, info.page_bytes, dtype=np.uint8)
    assert ops.calls.put_bytes(ANONYMOUS, LAYOUT.layout_id, key, 16,
                               memoryview(page)) == (1, 0, 0)
    slot = store.pin_few(layout, Packed(key, 16))[1]
    store.unpin_few(slot)
    whole = fw.ALIGN_PAD + 24 + info.page_bytes
    sock = FakeSocket(store, slot[0], whole if takes == "all" else takes)
    s = Session(sock, None, True, memoryview(bytearray(64)), ANONYMOUS,  # type: ignore[arg-type]
                bytes(fw.ALIGN_PAD))
    s.now = functools.partial(ops.send_now, s)
    body = fw.LAYOUT_KEYS_HEAD.pack(LAYOUT.layout_id, 16, 1) + key
    ops.get(s, fw.Header(fw.Op.GET, 0, fw.PAGE_MAJOR, len(body), 0), memoryview(body))
    head = fw.decode_header(bytes(sock.out[:24]), request=False)
    assert (head.op, head.body_len, head.data_len) == (fw.Op.GET, fw.ALIGN_PAD,
                                                       info.page_bytes)
    assert bytes(sock.out[24 + fw.ALIGN_PAD:]) == page.tobytes()
    assert len(sock.out) == whole
    # The first send, under the lock, without a pin; anything after it: pinned, no lock.
    assert sock.seen[0] == (False, 0, True)
    assert all(pins == 1 and not locked for _, pins, locked in sock.seen[1:])
    assert len(sock.seen) == (1 if takes == "all" else 2)
    assert not store._slots.pins.any() and store.stats().leases == 0 and s.sent == 0
