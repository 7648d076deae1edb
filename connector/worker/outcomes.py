"""What a worker knows of loads' outcomes, and what that means for a save that names them.

A save computed over loads not yet known to have succeeded (SaveSpec.after) may be
committed only once every one of them is known good, and never if one failed: on this
rank (the worker saw it) or on another (the scheduler half, which hears every rank,
says so in StepMeta.loads_failed). Until then the save is held, its pages written but
not committed. Not thread-safe: the worker's thread only.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Iterable

__all__ = ["LoadOutcomes", "Verdict"]

# Outcomes remembered: a save names loads of its last few steps only, so the newest few
# thousand are plenty; a save naming a forgotten load is held until it is given up.
_KEPT = 4096


class Verdict(enum.Enum):
    COMMIT = "commit"    # every load it names succeeded (or it names none)
    HOLD = "hold"        # some are not known yet
    DROP = "drop"        # one failed: the pages were computed over KV that never arrived


class _Recent:
    """A set that forgets its oldest members beyond _KEPT."""

    def __init__(self) -> None:
        self._set: set[int] = set()
        self._order: collections.deque[int] = collections.deque()

    def add(self, item: int) -> None:
        if item not in self._set:
            self._set.add(item)
            self._order.append(item)
            while len(self._order) > _KEPT:
                self._set.discard(self._order.popleft())

    def __contains__(self, item: int) -> bool:
        return item in self._set


class LoadOutcomes:
    def __init__(self) -> None:
        self._ok = _Recent()
        self._failed = _Recent()

    def succeeded(self, load_ids: Iterable[int]) -> None:
        for load_id in load_ids:
            self._ok.add(load_id)

    def failed(self, load_ids: Iterable[int]) -> None:
        for load_id in load_ids:
            self._failed.add(load_id)

    def verdict(self, after: Iterable[int]) -> Verdict:
        pending = False
        for load_id in after:
            if load_id in self._failed:
                return Verdict.DROP
            if load_id not in self._ok:
                pending = True
        return Verdict.HOLD if pending else Verdict.COMMIT
