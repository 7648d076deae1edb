"""The fast path's Reader: waits between frames across receive timeouts, reads ahead
little, and a stall inside a frame still ends it."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from kvstore_server.fastpath.io import Reader, set_timeouts


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_a_header_may_come_after_several_receive_timeouts(pair):
    a, b = pair
    set_timeouts(a, 0.05)
    reader = Reader(a, idle_waits=6)
    b.sendall(b"x" * 10)
    assert bytes(reader.head(10)) == b"x" * 10
    # Nothing for ~3 timeouts, then the next header: still the same connection.
    start = time.monotonic()
    timer = threading.Timer(0.17, lambda: b.sendall(b"y" * 24))
    timer.start()
    assert bytes(reader.head(24)) == b"y" * 24
    timer.join()
    assert time.monotonic() - start >= 0.15


def test_idle_for_all_its_waits_ends_the_wait(pair):
    a, _ = pair
    set_timeouts(a, 0.03)
    reader = Reader(a, idle_waits=3)
    start = time.monotonic()
    with pytest.raises(BlockingIOError):
        reader.head(24)
    assert time.monotonic() - start >= 0.08


def test_a_frame_begun_and_stalled_ends_at_one_timeout(pair):
    a, b = pair
    set_timeouts(a, 0.05)
    reader = Reader(a, idle_waits=100)
    b.sendall(b"z" * 10)                 # part of a header, then nothing
    start = time.monotonic()
    with pytest.raises(BlockingIOError):
        reader.head(24)
    assert time.monotonic() - start < 1.0


def test_page_bytes_beyond_read_ahead_are_received_straight_into_place(pair):
    a, b = pair
    reader = Reader(a)
    head = struct.pack("<Q", 65536)
    page = bytes(range(256)) * 256
    b.sendall(head + page)
    time.sleep(0.05)                     # all of it waits in the socket
    assert bytes(reader.head(8)) == head
    # One receive took the header and at most READ_AHEAD bytes more, not the page.
    assert reader._end - reader._start <= Reader.READ_AHEAD
    out = memoryview(bytearray(65536))
    reader.read_into(out)
    assert bytes(out) == page
