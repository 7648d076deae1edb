"""FarTier: the far tier in the shape of the storage engine's tier interface.

The engine sees every level below DRAM through one interface (offer a page, say which
keys are held, read pages into the caller's buffers, delete, evict, flush, close), so
DRAM -> disk -> far is a chain of one interface. This adapter maps it onto the far
tier's parts:

    offer(layout, key, page)     -> WriteBehind.offer: a copy queued, never waits;
                                    refused under --far-write off only
    contains(layout, keys)       -> FarClient.exists: one round trip per shard, within
                                    --far-timeout; what it cannot learn in time is a miss;
                                    what it finds is watched (watch.py)
    read_into(layout, keys, outs)-> FarClient.read in parts of about 1 MiB, several in
                                    flight (reads.py), each verified page copied into its
                                    out buffer from glide's reply as its part lands
    delete(layout, keys)         -> queued writes of the keys dropped, tombstones made,
                                    FarClient.unlink within --far-timeout; what the
                                    cluster did not confirm is retried (writer.py)
    evict(layout / everything)   -> FarClient.clear: this namespace's keys only, within
                                    CLEAR_BUDGET; one that did not finish is retried in
                                    the background and fails the admin's call with what
                                    it did and did not remove. A byte amount is the
                                    cluster's own eviction's business
    invalidate(scope, known)     -> the layouts of the scope, this server's and those
                                    the cluster's layout records name (records.py),
                                    cleared in one pass, as evict; the records are
                                    written beside the pages by the writer
    describe(layout, key)        -> one EXISTS (admin Inspect only)
    levels()                     -> one TierStats "far" from the client's counters
    register_metrics(registry)   -> its capacity, use and pages (tier_metrics.py) and
                                    kvstore_far_* (metrics.py)
    flush(timeout) / close()     -> the write-behind queue's, then glide's
    watch                        -> the pages only this tier holds for this server,
                                    checked so that what the cluster removes by itself
                                    (--far-ttl, maxmemory) reaches the removal ring
                                    within watch.DELAY s (watch.py)

Every method answers; none raises on the cluster's behalf (misses, False, 0), but for
an admin's evict that did not reach the whole cluster: the operator must learn that.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..errors import Outcome, StoreError
from ..scope import Scope
from ..tier import PageInfo, Tier, TierInvalidation, TierName, TierStats
from ..tier_metrics import TierGauges
from .breaker import BreakerState
from .client import CLEAR_BUDGET, FarClient
from .codec import ValueVerdict
from .metrics import FarCollector
from .reads import ParallelReader
from .records import REFRESH, LayoutRecord
from .settings import WritePolicy
from .watch import FarWatch
from .writer import WriteBehind

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

__all__ = ["CLOSE_TIMEOUT", "PROBE_CHUNK", "FarTier"]

log = logging.getLogger("kvstore.far")

# Keys one contains() may ask about: the store asks the tier below about a lookup's gaps
# in chunks of this many (store.py). The disk tier's probe costs a dict lookup a key and
# stops at the first chunk with a gap; a far probe costs a round trip per shard whatever
# its size, so a lookup's gaps go in one call (a request holds at most 64 Ki keys).
PROBE_CHUNK = 1 << 16

# How long close() waits for the write-behind queue to drain before dropping the rest:
# a stop must end; what is not written is a later miss, never a loss of this host's data.
CLOSE_TIMEOUT = 5.0


class FarTier:
    """A Valkey/Redis Cluster below the disk tier; a cache that may forget any page."""

    name = TierName.FAR
    holds_pages = True
    probe_chunk = PROBE_CHUNK

    def __init__(self, client: FarClient, writer: WriteBehind | None = None) -> None:
        self.client = client
        self.writes = client.settings.write is not WritePolicy.OFF
        # The record of a layout id (records.py), or None: the store's, once wired (wiring.py)
        self.record_of: Callable[[bytes], LayoutRecord | None] = lambda layout_id: None
        self._recorded: dict[bytes, float] = {}     # layout id -> monotonic time written
        self._recorded_lock = threading.Lock()
        self.writer = writer or WriteBehind(
            self._put, client.settings.queue_bytes, client.counters,
            unlink=lambda layout_id, keys: client.unlink(layout_id, keys)[1],
            clear=lambda layout_id: client.clear(layout_id, retry=True).complete)
        self.reader = ParallelReader(client.read, client.settings.timeout)
        settings = client.settings
        self.watch = FarWatch(client.exists_answered, self.writer.unwritten,
                              capacity=settings.watch_pages, per_round=settings.watch_round,
                              interval=settings.watch_interval)

    @property
    def tiers(self) -> tuple[Tier, ...]:
        return (self,)

    def link(self, below: Tier) -> None:
        pass                        # the bottom tier: what the cluster evicts is gone

    def _put(self, layout_id: bytes, items) -> int:
        """The writer's put: the pages, and the layout's record when it is due."""
        now = time.monotonic()
        with self._recorded_lock:
            due = now - self._recorded.get(layout_id, -REFRESH) >= REFRESH
            if due:
                self._recorded[layout_id] = now
        record = self.record_of(layout_id) if due else None
        stored, recorded = self.client.put_with_record(
            layout_id, items, None if record is None else record.encode())
        if record is not None and not recorded:
            with self._recorded_lock:
                self._recorded.pop(layout_id, None)     # tried again with the next batch
        return stored

    def offer(self, layout_id: bytes, key: bytes, page) -> bool:
        # Taken whatever the breakers say: the writer's calls are what probes a cluster
        # that came back, on a host that only puts (a prefill host writing through). When
        # open breakers turned pages away here, only a read could probe, and such a host
        # wrote none of the pages put after the cluster came back. A batch that
        # meets an open breaker is not sent (counted as skipped), the queue bounds the rest.
        # Offers come from the tiers above letting the page go (DRAM's eviction, the
        # disk's): from now on only this tier holds it for this server, so it is watched
        # (watch.py). A commit's write-through offer comes through through_offer instead.
        if not self.through_offer(layout_id, key, page):
            return False
        self.watch.add(layout_id, [key])
        return True

    def through_offer(self, layout_id: bytes, key: bytes, page) -> bool:
        """A copy of a page that stays in DRAM (--far-write through, at commit)."""
        if not self.writes:
            return False
        return self.writer.offer(layout_id, key, page)

    def contains(self, layout_id: bytes, keys: Sequence[bytes]) -> np.ndarray:
        held = np.array(self.client.exists(layout_id, keys), dtype=bool)
        if held.any():          # held for this server by this tier only: watched
            self.watch.add(layout_id, [keys[i] for i in np.flatnonzero(held).tolist()])
        return held

    def read_into(self, layout_id: bytes, keys: Sequence[bytes],
                  outs: Sequence) -> list[bool]:
        got = [False] * len(keys)
        views = [memoryview(out).cast("B") for out in outs]

        def land(i: int, page) -> None:
            if page is None:
                return
            if page.nbytes != views[i].nbytes:   # same layout, other size: not this page
                self.client.counters.reject(ValueVerdict.TRUNCATED)
                return
            views[i][:] = page
            got[i] = True

        self.reader.read(layout_id, keys, [v.nbytes for v in views], land)
        return got

    def delete(self, layout_id: bytes, keys: Sequence[bytes]) -> int:
        """Gone for good: queued writes of the keys dropped, UNLINK within --far-timeout
        (it is on a request's path), and what the cluster did not confirm, or may see a
        write of land after it, retried by the writer until it does (writer.py). Returns
        how many the cluster said it held."""
        keys = list(dict.fromkeys(keys))
        if not keys:
            return 0
        self.watch.forget(layout_id, keys)      # the store records the delete
        generation, writing = self.writer.forget(layout_id, keys)
        held, unconfirmed = self.client.unlink(layout_id, keys, self.client.settings.timeout)
        skip = writing.union(unconfirmed)
        self.writer.settle(layout_id, [k for k in keys if k not in skip], generation)
        return held

    def describe(self, layout_id: bytes, key: bytes) -> PageInfo | None:
        """Held or not (one EXISTS); its size is not asked for: that would fetch it."""
        if not self.client.exists(layout_id, [key])[0]:
            return None
        return PageInfo(self.name, "HELD", 0)

    def state(self) -> str:
        """What admin stats shows: reachable, or what the breakers say."""
        state = self.client.breaker.state
        held_back, masters = self.client.breaker.open_shards()
        if state is BreakerState.CLOSED and held_back:
            return f"{held_back} of {masters} shards unreachable"
        return {BreakerState.CLOSED: "reachable", BreakerState.OPEN: "breaker open",
                BreakerState.HALF_OPEN: "probing"}[state]

    def levels(self) -> tuple[TierStats, ...]:
        c = self.client.counters
        state = self.state()
        return (TierStats(self.name, reads=c.pages_read, bytes_read=c.bytes_read,
                          writes=c.pages_written, bytes_written=c.bytes_written,
                          drops=c.drops, refused=c.skipped,
                          corrupt_pages=sum(c.rejected.values()), read_errors=c.errors,
                          error="" if state == "reachable" else state),)

    def register_metrics(self, registry: CollectorRegistry) -> None:
        registry.register(TierGauges(self.levels))
        registry.register(FarCollector(self.client.counters, self.writer.depth,
                                       lambda: self.client.breaker.state,
                                       lambda: (len(self.watch), self.watch.reported)))

    def evict(self, *, nbytes: int | None = None, layout_id: bytes | None = None,
              everything: bool = False) -> tuple[int, int]:
        """A layout's pages, or all of this namespace's: (pages, 0) — the cluster does not
        say how many bytes UNLINK freed. A byte amount alone evicts nothing: the
        cluster's maxmemory policy decides that. Raises StoreError(UNFINISHED) when the
        clear did not finish on every master within CLEAR_BUDGET (one hangs, the cluster
        is down, too many keys): it goes on in the background until it does."""
        if layout_id is None and not everything:
            return 0, 0
        target = None if everything else layout_id
        self.watch.forget_layout(target)        # the store records the eviction
        # Pages still queued would land after the clear: they are dropped, not sent first
        # (sending them waited up to 5 s behind a hung master, past kvstore-admin's own
        # deadline), and the batch being written is cleared again once it has landed.
        self.writer.forget_all(target)
        result = self.client.clear(target)
        if not result.complete:
            self.writer.clear_later(target)
            raise StoreError(
                Outcome.UNFINISHED,
                f"far tier: removed {result.removed} pages, but the clear did not finish "
                f"on {', '.join(result.unfinished)} within {CLEAR_BUDGET:g}s (unreachable, "
                f"or more keys than that allows): the rest is removed in the background, "
                f"retried until the cluster confirms it (kvstore_far_deletes_pending)")
        return result.removed, 0

    def invalidate(self, scope: Scope, known: Sequence[bytes]) -> TierInvalidation:
        """Remove the pages of every layout of the scope in the whole cluster: `known`
        (this server's layouts of the scope) and those the cluster's records name. The
        records are read and the layouts cleared within half of CLEAR_BUDGET each; what was not
        finished is retried in the background (as evict's clear) and named in
        `failure`, as is a scan of the records that did not reach every master (layouts
        only that master's records name may then be missed: invalidate again)."""
        # Half the budget each, so the whole answers within CLEAR_BUDGET as a clear does
        # (kvstore-admin waits 5 s by default)
        half = CLEAR_BUDGET / 2
        values, unread = self.client.records(half)
        found = [r for r in map(LayoutRecord.decode, values) if r is not None]
        ids = tuple(dict.fromkeys([*known, *(r.layout_id for r in found
                                             if scope.matches(r))]))
        with self._recorded_lock:
            for layout_id in ids:               # written again with the next page
                self._recorded.pop(layout_id, None)
        for layout_id in ids:
            self.writer.forget_all(layout_id)
            self.watch.forget_layout(layout_id)     # the store records the invalidation
        result = self.client.clear_layouts(ids, half)
        failure = []
        if unread:
            failure.append(f"the layout records could not be read on {', '.join(unread)} "
                           f"within {half:g}s: layouts only they name were not "
                           f"found (invalidate again once the cluster is whole)")
        if not result.complete:
            for layout_id in ids:
                self.writer.clear_later(layout_id)
            failure.append(f"the clear did not finish on {', '.join(result.unfinished)} "
                           f"within {half:g}s: the rest is removed in the "
                           f"background, retried until the cluster confirms it "
                           f"(kvstore_far_deletes_pending)")
        return TierInvalidation(ids, result.removed, "; ".join(failure))

    def flush(self, timeout: float) -> int:
        self.writer.flush(timeout)
        return self.writer.depth()[0]

    def close(self) -> None:
        """Write what is queued for at most CLOSE_TIMEOUT s, then drop glide's client."""
        self.watch.close()
        left = self.writer.depth()[0]
        self.writer.close(CLOSE_TIMEOUT)
        self.reader.close()
        if self.writer.depth()[0]:
            log.warning("far tier: %d of %d queued pages not written at stop",
                        self.writer.depth()[0], left)
        self.client.close()
