"""What every part of the store shares, declared once: the pool, the slot table, the layouts, the lock.

Store (store.py) builds one StoreState and hands it to its parts, each of which owns the
rest of its own state: eviction and allocation (evict.Eviction), the lease book
(lease_book.LeaseBook), sessions' retention (sessions.Retention), the tier below
(below.Below) and the admin operations (admin.Admin).

Concurrency: `lock` guards every field below except `lower` and `removals` (each has its
own lock; the tier below is asked outside this one) and the read-only ones (mem, clock,
started_at). A
part's method that says "under the lock" expects its caller to hold it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from kvstore_protocol.keys import Packed

from ..removals import RemovalRing
from ..tier import Tier
from .eviction import EvictionPolicy
from .index import FEW_KEYS
from .layouts import LayoutInfo, LayoutRegistry
from .pool import Pool
from .quota import TenantLedger
from .slots import SlotTable
from .timed_lock import TimedLock

__all__ = ["SCATTERED_FROM", "StoreState"]


# From this many slots a run side by side is served by slices (side_by_side): below, a
# few scalar stores cost less than making the range to compare with.
SPAN_FROM = 4

# From this many slots not side by side, a few slots' touch and pin go through one array
# rather than a numpy store per slot: in one process a Get of 16 scattered pages took
# 15.7 us slot by slot and 11.9 through the array, of 8 about the same either way.
SCATTERED_FROM = 8


def side_by_side(slots: list[int]) -> bool:
    """Whether these are SPAN_FROM or more slots first, first + 1, ... in order: a Put's
    run, as the pool hands slots out, whose touches and pins are slices, not a numpy
    store per slot."""
    n = len(slots)
    return n >= SPAN_FROM and slots == list(range(slots[0], slots[0] + n))


@dataclasses.dataclass(slots=True, eq=False)
class StoreState:
    """The store's shared state; `lower` may be replaced (tests), the rest never is."""

    mem: np.ndarray                 # the region's bytes: page bytes at pool offsets
    pool: Pool                      # slots in the region, by size class
    lower: Tier                     # the tier below DRAM (a NullTier if none)
    clock: Callable[[], float]      # the lease table's and the slots' timestamps
    started_at: float               # clock() at start: slot times count from it
    # Timed: the longest hold is the longest one call can stall the others (rpc/limits.py
    # bounds it; /metrics shows it).
    lock: TimedLock
    slots: SlotTable                # each slot's state, layout, pins, times
    layouts: LayoutRegistry         # registered layouts and their key indexes
    policy: EvictionPolicy          # the order READY slots are evicted in
    tenants: TenantLedger           # bytes each tenant holds, for quotas
    # Pages that leave this server (removals.py; it has its own lock, and the disk tier
    # records into it too).
    removals: RemovalRing

    @staticmethod
    def find(info: LayoutInfo, keys: Packed) -> np.ndarray:
        """The READY slot of each key, -1 where there is none (under the lock)."""
        index = info.ready.get(keys.size)
        if index is None or not len(keys):
            return np.full(len(keys), -1, dtype=np.int64)
        if len(keys) <= FEW_KEYS:            # no numpy call on the way (index.find_few)
            return np.array(index.find_few(keys.data), dtype=np.int64)
        return index.find(keys.rows)

    @staticmethod
    def find_run(info: LayoutInfo, keys: Packed) -> np.ndarray:
        """The READY slots of the keys' leading run, up to the first absent key (under
        the lock): KeyIndex.find_run."""
        index = info.ready.get(keys.size)
        if index is None or not len(keys):
            return np.empty(0, dtype=np.int64)
        return index.find_run(keys.rows)

    def touch(self, slots: np.ndarray) -> None:
        """These slots' pages were used now (under the lock)."""
        # Reversed: the prefix's head becomes the most recent, its tail goes first.
        self.policy.touch(slots[::-1])
        self.slots.touched_at[slots] = self.clock() - self.started_at

    def touch_span(self, first: int, n: int) -> None:
        """touch() of the n slots from first on, side by side: two slice stores, where a
        store per slot cost 3.9 us for 16 and these 2.5 (in one process), with the
        policy's span form where it has one (lru.LRUPolicy.touch_span)."""
        self.slots.touched_at[first:first + n] = self.clock() - self.started_at
        touch_span = getattr(self.policy, "touch_span", None)
        if touch_span is not None:
            touch_span(first, n)
        else:
            self.policy.touch(np.arange(first + n - 1, first - 1, -1))

    def touch_few(self, slots: list[int]) -> None:
        """touch() of a few slots given as a list (a Get's, a few-key lookup's run): scalar
        stores, and the policy's list form where it has one (lru.LRUPolicy.touch_few),
        with no array made: numpy's fancy forms cost as much for one slot as for
        hundreds (under the lock)."""
        if side_by_side(slots):
            self.touch_span(slots[0], len(slots))
            return
        if len(slots) >= SCATTERED_FROM:
            self.touch(np.array(slots, dtype=np.int64))
            return
        now = self.clock() - self.started_at
        touched = self.slots.touched_at
        for slot in slots:
            touched[slot] = now
        touch_few = getattr(self.policy, "touch_few", None)
        if touch_few is not None:
            touch_few(slots[::-1])
        else:
            self.policy.touch(np.array(slots[::-1], dtype=np.int64))
