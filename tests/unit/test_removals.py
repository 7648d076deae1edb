"""The removal ring alone (kvstore_server.removals): order, cursors, gaps, bounds."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore_server.removals import MAX_READ, Cause, RemovalRing

A, B = b"A" * 16, b"B" * 16


def keys(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}{i}".encode().ljust(16, b"_") for i in range(n)]


def test_entries_in_order_of_the_asked_layouts_only():
    ring = RemovalRing(64)
    start = ring.read([A], 0, 0)
    assert (len(start), start.next_seq, start.gap) == (0, 0, False)
    ring.record(A, keys("a", 3), Cause.EVICTED)
    ring.record(B, keys("b", 2), Cause.DELETED)
    ring.record_layout(A, Cause.INVALIDATED)
    got = ring.read([A], start.next_seq, start.epoch)
    assert got.seqs.tolist() == [1, 2, 3, 6]
    assert list(got.causes) == [1, 1, 1, 3]
    assert list(got.key_sizes) == [16, 16, 16, 0]
    assert got.keys == b"".join(keys("a", 3))
    assert (got.next_seq, got.gap, got.more) == (6, False, False)
    both = ring.read([B, A], 0, start.epoch)
    assert both.layout_pos.tolist() == [1, 1, 1, 0, 0, 1]
    assert ring.read([A], got.next_seq, got.epoch).seqs.tolist() == []


def test_keys_as_rows_and_of_mixed_sizes():
    ring = RemovalRing(16)
    rows = np.frombuffer(b"".join(keys("r", 4)), dtype=np.uint8).reshape(4, 16)
    ring.record(A, rows, Cause.EVICTED)
    ring.record(A, [b"x", b"yy"], Cause.DELETED)
    got = ring.read([A], 0, ring.epoch)
    assert list(got.key_sizes) == [16] * 4 + [1, 2]
    assert got.keys == rows.tobytes() + b"xyy"


def test_overwritten_entries_are_a_gap_and_reading_resumes_at_the_oldest():
    ring = RemovalRing(8)
    cursor = ring.read([A], 0, 0)
    ring.record(A, keys("a", 20), Cause.EVICTED)
    got = ring.read([A], cursor.next_seq, cursor.epoch)
    assert got.gap and got.seqs.tolist() == list(range(13, 21))
    assert got.keys == b"".join(keys("a", 20)[12:])
    again = ring.read([A], got.next_seq, got.epoch)
    assert not again.gap and len(again) == 0


def test_another_epoch_or_a_cursor_ahead_is_a_gap():
    ring = RemovalRing(8)
    ring.record(A, keys("a", 2), Cause.EVICTED)
    assert ring.read([A], 0, ring.epoch + 2).gap             # a restarted server
    assert ring.read([A], 99, ring.epoch).gap                # another server's cursor
    assert not ring.read([A], 0, ring.epoch).gap


def test_limit_stops_a_read_and_says_more():
    ring = RemovalRing(64)
    ring.record(A, keys("a", 5), Cause.EVICTED)
    ring.record(B, keys("b", 5), Cause.EVICTED)
    ring.record(A, keys("c", 5), Cause.EVICTED)
    got = ring.read([A], 0, ring.epoch, limit=7)
    assert got.seqs.tolist() == [1, 2, 3, 4, 5, 11, 12] and got.more
    rest = ring.read([A], got.next_seq, got.epoch, limit=7)
    assert rest.seqs.tolist() == [13, 14, 15] and not rest.more
    assert ring.read([A], 0, ring.epoch, limit=10 ** 9).seqs.size == 10   # capped, not refused
    assert MAX_READ >= 10


def test_a_layout_never_recorded_reads_nothing_and_moves_the_cursor():
    ring = RemovalRing(8)
    ring.record(A, keys("a", 3), Cause.EVICTED)
    got = ring.read([b"C" * 16], 0, ring.epoch)
    assert len(got) == 0 and got.next_seq == 3


def test_a_batch_larger_than_the_ring_keeps_its_last_lap():
    ring = RemovalRing(4)
    ring.record(A, keys("a", 10), Cause.EVICTED)
    got = ring.read([A], 0, ring.epoch)
    assert got.gap and got.seqs.tolist() == [7, 8, 9, 10]
    assert got.keys == b"".join(keys("a", 10)[6:])


def test_capacity_must_be_positive():
    with pytest.raises(ValueError):
        RemovalRing(0)
