"""A lock that measures how long it is held: the store's bound on lock holds, checked.

Every request takes the store's one lock, so the longest hold is the longest any call can
be held up by another (a Lookup of 60 M keys once held it for seconds). The limits on a
request (rpc/limits.py) bound that hold; this lock shows the bound holds in production too:
`kvstore_store_lock_hold_seconds` (a histogram) and its maximum, on /metrics.

It costs two perf_counter calls and a bucket search per hold, a small fraction of the
work done under the lock by the cheapest call.
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
import time

__all__ = ["BUCKETS", "LockHolds", "TimedLock"]

# Upper bounds of the histogram's buckets, in seconds (the last bucket is +Inf).
BUCKETS = (1e-4, 1e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)
_FIRST = BUCKETS[0]


@dataclasses.dataclass(frozen=True, slots=True)
class LockHolds:
    """How long the lock was held, since start: counts[i] holds of at most BUCKETS[i]
    seconds (and above the bucket before), counts[-1] the longer ones."""

    counts: tuple[int, ...]
    total_seconds: float
    max_seconds: float


class TimedLock:
    """threading.Lock with a histogram of hold times. Use it as a context manager."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since = 0.0
        # Written by the holder only, so they need no lock of their own.
        self._counts = [0] * (len(BUCKETS) + 1)
        self._total = 0.0
        self._max = 0.0

    def __enter__(self) -> TimedLock:
        self._lock.acquire()
        self._since = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        held = time.perf_counter() - self._since
        # Nearly every hold falls in the first bucket: one compare, not a search.
        self._counts[0 if held <= _FIRST else bisect.bisect_left(BUCKETS, held)] += 1
        self._total += held
        if held > self._max:
            self._max = held
        self._lock.release()

    def holds(self) -> LockHolds:
        """A snapshot (read without the lock: a count may be one behind)."""
        return LockHolds(tuple(self._counts), self._total, self._max)
