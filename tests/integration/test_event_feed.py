"""The connector's KV-event feed (connector.events) against a real server: pages are
announced once the store holds them and not if they left first; a ring that overwrote
what the feed had not read, or a restarted server, makes it announce every page removed;
it remembers at most max_tracked pages; a run waiting for the poll keeps nothing the
garbage collector walks, and is announced as it was handed over."""

from __future__ import annotations

import gc

import numpy as np

from connector.events import EventFeed, Removed, SavedRun, Stored
from kvstore_client import KVStoreClient, PageLayout

LAYOUT = PageLayout(model="feed", num_layers=2, page_tokens=16, num_kv_heads=4, head_size=16,
                    dtype="float32")


def keys(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode().ljust(16, b"_") for i in range(n)]


def run_of(ks: list[bytes]) -> SavedRun:
    """Page i's block hash is 100 + i; its tokens 16 * i ... 16 * i + 15."""
    return SavedRun(tuple(ks), tuple(100 + i for i in range(len(ks))),
                    tuple(range(16 * len(ks))), blocks_per_page=1, page_tokens=16)


def put(c: KVStoreClient, ks: list[bytes]) -> None:
    ns = c.register_layout(LAYOUT)
    c.put(ns, ks, np.zeros((len(ks), ns.page_bytes), dtype=np.uint8))


def events(feed: EventFeed) -> list[Stored | Removed]:
    feed.poll_now()
    return feed.take()


def test_announced_when_held_and_not_when_gone_first(fresh_server):
    srv = fresh_server(dram="16MiB")
    with KVStoreClient(srv.address, shared_memory=False) as c:
        feed = EventFeed(c, [LAYOUT], interval=30)
        try:
            held, gone = keys("h", 3), keys("g", 2)
            put(c, held + gone)
            feed.poll_now()
            c.delete(c.register_layout(LAYOUT), gone)
            feed.saved(run_of(held))
            feed.saved(run_of(gone))
            got = events(feed)
            assert got == [Stored((100, 101, 102), None, tuple(range(48)))]
            c.delete(c.register_layout(LAYOUT), held[1:])
            assert events(feed) == [Removed((101, 102))]
            assert (feed.counts.stored, feed.counts.removed) == (3, 2)
        finally:
            feed.close()


def test_a_gap_or_a_restart_announces_every_page_removed(fresh_server):
    srv = fresh_server(dram="16MiB", removal_ring=4)
    with KVStoreClient(srv.address, shared_memory=False, retries=0) as c:
        feed = EventFeed(c, [LAYOUT], interval=30)
        try:
            ours = keys("o", 3)
            put(c, ours)
            feed.poll_now()
            feed.saved(run_of(ours))
            assert [type(e) for e in events(feed)] == [Stored]
            other = keys("x", 10)                   # not ours, but they overrun the ring
            put(c, other)
            c.delete(c.register_layout(LAYOUT), other)
            assert events(feed) == [Removed((100, 101, 102))]
            assert feed.counts.gaps == 1
            put(c, ours)
            feed.saved(run_of(ours))
            assert [type(e) for e in events(feed)] == [Stored]
            srv.stop()
            srv.start()                             # its pages and its ring are gone
            assert events(feed) == [Removed((100, 101, 102))]
            assert feed.counts.gaps == 2
        finally:
            feed.close()


def test_at_most_max_tracked_pages_are_remembered(fresh_server):
    srv = fresh_server(dram="16MiB")
    with KVStoreClient(srv.address, shared_memory=False) as c:
        feed = EventFeed(c, [LAYOUT], interval=30, max_tracked=2)
        try:
            ks = keys("t", 4)
            put(c, ks)
            feed.poll_now()
            feed.saved(run_of(ks))
            assert events(feed) == [Stored((100, 101, 102, 103), None, tuple(range(64))),
                                    Removed((100, 101))]
            assert feed.counts.forgotten == 2
        finally:
            feed.close()


def test_a_waiting_run_keeps_nothing_the_gc_walks_and_is_announced_as_handed_over(
        fresh_server):
    """As the vLLM adapter hands a run over (its keys' list, vLLM's list of bytes block
    hashes, the scheduler half's int32 token ids): while it waits for the poll, the feed
    holds no container the GC walks (the engine's lists would make every collection on
    its loop walk them); the Stored event has the same hashes and the ids as ints."""
    srv = fresh_server(dram="16MiB")
    with KVStoreClient(srv.address, shared_memory=False) as c:
        feed = EventFeed(c, [LAYOUT], interval=30)
        try:
            ks = keys("t", 4)
            put(c, ks)
            feed.poll_now()
            hashes = [bytes([i]) * 32 for i in range(8)]            # two blocks a page
            tokens = np.arange(1000, 1000 + 64 + 5, dtype=np.int32)
            feed.saved(SavedRun(list(ks), list(hashes), tokens, blocks_per_page=2,
                                page_tokens=16))
            queued = [o for o in gc.get_referents(*feed._runs) if not isinstance(o, type)]
            assert queued and [o for o in queued if gc.is_tracked(o)] == []
            got = events(feed)
            assert got == [Stored(tuple(hashes), None, tuple(range(1000, 1064)))]
            assert all(type(t) is int for t in got[0].tokens)
            assert all(type(h) is bytes for h in got[0].hashes)
            # Hashes that are not bytes of one width are kept as given.
            more = keys("u", 1)
            put(c, more)
            odd = (b"x" * 32, b"y" * 16)
            feed.saved(SavedRun(list(more), odd, tokens[:16].tolist(), blocks_per_page=2,
                                page_tokens=16))
            assert events(feed) == [Stored(odd, None, tuple(range(1000, 1016)))]
        finally:
            feed.close()
