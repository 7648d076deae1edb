"""Store's slots coming free: allocation that evicts in the policy's order, quotas, watermarks.

A mixin of Store (store.py), which owns the lock and the state these change; every method
here runs under that lock except evict_to_watermark, which takes it a batch at a time (the
evictor thread). Victim choice itself is pure (eviction.py); this is where its victims are
spilled to the tier below and their slots freed.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np

from .eviction import EvictionPolicy, enough
from .layouts import LayoutInfo, LayoutRegistry
from .pool import Pool
from .quota import TenantLedger
from .removals import Cause, RemovalRing
from .slots import SlotState, SlotTable
from .tier import Tier
from .timed_lock import TimedLock

__all__ = ["StoreEviction"]

DOOMED = SlotState.DOOMED


class StoreEviction:
    """Store's allocation and eviction; the attributes below are Store's (store.py says
    what each holds and what guards it)."""

    pool: Pool
    mem: np.ndarray
    lower: Tier
    evictions: int
    high_watermark: float
    low_watermark: float
    pressure: threading.Event
    removals: RemovalRing
    _lock: TimedLock
    _slots: SlotTable
    _layouts: LayoutRegistry
    _policy: EvictionPolicy
    _tenants: TenantLedger

    if TYPE_CHECKING:               # Store's own (store_retention), used here
        def _forget_retained(self, slots: np.ndarray) -> None: ...

    def _room_for(self, info: LayoutInfo, n: int, quota: int) -> None:
        """Evict info's tenant's coldest pages so that n more fit its quota (quota.py)."""
        mine = [i for i in self._layouts.by_idx if i.tenant == info.tenant]
        page_bytes = np.array([i.page_bytes for i in self._layouts.by_idx], dtype=np.int64)
        self._evict(self._tenants.quota_room(
            info, n, quota, mine, self._evictable_of, self._policy,
            lambda victims: page_bytes[self._slots.layout_of[victims]]))
        self._evict(self._tenants.footprint_room(
            info, n, quota, self.pool, self._layouts.of_tenant(info.tenant, info.cls),
            self._evictable_of, self._policy))

    def _evictable_of(self, layouts: list[int]) -> np.ndarray:
        """Mask over slot ids: unleased READY pages of these layouts (by idx)."""
        n_ids = self.pool.id_capacity
        return self._evictable() & np.isin(self._slots.layout_of[:n_ids], layouts)

    def _drop(self, slots: np.ndarray) -> None:
        """Slots already out of the index: free them, or doom them while pinned."""
        if not slots.size:
            return
        self._forget_retained(slots)        # a delete ends retention (store_retention)
        pinned = self._slots.pins[slots] > 0
        self._slots.state[slots[pinned]] = DOOMED
        self._policy.remove(slots[pinned])
        self._free(slots[~pinned])

    def _free(self, slots) -> None:
        slots = np.asarray(slots, dtype=np.int64)
        if not slots.size:
            return
        owners = self._slots.layout_of[slots]
        per_layout = np.bincount(owners[owners >= 0], minlength=len(self._layouts))
        for idx in np.flatnonzero(per_layout).tolist():
            self._tenants.refund(self._layouts.by_idx[idx], int(per_layout[idx]))
        self._slots.clear(slots)
        self._policy.remove(slots)
        self.pool.free(slots)

    def _evictable(self) -> np.ndarray:
        self._slots.grow(self.pool.id_capacity)
        return self._slots.evictable(self.pool.id_capacity)

    def _evict(self, slots: np.ndarray) -> int:
        """Evict these unleased READY slots, spilling each page to the tier below (a
        copy into its staging memory, or dropped when its queue is full: offer never
        waits); returns bytes freed."""
        if not slots.size:
            return 0
        for idx, key_size, members in self._slots.groups(slots):
            info = self._layouts.by_idx[idx]
            index = info.ready[key_size]
            keys = index.keys_of(members)
            if self.lower.holds_pages:
                pb = info.page_bytes
                # A page the tier below refuses leaves this server now (removals.py).
                kept = np.ones(len(members), dtype=bool)
                for i, (key, slot) in enumerate(zip(keys, members.tolist(), strict=True)):
                    off = int(self.pool.offset[slot])
                    kept[i] = self.lower.offer(info.layout_id, key.tobytes(),
                                               self.mem[off:off + pb])
                if not kept.all():
                    self.removals.record(info.layout_id, keys[~kept], Cause.EVICTED)
            else:
                self.removals.record(info.layout_id, keys, Cause.EVICTED)
            index.remove_slots(members)
            info.evictions += len(members)
        freed = int(self.pool.class_bytes[self.pool.cls[slots]].sum())
        self.evictions += len(slots)
        self._free(slots)
        return freed

    def _alloc(self, cls: int, n: int) -> np.ndarray:
        """n slots of class cls, evicting in the policy's order if needed."""
        got = self.pool.alloc(cls, n)
        self._slots.grow(self.pool.id_capacity)
        if len(got) == n:
            return got
        parts = [got]
        missing = n - len(got)
        # First the class's own pages: each eviction frees exactly one usable slot.
        n_ids = self.pool.id_capacity
        mine = self._evictable() & (self.pool.cls[:n_ids] == cls)
        self._evict(self._policy.victims(missing, mine))
        more = self.pool.alloc(cls, missing)
        parts.append(more)
        missing -= len(more)
        # Then other classes' pages, first victims first, until whole extents come free.
        batch = max(16, missing)
        while missing > 0:
            victims = self._policy.victims(batch, self._evictable())
            if victims.size == 0:
                break
            self._evict(victims)
            more = self.pool.alloc(cls, missing)
            parts.append(more)
            missing -= len(more)
        return np.concatenate(parts)

    def _slot_bytes(self, victims: np.ndarray) -> np.ndarray:
        return self.pool.class_bytes[self.pool.cls[victims]]

    def evict_to_watermark(self, batch: int = 256) -> int:
        """Evict pages until usage is under the low watermark; returns pages evicted.
        Runs in the evictor thread, a batch per lock hold, so requests interleave."""
        evicted = 0
        while True:
            with self._lock:
                high = self.high_watermark * self.pool.capacity_bytes
                low = self.low_watermark * self.pool.capacity_bytes
                if self.pool.used_bytes <= (low if evicted else high):
                    self.pressure.clear()
                    return evicted
                victims = self._policy.victims(batch, self._evictable())
                if victims.size == 0:
                    return evicted
                victims = victims[: enough(self._slot_bytes(victims),
                                           int(self.pool.used_bytes - low))]
                self._evict(victims)
                evicted += len(victims)
