"""Store's slots coming free: allocation that evicts in the policy's order, quotas, watermarks.

Eviction owns what only it changes (the eviction count, the watermarks and the pressure
event the evictor thread waits on) and works on the store's shared state (StoreState).
Every method here runs under the store's lock except evict_to_watermark, which takes it
a batch at a time (the evictor thread). Victim choice itself is pure (eviction.py); this
is where its victims are spilled to the tier below and their slots freed.

Where a page leaves DRAM: `evict` (spilled to the tier below, if any) and `drop` (deleted:
its `dropping` hooks run first, as sessions' retention's does to let go of it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from ..removals import Cause
from .eviction import enough
from .layouts import LayoutInfo
from .slots import SlotState
from .state import StoreState

__all__ = ["Eviction"]

DOOMED = SlotState.DOOMED
_FEW = 16                # slots freed by counting in Python (see free)


class Eviction:
    """The store's allocation and eviction over its shared state."""

    def __init__(self, state: StoreState, *, high_watermark: float,
                 low_watermark: float) -> None:
        self._s = state
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self.evictions = 0                      # pages evicted, all time
        self.pressure = threading.Event()      # set when usage crosses the high watermark
        # Called (under the lock) with slots whose pages are deleted, before they are
        # freed or doomed: sessions' retention lets go of them here.
        self.dropping: list[Callable[[np.ndarray | list[int]], None]] = []

    def room_for(self, info: LayoutInfo, n: int, quota: int) -> None:
        """Evict info's tenant's coldest pages so that n more fit its quota (quota.py)."""
        s = self._s
        mine = [i for i in s.layouts.by_idx if i.tenant == info.tenant]
        page_bytes = np.array([i.page_bytes for i in s.layouts.by_idx], dtype=np.int64)
        self.evict(s.tenants.quota_room(
            info, n, quota, mine, self._evictable_of, s.policy,
            lambda victims: page_bytes[s.slots.layout_of[victims]]))
        self.evict(s.tenants.footprint_room(
            info, n, quota, s.pool, s.layouts.of_tenant(info.tenant, info.cls),
            self._evictable_of, s.policy))

    def _evictable_of(self, layouts: list[int]) -> np.ndarray:
        """Mask over slot ids: unleased READY pages of these layouts (by idx)."""
        n_ids = self._s.pool.id_capacity
        return self.evictable() & np.isin(self._s.slots.layout_of[:n_ids], layouts)

    def drop(self, slots: np.ndarray | list[int]) -> None:
        """Slots already out of the index: free them, or doom them while pinned. A few
        distinct slots may come as a list (a few-key delete): read and freed as Python
        ints, as free() frees them."""
        if not len(slots):
            return
        for hook in self.dropping:          # a delete ends retention (sessions)
            hook(slots)
        s = self._s
        if isinstance(slots, list):
            if len(slots) <= _FEW:
                pins = s.slots.pins
                if not any(pins[slot] for slot in slots):
                    self._free_few(slots)
                    return
            slots = np.array(slots, dtype=np.int64)
        pinned = s.slots.pins[slots] > 0
        if not pinned.any():                # the common case: one call fewer each side
            self.free(slots)
            return
        s.slots.state[slots[pinned]] = DOOMED
        s.policy.remove(slots[pinned])
        self.free(slots[~pinned])

    def free(self, slots) -> None:
        """Give slots back to the pool, refunding their tenants."""
        if isinstance(slots, list) and len(slots) <= _FEW:
            self._free_few(slots)
            return
        slots = np.asarray(slots, dtype=np.int64)
        if not slots.size:
            return
        s = self._s
        owners = s.slots.layout_of[slots]
        if len(owners) <= _FEW:             # a few: counted in Python, no bincount
            per: dict[int, int] = {}
            for idx in owners.tolist():
                if idx >= 0:
                    per[idx] = per.get(idx, 0) + 1
            for idx, count in per.items():
                s.tenants.refund(s.layouts.by_idx[idx], count)
        else:
            per_layout = np.bincount(owners[owners >= 0], minlength=len(s.layouts))
            for idx in np.flatnonzero(per_layout).tolist():
                s.tenants.refund(s.layouts.by_idx[idx], int(per_layout[idx]))
        s.slots.clear(slots)
        s.policy.remove(slots)
        s.pool.free(slots)

    # A one-key delete freed its slot through about 20 numpy calls (a fancy read of its
    # owner, two fancy stores, the policy's, the pool's asarray), each costing as much for
    # one slot as for thousands, and more with the caches cold as they are when a request
    # comes: a delete cost the server more than a put. A few slots as Python ints instead.
    def _free_few(self, slots: list[int]) -> None:
        """free() of a few slots given as a list: scalar reads and stores."""
        if not slots:
            return
        s = self._s
        layout_of = s.slots.layout_of
        per: dict[int, int] = {}
        for slot in slots:
            idx = int(layout_of[slot])
            if idx >= 0:
                per[idx] = per.get(idx, 0) + 1
        for idx, count in per.items():
            s.tenants.refund(s.layouts.by_idx[idx], count)
        s.slots.clear_few(slots)
        remove_few = getattr(s.policy, "remove_few", None)
        if remove_few is not None:
            remove_few(slots)
        else:
            s.policy.remove(np.array(slots, dtype=np.int64))
        s.pool.free(slots)

    def evictable(self) -> np.ndarray:
        """Mask over slot ids: the unleased READY pages."""
        self._s.slots.grow(self._s.pool.id_capacity)
        return self._s.slots.evictable(self._s.pool.id_capacity)

    def evict(self, slots: np.ndarray) -> int:
        """Evict these unleased READY slots, spilling each page to the tier below (a
        copy into its staging memory, or dropped when its queue is full: offer never
        waits); returns bytes freed."""
        if not slots.size:
            return 0
        s = self._s
        lower, pool = s.lower, s.pool
        for idx, key_size, members in s.slots.groups(slots):
            info = s.layouts.by_idx[idx]
            index = info.ready[key_size]
            keys = index.keys_of(members)
            if lower.holds_pages:
                pb = info.page_bytes
                # A page the tier below refuses leaves this server now (removals.py).
                kept = np.ones(len(members), dtype=bool)
                for i, (key, slot) in enumerate(zip(keys, members.tolist(), strict=True)):
                    off = int(pool.offset[slot])
                    kept[i] = lower.offer(info.layout_id, key.tobytes(),
                                          s.mem[off:off + pb])
                if not kept.all():
                    s.removals.record(info.layout_id, keys[~kept], Cause.EVICTED)
            else:
                s.removals.record(info.layout_id, keys, Cause.EVICTED)
            index.remove_slots(members)
            info.evictions += len(members)
        freed = int(pool.class_bytes[pool.cls[slots]].sum())
        self.evictions += len(slots)
        self.free(slots)
        return freed

    def alloc(self, cls: int, n: int) -> np.ndarray:
        """n slots of class cls, evicting in the policy's order if needed."""
        pool, policy = self._s.pool, self._s.policy
        got = pool.alloc(cls, n)
        self._s.slots.grow(pool.id_capacity)
        if len(got) == n:
            return got
        parts = [got]
        missing = n - len(got)
        # First the class's own pages: each eviction frees exactly one usable slot.
        n_ids = pool.id_capacity
        mine = self.evictable() & (pool.cls[:n_ids] == cls)
        self.evict(policy.victims(missing, mine))
        more = pool.alloc(cls, missing)
        parts.append(more)
        missing -= len(more)
        # Then other classes' pages, first victims first, until whole extents come free.
        batch = max(16, missing)
        while missing > 0:
            victims = policy.victims(batch, self.evictable())
            if victims.size == 0:
                break
            self.evict(victims)
            more = pool.alloc(cls, missing)
            parts.append(more)
            missing -= len(more)
        return np.concatenate(parts)

    def slot_bytes(self, victims: np.ndarray) -> np.ndarray:
        """The bytes each of these slots takes in the pool."""
        return self._s.pool.class_bytes[self._s.pool.cls[victims]]

    def note_usage(self) -> None:
        """Wake the evictor if usage crossed the high watermark (under the lock)."""
        if self._s.pool.used_bytes > self.high_watermark * self._s.pool.capacity_bytes:
            self.pressure.set()

    def evict_to_watermark(self, batch: int = 256) -> int:
        """Evict pages until usage is under the low watermark; returns pages evicted.
        Runs in the evictor thread, a batch per lock hold, so requests interleave."""
        evicted = 0
        pool = self._s.pool
        while True:
            with self._s.lock:
                high = self.high_watermark * pool.capacity_bytes
                low = self.low_watermark * pool.capacity_bytes
                if pool.used_bytes <= (low if evicted else high):
                    self.pressure.clear()
                    return evicted
                victims = self._s.policy.victims(batch, self.evictable())
                if victims.size == 0:
                    return evicted
                victims = victims[: enough(self.slot_bytes(victims),
                                           int(pool.used_bytes - low))]
                self.evict(victims)
                evicted += len(victims)
