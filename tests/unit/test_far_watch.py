"""FarWatch's rounds (far/watch.py) with a real removal ring and the cluster's answers
given as functions: what the cluster answered gone is recorded once, what it did not
answer or still holds is kept, what is queued or held above is not asked about, and the
watch stays within its bounds."""

from __future__ import annotations

import numpy as np

from kvstore_server.far.watch import FarWatch
from kvstore_server.removals import Cause, RemovalRing

LAYOUT = b"L" * 16


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


class Cluster:
    """What EXISTS answers: held keys, keys whose master does not answer."""

    def __init__(self) -> None:
        self.held: set[bytes] = set()
        self.silent: set[bytes] = set()
        self.asked: list[bytes] = []

    def exists(self, layout_id: bytes, keys: list[bytes], timeout: float):
        self.asked += keys
        return ([k in self.held for k in keys], [k not in self.silent for k in keys])


def watch_of(cluster: Cluster, ring: RemovalRing, unwritten=frozenset(), **kw) -> FarWatch:
    w = FarWatch(cluster.exists, lambda: set(unwritten), **kw)
    w.removals = ring
    return w


def reported(ring: RemovalRing) -> list[bytes]:
    got = ring.read([LAYOUT], 0, ring.epoch)
    assert set(got.causes) <= {int(Cause.EVICTED)}
    return [got.keys[i * 16:(i + 1) * 16] for i in range(len(got))]


def test_gone_is_reported_once_held_and_unanswered_are_kept():
    cluster, ring = Cluster(), RemovalRing(64)
    w = watch_of(cluster, ring)
    for i in range(6):
        w.add(LAYOUT, [key(i)])
    cluster.held = {key(0), key(1)}
    cluster.silent = {key(2)}
    assert w.check() == 3
    assert reported(ring) == [key(3), key(4), key(5)]
    assert len(w) == 3
    cluster.silent = set()
    assert w.check() == 1 and reported(ring)[-1] == key(2)
    assert w.check() == 0 and len(w) == 2


def test_queued_and_held_above_are_not_asked_and_forgotten_not_reported():
    cluster, ring = Cluster(), RemovalRing(64)
    w = watch_of(cluster, ring, unwritten={(LAYOUT, key(0))})
    w.held_above = lambda layout_id, keys: np.array([k == key(1) for k in keys])
    for i in range(4):
        w.add(LAYOUT, [key(i)])
    w.forget(LAYOUT, [key(3)])
    assert w.check() == 1
    assert cluster.asked == [key(2)] and reported(ring) == [key(2)]
    assert len(w) == 1                  # key 0 waits for its write; key 1 is in DRAM


def test_past_capacity_the_oldest_are_reported_unless_held_above():
    cluster, ring = Cluster(), RemovalRing(64)
    w = watch_of(cluster, ring, capacity=4, per_round=2)
    w.held_above = lambda layout_id, keys: np.array([k == key(0) for k in keys])
    cluster.held = {key(i) for i in range(10)}
    for i in range(6):
        w.add(LAYOUT, [key(i)])
    assert len(w) == 6                  # 4 watched, 2 over: checked at the next round
    w.add(LAYOUT, [key(6)])               # over the round's size: reported at once
    assert reported(ring) == [key(0)]
    assert w.check() == 2 and reported(ring) == [key(0), key(1), key(2)]
    assert len(w) == 4
    w.forget_layout(LAYOUT)
    assert len(w) == 0 and w.check() == 0


def test_the_capacity_drops_the_page_watched_longest_whatever_the_rounds_did():
    """A round puts the pages it keeps behind the others for the next rounds; the capacity
    still drops the page added first, not the one the rounds happen to reach next."""
    cluster, ring = Cluster(), RemovalRing(64)
    w = watch_of(cluster, ring, capacity=4, per_round=2)
    cluster.held = {key(i) for i in range(10)}
    for i in range(4):
        w.add(LAYOUT, [key(i)])
    assert w.check() == 0               # 0 and 1 checked: the next round checks 2 and 3
    assert cluster.asked == [key(0), key(1)]
    w.add(LAYOUT, [key(4)])             # over the capacity: 0 goes, the page added first
    assert w.check() == 1 and reported(ring) == [key(0)]
    assert cluster.asked[2:] == [key(2), key(3)]
    assert len(w) == 4


def test_a_page_forgotten_or_dropped_during_its_round_is_not_watched_again():
    """The round's pages are out of the check order while the cluster answers: a delete
    through this server, or the capacity, may reach them then."""
    cluster, ring = Cluster(), RemovalRing(64)
    w = watch_of(cluster, ring, capacity=2, per_round=2)
    answers = cluster.exists

    def exists_while_the_server_works(layout_id, keys, timeout):
        w.forget(LAYOUT, [key(0)])      # deleted through this server
        w.add(LAYOUT, [key(2)])         # over the capacity: 1 is dropped
        return answers(layout_id, keys, timeout)

    w._exists = exists_while_the_server_works
    cluster.held = {key(0)}             # 0 is held, 1 is gone from the cluster
    w.add(LAYOUT, [key(0), key(1)])
    assert w.check() == 1 and reported(ring) == [key(1)]
    w._exists = answers
    cluster.held = {key(2)}
    assert w.check() == 0               # 1, dropped and gone, is not reported twice
    assert reported(ring) == [key(1)]
    assert len(w) == 1 and w.check() == 0 and cluster.asked[-1] == key(2)
