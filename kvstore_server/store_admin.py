"""What an operator asks of the store as a whole: evict, clear, spill at stop, inspect, stats.

A mixin of Store (store.py), which owns the lock and the state these read: they are bulk
operations over the same slots, apart from the per-request lifecycle. Each takes the lock
a batch of pages at a time (ADMIN_BATCH), so requests interleave with them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from kvstore_protocol.keys import MAX_KEY_BYTES, Packed

from .errors import Outcome, Reason, StoreError
from .eviction import EvictionPolicy, enough
from .far.records import LayoutRecord, Scope
from .holdback import HoldBack
from .layouts import LayoutInfo, LayoutRegistry
from .leases import LeaseTable
from .pool import Pool
from .quota import TenantLedger
from .removals import Cause, RemovalRing
from .slots import SlotState, SlotTable
from .stats import LayoutStats, StoreStats, TenantStats
from .tier import PageInfo, Tier, TierName
from .timed_lock import TimedLock

__all__ = ["ADMIN_BATCH", "Invalidation", "StoreAdmin"]

# Pages an admin eviction or clear handles a lock hold: 256 evicted to the disk tier held
# it about 11 ms on the dev VM (each page is offered, a copy into the write queue).
ADMIN_BATCH = 256


@dataclasses.dataclass(frozen=True, slots=True)
class Invalidation:
    """What one invalidation removed, per tier, and what kept it from being whole."""

    layout_ids: tuple[bytes, ...]   # of the scope: this server's and the cluster's
    dram_pages: int
    disk_pages: int
    far_pages: int                  # of the whole fleet
    failure: str = ""               # "" when every tier was reached and finished


class StoreAdmin:
    """Store's admin operations; the attributes below are Store's (store.py says what
    each holds and what guards it)."""

    pool: Pool
    mem: np.ndarray
    lower: Tier
    clock: Callable[[], float]
    started_at: float
    evictions: int
    promotions: int
    removals: RemovalRing
    _lock: TimedLock
    _slots: SlotTable
    _layouts: LayoutRegistry
    _policy: EvictionPolicy
    _leases: LeaseTable
    _held_back: HoldBack
    _tenants: TenantLedger

    if TYPE_CHECKING:               # Store's own, used here
        def _evict(self, slots: np.ndarray) -> int: ...
        def _drop(self, slots: np.ndarray) -> None: ...
        def _unpin(self, slots: np.ndarray) -> None: ...
        def _slot_bytes(self, victims: np.ndarray) -> np.ndarray: ...
        def layouts(self) -> list[LayoutInfo]: ...

    def evict(self, *, layout_id: bytes | None = None, nbytes: int | None = None,
              everything: bool = False, tier: str = "dram") -> tuple[int, int, int]:
        """Admin eviction from tier "dram" (to the tiers below), "disk" or "far" (gone;
        the far tier only this server's namespace, and never by a byte amount), or "all":
        (pages, bytes, pages skipped because leased)."""
        if tier not in (TierName.DRAM, TierName.DISK, TierName.FAR, "all"):
            raise StoreError(Outcome.INVALID,
                             f"tier must be dram, disk, far or all, got {tier!r}")
        pages = freed = leased = 0
        whole = False                   # a whole layout, or all, left the tiers below
        if tier in (TierName.DRAM, "all"):
            pages, freed, leased = self._evict_dram(layout_id, nbytes)
        if layout_id is not None and tier != TierName.DRAM:
            self._layouts.info(layout_id)
        # The chain's tiers one by one: `--tier disk` must never reach a shared cluster.
        for below in self.lower.tiers:
            if not below.holds_pages or tier not in ("all", below.name):
                continue
            more, more_bytes = below.evict(nbytes=nbytes, layout_id=layout_id,
                                           everything=nbytes is None and layout_id is None)
            pages, freed = pages + more, freed + more_bytes
            whole = nbytes is None      # a byte amount: the disk tier records its victims
        if whole:
            for lid in ([layout_id] if layout_id is not None
                        else [i.layout_id for i in self.layouts()]):
                self.removals.record_layout(lid, Cause.EVICTED)
        return pages, freed, leased

    def _evict_dram(self, layout_id: bytes | None, nbytes: int | None) -> tuple[int, int, int]:
        with self._lock:
            n = self.pool.id_capacity
            live = self._slots.state[:n] == SlotState.READY
            idx = None if layout_id is None else self._layouts.info(layout_id).idx
            if idx is not None:
                live &= self._slots.layout_of[:n] == idx
            leased = int(np.count_nonzero(live & (self._slots.pins[:n] > 0)))
            eligible = live & (self._slots.pins[:n] == 0)
            if nbytes is not None:
                victims = self._policy.victims(int(np.count_nonzero(eligible)), eligible)
                victims = victims[: enough(self._slot_bytes(victims), nbytes)]
            else:
                victims = np.flatnonzero(eligible)
        # A batch a lock hold, as the evictor does: evicting 65,536 pages in one hold (each
        # offered to the disk tier) held the lock 2.9 s. A victim leased or freed since it
        # was chosen is passed over; one whose slot went to another page meanwhile is
        # evicted in its place (of its layout, if one was named): the same to a cache.
        pages = freed = 0
        for start in range(0, len(victims), ADMIN_BATCH):
            with self._lock:
                chunk = victims[start:start + ADMIN_BATCH]
                ok = (self._slots.state[chunk] == SlotState.READY) & (self._slots.pins[chunk] == 0)
                if idx is not None:
                    ok &= self._slots.layout_of[chunk] == idx
                chunk = chunk[ok]
                freed += self._evict(chunk)
                pages += len(chunk)
        return pages, freed, leased

    def clear(self) -> tuple[int, int]:
        """Delete every page of every layout, in every tier (leased ones when released);
        a batch of pages a lock hold, as admin eviction."""
        pages = touched = 0
        for info in self.layouts():
            dropped, held = self._drop_layout(info)
            pages, touched = pages + dropped, touched + held
        if self.lower.holds_pages:
            pages += self.lower.evict(everything=True)[0]
        for info in self.layouts():
            self.removals.record_layout(info.layout_id, Cause.DELETED)
        return pages, touched

    def _drop_layout(self, info: LayoutInfo) -> tuple[int, bool]:
        """Delete every DRAM page of one layout, never spilled below (leased ones when
        released): (pages, whether it held any, those being written included)."""
        pages = 0
        with self._lock:
            n = self.pool.id_capacity
            mine = np.flatnonzero((self._slots.layout_of[:n] == info.idx)
                                  & (self._slots.state[:n] == SlotState.READY))
            writing = np.array(list(info.writing.values()), dtype=np.int64)
            info.writing.clear()
            self._drop(writing)
        for start in range(0, len(mine), ADMIN_BATCH):
            with self._lock:
                chunk = mine[start:start + ADMIN_BATCH]
                chunk = chunk[(self._slots.state[chunk] == SlotState.READY)
                              & (self._slots.layout_of[chunk] == info.idx)]
                for size, index in info.ready.items():
                    index.remove_slots(chunk[self._slots.key_size[chunk] == size])
                self._drop(chunk)
                pages += len(chunk)
        return pages, bool(mine.size or writing.size)

    def invalidate(self, scope: Scope) -> Invalidation:
        """Delete every page of the scope's layouts from DRAM, disk and the far tier (of
        the whole fleet there: far/records.py says how its layouts are found). Every
        tier is asked whatever another answered; `failure` says which could not be
        reached or did not finish (the far tier goes on in the background)."""
        mine = [i for i in self.layouts()
                if scope.matches(LayoutRecord.of(i.layout_id, i.tenant, i.layout))]
        dram = sum(self._drop_layout(info)[0] for info in mine)
        ids = [i.layout_id for i in mine]
        disk = far = 0
        failures: list[str] = []
        # Bottom first (the far tier): the layouts its records name are the disk's too.
        for below in reversed([t for t in self.lower.tiers if t.holds_pages]):
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
            self.removals.record_layout(layout_id, Cause.INVALIDATED)
        return Invalidation(tuple(ids), dram, disk, far, "; ".join(failures))

    def spill_all(self, timeout: float) -> tuple[int, int]:
        """Write every DRAM page to the tier below, for a graceful stop: (pages offered,
        pages left unwritten when the time ran out). The tier's queue is bounded, so this
        offers until it is full, waits for the writer, and goes on."""
        if not self.lower.holds_pages:
            return 0, 0
        deadline = time.monotonic() + timeout
        with self._lock:
            n = self.pool.id_capacity
            slots = np.flatnonzero(self._slots.state[:n] == SlotState.READY)
            todo = []
            for idx, key_size, members in self._slots.groups(slots):
                info = self._layouts.by_idx[idx]
                keys = info.ready[key_size].keys_of(members)
                todo += [(info, k.tobytes(), int(self.pool.offset[m]))
                         for k, m in zip(keys, members.tolist(), strict=True)]
            # The pages stay pinned while offered: no request may reuse their slots.
            self._slots.add_pins(slots, 1)
        offered = 0
        try:
            for info, key, off in todo:
                page = self.mem[off:off + info.page_bytes]
                # A tier that refuses with its queue empty will not take the page later
                # (failed, read only, breaker open): give up rather than wait out the time.
                drained = False
                while not self.lower.offer(info.layout_id, key, page):
                    if (drained or any(t.failed for t in self.lower.levels())
                            or time.monotonic() > deadline):
                        return offered, len(todo) - offered
                    drained = self.lower.flush(
                        min(1.0, max(0.0, deadline - time.monotonic()))) == 0
                offered += 1
            left = self.lower.flush(max(0.0, deadline - time.monotonic()))
            return offered, left
        finally:
            with self._lock:
                self._unpin(slots)

    # -- introspection ----------------------------------------------------------------
    def inspect(self, layout_id: bytes, key: bytes) -> PageInfo:
        if not 1 <= len(key) <= MAX_KEY_BYTES:
            raise StoreError(Outcome.INVALID, f"a key is 1 to {MAX_KEY_BYTES} bytes, got "
                                              f"{len(key)}")
        with self._lock:
            info = self._layouts.info(layout_id)
            index = info.ready.get(len(key))
            slot = int(index.find(Packed(key, len(key)).rows)[0]) if index is not None else -1
            if slot < 0:
                slot = info.writing.get(key, -1)
            if slot < 0:
                below = self.lower.describe(layout_id, key)
                if below is not None:
                    return below
                raise StoreError(Outcome.NOT_FOUND, f"key {key.hex()} is not stored in "
                                 f"layout {layout_id.hex()}", reason=Reason.PAGES_MISSING)
            now = self.clock() - self.started_at
            state = SlotState(int(self._slots.state[slot]))
            ready = state is SlotState.READY
            return PageInfo(
                TierName.DRAM, state.name, info.page_bytes,
                age_seconds=float(now - self._slots.committed_at[slot]) if ready else 0.0,
                idle_seconds=float(now - self._slots.touched_at[slot]) if ready else 0.0,
                leases=int(self._slots.pins[slot]), slot_offset=int(self.pool.offset[slot]))

    def stats(self) -> StoreStats:
        tiers = self.lower.levels()         # outside the lock: the tiers have their own
        with self._lock:
            n = self.pool.id_capacity
            ready = self._slots.state[:n] == SlotState.READY
            by_idx = self._layouts.by_idx
            per_layout = np.bincount(self._slots.layout_of[:n][ready], minlength=len(by_idx))
            pages_of: dict[str, int] = {}
            layouts = []
            for info in by_idx:
                pages = int(per_layout[info.idx])
                pages_of[info.tenant] = pages_of.get(info.tenant, 0) + pages
                layouts.append(LayoutStats(
                    info, pages, pages * self.pool.slot_bytes(info.cls), info.hits,
                    info.misses, info.evictions, info.bytes_in, info.bytes_out, info.served))
            # A slot's pins are its live leases' plus its held-back ones' (holdback.py).
            pins = self._slots.pins[:n]
            held = self._held_back.counts[:n]
            live = pins[:len(held)] > held
            leased = int(np.count_nonzero(live)) + int(np.count_nonzero(pins[len(held):]))
            return StoreStats(
                capacity_bytes=self.pool.capacity_bytes, used_bytes=self.pool.used_bytes,
                pages=int(np.count_nonzero(ready)),
                hits=sum(i.hits for i in by_idx), misses=sum(i.misses for i in by_idx),
                evictions=self.evictions,
                bytes_in=sum(i.bytes_in for i in by_idx),
                bytes_out=sum(i.bytes_out for i in by_idx),
                served=sum(i.served for i in by_idx),
                leases=len(self._leases),
                leased_pages=leased,
                held_back_leases=len(self._held_back),
                held_back_pages=self._held_back.pages(),
                pinned_pages=int(np.count_nonzero(pins)),
                uptime_seconds=self.clock() - self.started_at, promotions=self.promotions,
                layouts=tuple(layouts),
                tenants=tuple(TenantStats(name, pages, self._tenants.bytes.get(name, 0))
                              for name, pages in pages_of.items()),
                tiers=tiers, lock=self._lock.holds())
