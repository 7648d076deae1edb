"""What an operator asks of the store as a whole: evict, clear, spill at stop, inspect, stats.

Admin works over the store's shared state (StoreState) and its parts (eviction, the lease
book, retention, the tier below): these are bulk operations over the same slots, apart
from the per-request lifecycle. Each takes the store's lock a batch of pages at a time
(ADMIN_BATCH), so requests interleave with them.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from kvstore_protocol.keys import MAX_KEY_BYTES, Packed

from ..errors import Outcome, Reason, StoreError
from ..far.records import LayoutRecord
from ..removals import Cause
from ..scope import Scope
from ..tier import PageInfo, TierName, evict_targets
from .below import Below
from .evict import Eviction
from .eviction import enough
from .layouts import LayoutInfo
from .lease_book import LeaseBook
from .sessions import Retention
from .slots import SlotState
from .state import StoreState
from .stats import LayoutStats, StoreStats, TenantStats

__all__ = ["ADMIN_BATCH", "Admin", "Invalidation"]

# Pages an admin eviction or clear handles a lock hold: each page evicted is offered to
# the disk tier (a copy into the write queue), so a hold grows with the batch; this many
# keep one in milliseconds.
ADMIN_BATCH = 256


@dataclasses.dataclass(frozen=True, slots=True)
class Invalidation:
    """What one invalidation removed, per tier, and what kept it from being whole."""

    layout_ids: tuple[bytes, ...]   # of the scope: this server's and the cluster's
    dram_pages: int
    disk_pages: int
    far_pages: int                  # of the whole fleet
    failure: str = ""               # "" when every tier was reached and finished


class Admin:
    """The store's admin operations; no state of its own."""

    def __init__(self, state: StoreState, eviction: Eviction, book: LeaseBook,
                 retention: Retention, below: Below) -> None:
        self._s = state
        self._eviction = eviction
        self._book = book
        self._retention = retention
        self._below = below

    def _layouts(self) -> list[LayoutInfo]:
        return list(self._s.layouts.by_idx)

    def evict(self, *, layout_id: bytes | None = None, nbytes: int | None = None,
              everything: bool = False, tier: str = "dram") -> tuple[int, int, int]:
        """Admin eviction from tier "dram" (to the tiers below), "disk" or "far" (gone;
        the far tier only this server's namespace, and never by a byte amount), or "all":
        (pages, bytes, pages skipped because leased)."""
        try:
            targets = evict_targets(tier)
        except ValueError as exc:
            raise StoreError(Outcome.INVALID, str(exc)) from None
        pages = freed = leased = 0
        whole = False                   # a whole layout, or all, left the tiers below
        if TierName.DRAM in targets:
            pages, freed, leased = self._evict_dram(layout_id, nbytes)
        if layout_id is not None and targets != {TierName.DRAM}:
            self._s.layouts.info(layout_id)
        # The chain's tiers one by one: `--tier disk` must never reach a shared cluster.
        for below in self._s.lower.tiers:
            if not below.holds_pages or below.name not in targets:
                continue
            more, more_bytes = below.evict(nbytes=nbytes, layout_id=layout_id,
                                           everything=nbytes is None and layout_id is None)
            pages, freed = pages + more, freed + more_bytes
            whole = nbytes is None      # a byte amount: the disk tier records its victims
        if whole:
            for lid in ([layout_id] if layout_id is not None
                        else [i.layout_id for i in self._layouts()]):
                self._s.removals.record_layout(lid, Cause.EVICTED)
        return pages, freed, leased

    def _evict_dram(self, layout_id: bytes | None, nbytes: int | None) -> tuple[int, int, int]:
        with self._s.lock:
            n = self._s.pool.id_capacity
            live = self._s.slots.state[:n] == SlotState.READY
            idx = None if layout_id is None else self._s.layouts.info(layout_id).idx
            if idx is not None:
                live &= self._s.slots.layout_of[:n] == idx
            leased = int(np.count_nonzero(live & (self._s.slots.pins[:n] > 0)))
            eligible = live & (self._s.slots.pins[:n] == 0)
            if nbytes is not None:
                victims = self._s.policy.victims(int(np.count_nonzero(eligible)), eligible)
                victims = victims[: enough(self._eviction.slot_bytes(victims), nbytes)]
            else:
                victims = np.flatnonzero(eligible)
        # A batch a lock hold, as the evictor does: evicting 65,536 pages in one hold (each
        # offered to the disk tier) held the lock for seconds. A victim leased or freed since it
        # was chosen is passed over; one whose slot went to another page meanwhile is
        # evicted in its place (of its layout, if one was named): the same to a cache.
        pages = freed = 0
        for start in range(0, len(victims), ADMIN_BATCH):
            with self._s.lock:
                chunk = victims[start:start + ADMIN_BATCH]
                ok = (self._s.slots.state[chunk] == SlotState.READY) & (self._s.slots.pins[chunk] == 0)
                if idx is not None:
                    ok &= self._s.slots.layout_of[chunk] == idx
                chunk = chunk[ok]
                freed += self._eviction.evict(chunk)
                pages += len(chunk)
        return pages, freed, leased

    def clear(self) -> tuple[int, int]:
        """Delete every page of every layout, in every tier (leased ones when released);
        a batch of pages a lock hold, as admin eviction."""
        pages = touched = 0
        for info in self._layouts():
            dropped, held = self._drop_layout(info)
            pages, touched = pages + dropped, touched + held
        if self._s.lower.holds_pages:
            pages += self._s.lower.evict(everything=True)[0]
        for info in self._layouts():
            self._s.removals.record_layout(info.layout_id, Cause.DELETED)
        return pages, touched

    def _drop_layout(self, info: LayoutInfo) -> tuple[int, bool]:
        """Delete every DRAM page of one layout, never spilled below (leased ones when
        released): (pages, whether it held any, those being written included)."""
        pages = 0
        with self._s.lock:
            n = self._s.pool.id_capacity
            mine = np.flatnonzero((self._s.slots.layout_of[:n] == info.idx)
                                  & (self._s.slots.state[:n] == SlotState.READY))
            writing = np.array(list(info.writing.values()), dtype=np.int64)
            info.writing.clear()
            self._eviction.drop(writing)
        for start in range(0, len(mine), ADMIN_BATCH):
            with self._s.lock:
                chunk = mine[start:start + ADMIN_BATCH]
                chunk = chunk[(self._s.slots.state[chunk] == SlotState.READY)
                              & (self._s.slots.layout_of[chunk] == info.idx)]
                for size, index in info.ready.items():
                    index.remove_slots(chunk[self._s.slots.key_size[chunk] == size])
                self._eviction.drop(chunk)
                pages += len(chunk)
        return pages, bool(mine.size or writing.size)

    def invalidate(self, scope: Scope) -> Invalidation:
        """Delete every page of the scope's layouts from DRAM, disk and the far tier (of
        the whole fleet there: far/records.py says how its layouts are found). Every
        tier is asked whatever another answered; `failure` says which could not be
        reached or did not finish (the far tier goes on in the background)."""
        mine = [i for i in self._layouts()
                if scope.matches(LayoutRecord.of(i.layout_id, i.tenant, i.layout))]
        dram = sum(self._drop_layout(info)[0] for info in mine)
        ids = [i.layout_id for i in mine]
        disk = far = 0
        failures: list[str] = []
        # Bottom first (the far tier): the layouts its records name are the disk's too.
        for below in reversed([t for t in self._s.lower.tiers if t.holds_pages]):
            result = below.invalidate(scope, ids)
            ids += [i for i in result.layout_ids if i not in ids]
            if below.name is TierName.FAR:
                far += result.removed
            else:
                disk += result.removed
            if result.failure:
                failures.append(f"{below.name} tier: {result.failure}")
        # Recorded whatever failed: a removal reported for a page still held costs a
        # router a miss, one not reported sends it requests for pages gone (removals.py).
        for layout_id in ids:
            self._s.removals.record_layout(layout_id, Cause.INVALIDATED)
        return Invalidation(tuple(ids), dram, disk, far, "; ".join(failures))

    def spill_all(self, timeout: float) -> tuple[int, int]:
        """Write every DRAM page to the tier below, for a graceful stop: (pages offered,
        pages left unwritten when the time ran out). The tier's queue is bounded, so this
        offers until it is full, waits for the writer, and goes on."""
        if not self._s.lower.holds_pages:
            return 0, 0
        deadline = time.monotonic() + timeout
        with self._s.lock:
            n = self._s.pool.id_capacity
            slots = np.flatnonzero(self._s.slots.state[:n] == SlotState.READY)
            todo = []
            for idx, key_size, members in self._s.slots.groups(slots):
                info = self._s.layouts.by_idx[idx]
                keys = info.ready[key_size].keys_of(members)
                todo += [(info, k.tobytes(), int(self._s.pool.offset[m]))
                         for k, m in zip(keys, members.tolist(), strict=True)]
            # The pages stay pinned while offered: no request may reuse their slots.
            self._s.slots.add_pins(slots, 1)
        offered = 0
        try:
            for info, key, off in todo:
                page = self._s.mem[off:off + info.page_bytes]
                # A tier that refuses with its queue empty will not take the page later
                # (failed, read only, breaker open): give up rather than wait out the time.
                drained = False
                while not self._s.lower.offer(info.layout_id, key, page):
                    if (drained or any(t.failed for t in self._s.lower.levels())
                            or time.monotonic() > deadline):
                        return offered, len(todo) - offered
                    drained = self._s.lower.flush(
                        min(1.0, max(0.0, deadline - time.monotonic()))) == 0
                offered += 1
            left = self._s.lower.flush(max(0.0, deadline - time.monotonic()))
            return offered, left
        finally:
            with self._s.lock:
                self._book.unpin(slots)

    # -- introspection ----------------------------------------------------------------
    def inspect(self, layout_id: bytes, key: bytes) -> PageInfo:
        if not 1 <= len(key) <= MAX_KEY_BYTES:
            raise StoreError(Outcome.INVALID, f"a key is 1 to {MAX_KEY_BYTES} bytes, got "
                                              f"{len(key)}")
        with self._s.lock:
            info = self._s.layouts.info(layout_id)
            index = info.ready.get(len(key))
            slot = int(index.find(Packed(key, len(key)).rows)[0]) if index is not None else -1
            if slot < 0:
                slot = info.writing.get(key, -1)
            if slot < 0:
                below = self._s.lower.describe(layout_id, key)
                if below is not None:
                    return below
                raise StoreError(Outcome.NOT_FOUND, f"key {key.hex()} is not stored in "
                                 f"layout {layout_id.hex()}", reason=Reason.PAGES_MISSING)
            now = self._s.clock() - self._s.started_at
            state = SlotState(int(self._s.slots.state[slot]))
            ready = state is SlotState.READY
            return PageInfo(
                TierName.DRAM, state.name, info.page_bytes,
                age_seconds=float(now - self._s.slots.committed_at[slot]) if ready else 0.0,
                idle_seconds=float(now - self._s.slots.touched_at[slot]) if ready else 0.0,
                leases=int(self._s.slots.pins[slot]), slot_offset=int(self._s.pool.offset[slot]))

    def stats(self) -> StoreStats:
        """The store's stats and its tiers'."""
        s = self._s
        tiers = s.lower.levels()            # outside the lock: the tiers have their own
        with s.lock:
            n = s.pool.id_capacity
            ready = s.slots.state[:n] == SlotState.READY
            by_idx = s.layouts.by_idx
            per_layout = np.bincount(s.slots.layout_of[:n][ready], minlength=len(by_idx))
            pages_of: dict[str, int] = {}
            layouts = []
            for info in by_idx:
                pages = int(per_layout[info.idx])
                pages_of[info.tenant] = pages_of.get(info.tenant, 0) + pages
                layouts.append(LayoutStats(
                    info, pages, pages * s.pool.slot_bytes(info.cls), info.hits,
                    info.misses, info.evictions, info.bytes_in, info.bytes_out, info.served))
            # A slot's pins are its live leases', its held-back leases' (holdback.py) and
            # its sessions' (a retained page is pinned, but by no lease).
            pins = s.slots.pins[:n]
            live = pins.astype(np.int64)
            retained = self._retention.table
            for held in (self._book.held_back.counts, retained.count):
                k = min(n, len(held))
                live[:k] -= held[:k]
            return StoreStats(
                capacity_bytes=s.pool.capacity_bytes, used_bytes=s.pool.used_bytes,
                pages=int(np.count_nonzero(ready)),
                hits=sum(i.hits for i in by_idx), misses=sum(i.misses for i in by_idx),
                evictions=self._eviction.evictions,
                bytes_in=sum(i.bytes_in for i in by_idx),
                bytes_out=sum(i.bytes_out for i in by_idx),
                served=sum(i.served for i in by_idx),
                leases=len(self._book.table) + self._book.reading,
                leased_pages=int(np.count_nonzero(live > 0)),
                held_back_leases=len(self._book.held_back),
                held_back_pages=self._book.held_back.pages(),
                pinned_pages=int(np.count_nonzero(pins)),
                uptime_seconds=s.clock() - s.started_at, promotions=self._below.promotions,
                layouts=tuple(layouts),
                tenants=tuple(TenantStats(name, pages, s.tenants.bytes.get(name, 0))
                              for name, pages in pages_of.items()),
                tiers=tiers, lock=s.lock.holds(),
                retained_pages=retained.pages(), retention_sessions=len(retained),
                retention_refused=retained.refused())
