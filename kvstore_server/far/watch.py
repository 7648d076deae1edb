"""FarWatch: the pages only the far tier holds for this server, checked so that what the
cluster removes by itself reaches the removal ring (kvstore_server.removals).

A page this server answers for ("the store holds it": a lookup here would hit, in DRAM,
on disk or in the far tier) and that lives only in the far tier can leave without any
call of ours: its --far-ttl expires, the cluster's maxmemory policy evicts it, the write
behind dropped or failed it, another server of the fleet deleted or invalidated it. Each
of these turns a hit into a miss here, so a router must hear of it (an EVICTED entry),
or it keeps sending requests for a prefix that is gone. Hence:

    a page leaves this server's DRAM and disk into the far tier (FarTier.offer, from an
        eviction; a commit's write-through offer is not watched: the page stays in DRAM),
        or a lookup or Exists here finds it in the far tier only (FarTier.contains: an
        engine may announce it from that answer)
        ──► watched: (layout, key), newest last, at most `capacity`
    every `interval` s, one round on the watch thread: the `per_round` pages checked
    longest ago (new pages after all the others)
        ├─ still queued or being written (writer.unwritten)          ──► kept
        ├─ back in DRAM or on disk (read back from the far tier)      ──► not watched:
        │      held above; watched again when that tier lets it go
        ├─ EXISTS (one round trip per shard): held                    ──► kept, last
        ├─ not answered in time (a master slow or down, breaker open) ──► kept, last
        └─ answered "no such key"                                     ──► ring: EVICTED
    past `capacity`, the page watched longest (added first, whatever the rounds did with
        it since) stops being watched: at the next round it is reported EVICTED unless
        DRAM or disk holds it (a router under-estimates, never over-)

So a far-only page's removal by the cluster reaches the ring within
capacity / per_round rounds plus one: DELAY seconds with the defaults (5 s), then the
connector's event feed within its poll interval. Deletes, admin evictions and
invalidations made through this server are recorded by the store when made; they stop
the watch of those pages (forget) so nothing is reported twice.

Why a check and not the cluster's keyspace notifications (`notify-keyspace-events Ex`/
`e`): each node sends only its own (a subscriber per master, followed through failovers
and slot moves: glide's Pub/Sub subscribes a client, not a node), they need a setting the
operator may not allow, and Pub/Sub delivers at most once (a reconnect loses what fell in
between), so a check would be needed behind them anyway. The check needs nothing from
the operator and costs the cluster at most `per_round` EXISTS a round per server.

A far tier slow or down: the round's calls end at CHECK_TIMEOUT, unanswered pages wait
for the next round, nothing is reported for them (the cluster most likely still holds
them when it answers again) and no request waits on a round. Memory: `capacity` entries
(~200 bytes each, 13 MiB at the default) and a queue of overflow bounded by `per_round`.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Sequence

import numpy as np

from ..removals import Cause, RemovalRing

__all__ = ["CAPACITY", "CHECK_TIMEOUT", "DELAY", "INTERVAL", "PER_ROUND", "FarWatch"]

log = logging.getLogger("kvstore.far")

# The defaults of --far-watch-pages, --far-watch-round and --far-watch-interval
# (settings.py), each server's own.
CAPACITY = 1 << 16          # far-only pages watched (past it: reported, under-estimate)
PER_ROUND = 1 << 14         # pages one round checks at most (one EXISTS each)
INTERVAL = 1.0              # seconds between two rounds
CHECK_TIMEOUT = 1.0         # deadline of one round's EXISTS call (off every request's path)
# The most a far-only page's removal by the cluster waits for its ring entry.
DELAY = INTERVAL * (-(-CAPACITY // PER_ROUND) + 1)

# (layout_id, keys, timeout) -> (held, answered) per key; FarClient.exists_answered fits.
ExistsFn = Callable[[bytes, list[bytes], float], tuple[list[bool], list[bool]]]
# (layout_id, keys) -> held in DRAM or on disk, per key (wiring.py).
HeldFn = Callable[[bytes, Sequence[bytes]], np.ndarray]

_Page = tuple[bytes, bytes]     # (layout_id, key)


def _nowhere(layout_id: bytes, keys: Sequence[bytes]) -> np.ndarray:
    return np.zeros(len(keys), dtype=bool)


class FarWatch:
    """add() far-only pages; a daemon thread checks them and records what left."""

    def __init__(self, exists: ExistsFn, unwritten: Callable[[], set[_Page]], *,
                 capacity: int = CAPACITY, per_round: int = PER_ROUND,
                 interval: float = INTERVAL) -> None:
        self._exists = exists
        self._unwritten = unwritten
        self.capacity = capacity
        self.per_round = per_round
        self.interval = interval
        # Set once the store is built (wiring.py); until then nothing is recorded.
        self.removals: RemovalRing | None = None
        self.held_above: HeldFn = _nowhere
        self._lock = threading.Condition()      # guards the fields below
        # Two orders of the same pages. A round checks the pages longest unchecked and
        # puts the ones it keeps last in _pages; the capacity drops the page longest
        # watched, first in _age. One order for both would let a round's rotation decide
        # which page the capacity drops: a page added a moment ago could go before one
        # watched for an hour. _age also holds the pages of a round in flight, so a page
        # forgotten or dropped meanwhile is not put back when its round ends.
        self._pages: collections.OrderedDict[_Page, None] = collections.OrderedDict()
        self._age: collections.OrderedDict[_Page, None] = collections.OrderedDict()
        self._overflow: collections.deque[_Page] = collections.deque()
        self._closed = False
        self.reported = 0                       # pages recorded as gone (tests, stats)
        self.rounds = 0
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the rounds (once the store is wired: removals and held_above set)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvstore-far-watch",
                                            daemon=True)
            self._thread.start()

    def __len__(self) -> int:
        with self._lock:
            return len(self._age) + len(self._overflow)

    # -- the store's threads (under its lock: only dict and deque work here) ---------
    def add(self, layout_id: bytes, keys: Sequence[bytes]) -> None:
        """Pages now held for this server only by the far tier."""
        spilled: list[_Page] = []
        with self._lock:
            for key in keys:
                page = (layout_id, key)
                self._pages[page] = None
                self._pages.move_to_end(page)
                self._age[page] = None
                self._age.move_to_end(page)
            while len(self._age) > self.capacity:
                oldest = self._age.popitem(last=False)[0]
                self._pages.pop(oldest, None)
                self._overflow.append(oldest)
            while len(self._overflow) > self.per_round:    # a flood: reported unchecked
                spilled.append(self._overflow.popleft())
        for lid, k in spilled:
            self._record(lid, [k])

    def forget(self, layout_id: bytes, keys: Sequence[bytes]) -> None:
        """Pages deleted through this server (the store records their removal)."""
        with self._lock:
            for key in keys:
                self._pages.pop((layout_id, key), None)
                self._age.pop((layout_id, key), None)

    def forget_layout(self, layout_id: bytes | None) -> None:
        """A layout's pages (None: all) cleared or invalidated (recorded by the store)."""
        with self._lock:
            if layout_id is None:
                self._pages.clear()
                self._age.clear()
                self._overflow.clear()
                return
            for page in [p for p in self._age if p[0] == layout_id]:
                del self._age[page]
                self._pages.pop(page, None)
            self._overflow = collections.deque(p for p in self._overflow
                                               if p[0] != layout_id)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=CHECK_TIMEOUT + self.interval + 1.0)

    # -- the watch thread -------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                self._lock.wait(self.interval)
                if self._closed:
                    return
            try:
                self.check()
            except Exception:           # the server must outlive its watch
                log.exception("far tier: a check of far-only pages failed; next round in "
                              "%.1f s", self.interval)

    def check(self) -> int:
        """One round; returns how many pages it recorded as gone."""
        with self._lock:
            overflow, self._overflow = list(self._overflow), collections.deque()
            n = min(self.per_round, len(self._pages))
            batch = [self._pages.popitem(last=False)[0] for _ in range(n)]
        gone = 0
        for layout_id, keys in _by_layout(overflow).items():
            above = self.held_above(layout_id, keys)
            gone += self._record(layout_id, [k for k, up in zip(keys, above.tolist(),
                                                                strict=True) if not up])
        unwritten = self._unwritten() if batch else set()
        keep: set[_Page] = {p for p in batch if p in unwritten}
        found_gone: set[_Page] = set()
        for layout_id, keys in _by_layout([p for p in batch if p not in unwritten]).items():
            above = self.held_above(layout_id, keys)
            asked = [k for k, up in zip(keys, above.tolist(), strict=True) if not up]
            if not asked:
                continue
            held, answered = self._exists(layout_id, asked, CHECK_TIMEOUT)
            keep.update((layout_id, k) for k, h, a in zip(asked, held, answered, strict=True)
                        if h or not a)
            lost = [k for k, h, a in zip(asked, held, answered, strict=True) if a and not h]
            found_gone.update((layout_id, k) for k in lost)
            gone += self._record(layout_id, lost)
        with self._lock:
            for page in batch:
                if page in self._pages or page not in self._age:
                    continue            # added again meanwhile, or forgotten or dropped
                if page in keep:        # behind what was added meanwhile
                    self._pages[page] = None
                else:                   # gone, or held in DRAM or on disk again
                    del self._age[page]
            if found_gone and self._overflow:   # dropped meanwhile: reported once only
                self._overflow = collections.deque(p for p in self._overflow
                                                   if p not in found_gone)
            self.rounds += 1
            self._lock.notify_all()
        return gone

    def _record(self, layout_id: bytes, keys: list[bytes]) -> int:
        if keys and self.removals is not None:
            self.removals.record(layout_id, keys, Cause.EVICTED)
            self.reported += len(keys)
        return len(keys)


def _by_layout(pages: Sequence[_Page]) -> dict[bytes, list[bytes]]:
    out: dict[bytes, list[bytes]] = {}
    for layout_id, key in pages:
        out.setdefault(layout_id, []).append(key)
    return out
