"""Write-behind to the far tier: offer never blocks, a full queue drops and counts, what
was queued is written in batches per layout, close drains."""

from __future__ import annotations

import threading
import time

from kvstore_server.far.writer import WriteBehind
from tests.waiting import wait_for


class Sink:
    """A put function that can be held shut, to fill the queue on purpose."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()
        self.calls: list[tuple[bytes, list]] = []

    def __call__(self, layout_id, items):
        self.open.wait(10)
        self.calls.append((layout_id, [(k, bytes(p)) for k, p in items]))
        return len(items)


def test_full_queue_drops_and_never_blocks():
    sink = Sink()
    sink.open.clear()
    w = WriteBehind(sink, max_bytes=4 << 20)
    page = b"x" * (1 << 20)
    w.offer(b"L" * 16, b"first", page)          # taken by the thread, which then blocks
    wait_for(lambda: not w.depth()[0], "the writer to take the first page")
    t = time.perf_counter()
    accepted = [w.offer(b"L" * 16, bytes([i]), page) for i in range(10)]
    elapsed = time.perf_counter() - t
    assert accepted == [True] * 4 + [False] * 6
    assert w.counters.drops == 6 and w.depth() == (4, 4 << 20)
    assert elapsed < 0.5, "offer waited"
    sink.open.set()
    assert w.flush(10)
    w.close()
    written = [k for _, items in sink.calls for k, _ in items]
    assert written == [b"first"] + [bytes([i]) for i in range(4)]


def test_batches_group_by_layout_and_copy_the_page():
    sink = Sink()
    sink.open.clear()
    w = WriteBehind(sink, max_bytes=1 << 20)
    buf = bytearray(b"a" * 10)
    w.offer(b"A" * 16, b"k0", buf)
    wait_for(lambda: not w.depth()[0], "the writer to take k0 (then held by the sink)")
    for i in range(3):
        w.offer(b"A" * 16 if i % 2 else b"B" * 16, b"k%d" % (i + 1), buf)
    buf[:] = b"b" * 10                            # the pool slot is reused after offer
    sink.open.set()
    w.close()
    assert all(p == b"a" * 10 for _, items in sink.calls for _, p in items)
    assert [lid[:1] for lid, _ in sink.calls[1:]] == [b"B", b"A"]
    assert w.depth() == (0, 0)


def test_a_failing_put_does_not_stop_the_writer():
    calls = []

    def put(layout_id, items):
        calls.append(len(items))
        raise ValueError("bad key")

    w = WriteBehind(put, max_bytes=1 << 20)
    w.offer(b"A" * 16, b"k", b"p")
    assert w.flush(5)
    w.offer(b"A" * 16, b"k", b"p")
    assert w.flush(5)
    w.close()
    assert calls == [1, 1] and w.counters.errors == 2


class Unlinker:
    """An unlink function whose cluster confirms nothing until told to."""

    def __init__(self) -> None:
        self.answering = False
        self.calls: list[list[bytes]] = []

    def __call__(self, layout_id, keys):
        self.calls.append(list(keys))
        return [] if self.answering else list(keys)


def test_a_delete_drops_the_queued_writes_of_its_keys():
    sink = Sink()
    sink.open.clear()
    w = WriteBehind(sink, max_bytes=1 << 20)
    lid = b"L" * 16
    w.offer(lid, b"first", b"p")
    wait_for(lambda: not w.depth()[0], "the writer to take the first page")
    for k in (b"a", b"b", b"c"):
        w.offer(lid, k, b"p")
    generation, writing = w.forget(lid, [b"b", b"first"])
    assert writing == {b"first"}                # being written: not to settle before it lands
    assert w.depth() == (2, 2)
    w.settle(lid, [b"b"], generation)
    sink.open.set()
    w.close()
    assert [k for _, items in sink.calls for k, _ in items] == [b"first", b"a", b"c"]


def test_unconfirmed_deletes_are_retried_until_the_cluster_confirms_them():
    unlink = Unlinker()
    w = WriteBehind(Sink(), max_bytes=1 << 20, unlink=unlink, tombstones=3)
    lid = b"L" * 16
    w.forget(lid, [b"a", b"b", b"c", b"d"])     # d: past the bound, counted, not kept
    assert w.pending() == 3 and w.counters.deletes_dropped == 1
    assert w.counters.deletes_pending == 3
    wait_for(lambda: len(unlink.calls) >= 2, "two rounds of retries", timeout=5)
    assert w.pending() == 3                     # still unconfirmed
    w.offer(lid, b"c", b"page")                 # put again: the new page is the right one
    assert w.pending() == 2
    unlink.answering = True
    wait_for(lambda: w.pending() == 0, "the retries to be confirmed", timeout=5)
    assert w.counters.deletes_retried >= 6 and w.counters.deletes_pending == 0
    w.close()
