"""Slots held back after their lease expired, until a later time. A pure table, not
thread-safe (the store's lock guards it).

Why: a lease that runs out is usually a client that died (one on the fast path ends its
leases as its connection closes, and holds nothing back), but it may be one that is only
slow (a process stopped for a while, a DMA write still in flight into a reserved slot, a
copy still reading an acquired one). Reused at once, such a slot takes another key's page,
and the late write lands in it, or the late read returns it: wrong bytes, no error. So
the store keeps an expired lease's slots pinned for another --lease-ttl
(lease_book.LeaseBook.expire), then lets them go. A lease its client
releases, aborts or commits goes free at once, and an admin's --force ends holds too (the
operator knows the clients are gone).

The time held back is the server's --lease-ttl, not the lease's own: a client may ask for
leases of 50 ms and stall for 300 ms. Clients that did so (leases shorter than their
stalls) read wrong bytes when slots went free at
expiry and when they were held back for the lease's own ttl, and never when held back
for --lease-ttl. What is held counts in
lease_memory with the live leases (lease_book); a lease's expiry moves its footprint
from one to the other, never adding to it, so a client that lets short leases expire
holds no more than it could hold live.
"""

from __future__ import annotations

import heapq
import itertools

import numpy as np

from .leases import footprint

__all__ = ["HoldBack"]


class HoldBack:
    """Slot arrays held back, each until its own time, the earliest found in O(log n)."""

    def __init__(self) -> None:
        # heap of (until, order held, slots); the order breaks ties (arrays don't compare)
        self._heap: list[tuple[float, int, np.ndarray]] = []
        self._order = itertools.count()
        self.held = 0           # footprint() of what is held, counted with the leases
        self.pins = 0           # slots held, with repeats: a slot of 20 expired leases
                                # counts 20 times, so this may exceed the pool many times
        # How often each slot id is held (grown on demand): the distinct pages held are
        # what an operator asks about (pages()), and a live lease's pins are a slot's
        # pins less these (admin.Admin.stats).
        self.counts = np.zeros(0, dtype=np.int32)

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, until: float, slots: np.ndarray) -> None:
        """Hold `slots` (pinned once each by the caller) until the clock reads `until`."""
        if len(slots):
            heapq.heappush(self._heap, (until, next(self._order), slots))
            self.held += footprint(len(slots))
            self.pins += len(slots)
            top = int(slots.max()) + 1
            if top > len(self.counts):
                self.counts = np.concatenate(
                    [self.counts, np.zeros(max(top, 2 * len(self.counts)) - len(self.counts),
                                           dtype=np.int32)])
            np.add.at(self.counts, slots, 1)

    def pages(self) -> int:
        """Distinct slots held (a scan of the counts: for stats, not the request path)."""
        return int(np.count_nonzero(self.counts))

    def due(self, now: float) -> list[np.ndarray]:
        """Remove and return the slot arrays whose time has come."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            out.append(self._drop(heapq.heappop(self._heap)[2]))
        return out

    def take_all(self) -> list[np.ndarray]:
        """Remove and return every slot array held (an admin's --force)."""
        out = [self._drop(slots) for _, _, slots in self._heap]
        self._heap = []
        return out

    def _drop(self, slots: np.ndarray) -> np.ndarray:
        self.held -= footprint(len(slots))
        self.pins -= len(slots)
        np.subtract.at(self.counts, slots, 1)
        return slots
