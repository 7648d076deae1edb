"""A second eviction policy, first in first out, to show that one plugs in by a setting.

`--eviction-policy tests.fifo_policy` (or KVSTORE_EVICTION_POLICY) makes DRAM and the disk
tier evict pages in the order they were first added; a touch of a tracked id changes
nothing. Pure data, not thread-safe, like lru.py.
"""

from __future__ import annotations

import numpy as np

__all__ = ["POLICY", "FIFOPolicy"]


class FIFOPolicy:
    """Oldest first. Ids are small non-negative integers (slot ids)."""

    def __init__(self) -> None:
        self._added = np.zeros(1024, dtype=np.int64)     # when first added, 0 = not tracked
        self._clock = 1

    def touch(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and ids.max() >= len(self._added):
            bigger = np.zeros(max(int(ids.max()) + 1, 2 * len(self._added)), dtype=np.int64)
            bigger[: len(self._added)] = self._added
            self._added = bigger
        new = ids[self._added[ids] == 0]
        new = new[np.sort(np.unique(new, return_index=True)[1])]     # first mention of each
        self._added[new] = np.arange(self._clock, self._clock + new.size)
        self._clock += new.size

    def remove(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids, dtype=np.int64)
        self._added[ids[ids < len(self._added)]] = 0

    def victims(self, n: int, eligible: np.ndarray | None = None) -> np.ndarray:
        mask = self._added > 0
        if eligible is not None:
            k = min(len(eligible), len(mask))
            mask = mask[:k] & eligible[:k]
        candidates = np.flatnonzero(mask)
        if n <= 0:
            return candidates[:0]
        return candidates[np.argsort(self._added[candidates], kind="stable")][:n]


POLICY = FIFOPolicy
