"""LRU eviction policy over integer entry ids: a pure data structure, not thread-safe.

Why stamps and not a linked list: a lookup of a 32k-token prompt touches 2,000 pages,
and a Python linked list pays an interpreted move per page, at that count the whole
latency budget. Here a touch is one vectorised store of increasing stamps, and finding
victims is one `argpartition` over the live entries, which runs in batches off the
request path. The order is exact LRU, not sampled.

Order within one touch: ids are stamped in the order given, so the *last* id becomes
the most recently used. The store passes a prefix's keys from last to first, so the
head of a prefix stays hottest and its tail is evicted first: a tail is useless without
its head.

Any other policy implements eviction.EvictionPolicy in a module of its own (see there).
"""

from __future__ import annotations

import numpy as np

__all__ = ["POLICY", "LRUPolicy"]

# Up to this many ids a touch is scalar stores (an engine's one-page or one-block call):
# np.arange and a fancy store cost many scalar stores.
_FEW = 8


class LRUPolicy:
    """Least recently used first. Ids are small non-negative integers (slot ids)."""

    def __init__(self, capacity: int = 1024) -> None:
        self._stamp = np.zeros(capacity, dtype=np.int64)   # last touch, 0 = not tracked
        self._clock = 1                                      # next stamp to hand out

    def _grow(self, max_id: int) -> None:
        if max_id >= len(self._stamp):
            bigger = np.zeros(max(max_id + 1, 2 * len(self._stamp)), dtype=np.int64)
            bigger[: len(self._stamp)] = self._stamp
            self._stamp = bigger

    def touch(self, ids: np.ndarray) -> None:
        """Mark ids used now, in order: ids[-1] becomes the most recent. Also adds them."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size <= _FEW:
            self.touch_few(ids.tolist())
            return
        stamps = np.arange(self._clock, self._clock + ids.size)
        # Grown only when an id lies past the end (IndexError): a max() on every touch
        # is one more numpy call on the Lookup path, not cheap with the caches cold.
        try:
            self._stamp[ids] = stamps
        except IndexError:
            self._grow(int(ids.max()))
            self._stamp[ids] = stamps
        self._clock += ids.size

    def touch_few(self, ids: list[int]) -> None:
        """touch() of a few ids given as a list, one scalar store each (store.few_reads
        touches a Get's pages so, with no array made)."""
        stamp = self._stamp
        if ids and max(ids) >= len(stamp):
            self._grow(max(ids))
            stamp = self._stamp
        clock = self._clock
        for i in ids:
            stamp[i] = clock
            clock += 1
        self._clock = clock

    def touch_span(self, first: int, n: int) -> None:
        """touch() of the ids first + n - 1 down to first, in that order (first becomes
        the most recent): a prefix's run of slots stored side by side, touched tail
        first. One slice store of a descending range, not a store per id."""
        end = first + n
        if end > len(self._stamp):
            self._grow(end - 1)
        clock = self._clock
        self._stamp[first:end] = np.arange(clock + n - 1, clock - 1, -1)
        self._clock = clock + n

    def remove(self, ids: np.ndarray) -> None:
        """Stop tracking ids (freed or deleted). Ids never touched are fine: a slot
        reserved and then aborted was never tracked, and may lie past the stamp array."""
        ids = np.asarray(ids, dtype=np.int64)
        ids = ids[ids < len(self._stamp)]
        if ids.size:
            self._stamp[ids] = 0

    def remove_few(self, ids: list[int]) -> None:
        """remove() of a few ids given as a list, one scalar store each."""
        stamp = self._stamp
        n = len(stamp)
        for i in ids:
            if i < n:
                stamp[i] = 0

    def victims(self, n: int, eligible: np.ndarray | None = None) -> np.ndarray:
        """Up to n tracked ids, least recently used first, among those where
        eligible[id] is True (a bool mask over ids; None = all tracked ids)."""
        stamp = self._stamp
        mask = stamp > 0
        if eligible is not None:
            k = min(len(eligible), len(stamp))
            mask = mask[:k] & eligible[:k]
        candidates = np.flatnonzero(mask)
        if n <= 0 or candidates.size == 0:
            return candidates[:0]
        if candidates.size > n:
            part = np.argpartition(stamp[candidates], n - 1)[:n]
            candidates = candidates[part]
        return candidates[np.argsort(stamp[candidates], kind="stable")]

    def stamp(self, ids: np.ndarray) -> np.ndarray:
        """The stamps of ids (0 = untracked); larger is more recent."""
        ids = np.asarray(ids, dtype=np.int64)
        out = np.zeros(ids.shape, dtype=np.int64)
        inside = ids < len(self._stamp)
        out[inside] = self._stamp[ids[inside]]
        return out


POLICY = LRUPolicy      # what eviction.load_policy("lru") builds
