"""The slot table: per-slot columns of the DRAM pool, by slot id. Not thread-safe.

Columns, not objects: a request touches thousands of slots, and one numpy call over a
column costs what a Python attribute access costs per slot (pool.py says why ids).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from typing import ClassVar

import numpy as np

__all__ = ["SlotState", "SlotTable", "grown"]


class SlotState(enum.IntEnum):
    """A slot's state, in DRAM and on the disk tier alike (stored as uint8).

    WRITING: reserved (DRAM) or taken by the writer (disk), invisible to readers.
    DOOMED: deleted or evicted while pinned; freed when the last pin goes."""

    FREE = 0
    WRITING = 1
    READY = 2
    DOOMED = 3


# Plain ints for numpy stores: an IntEnum sends numpy's attribute probes through the
# enum's metaclass on every store.
_FREE, _WRITING = int(SlotState.FREE), int(SlotState.WRITING)


def grown(column: np.ndarray, size: int, fill: int | float = 0) -> np.ndarray:
    """A copy of column `size` long, its new tail set to fill."""
    new = np.full(size, fill, dtype=column.dtype)
    new[: len(column)] = column[:size]
    return new


# (layout, key size) as one integer, so a set of slots is grouped with one np.unique:
# a key size is 1..64, so 256 leaves room.
_GROUP = 256


class SlotTable:
    """What the store knows of each slot beyond its place in the pool."""

    # column name -> value of an unused slot
    _FILL: ClassVar[dict[str, int]] = {"state": SlotState.FREE, "pins": 0, "layout_of": -1, "committed_at": 0,
             "touched_at": 0, "key_size": 0, "mark": 0}

    def __init__(self, n: int = 1024) -> None:
        self.state = np.zeros(n, dtype=np.uint8)           # SlotState
        self.pins = np.zeros(n, dtype=np.int32)            # live leases holding each slot
        self.layout_of = np.full(n, -1, dtype=np.int32)    # LayoutInfo.idx, -1 when FREE
        # Seconds since start, float32 (4 bytes a page; precise to ~0.1 s after 10 days).
        self.committed_at = np.zeros(n, dtype=np.float32)
        self.touched_at = np.zeros(n, dtype=np.float32)
        self.key_size = np.zeros(n, dtype=np.uint8)        # which of the layout's indexes
        self.mark = np.zeros(n, dtype=np.int32)            # scratch of add_pins, no meaning

    def __len__(self) -> int:
        return len(self.state)

    def grow(self, n: int) -> None:
        """Room for slot ids below n (doubling, so growth is amortised)."""
        if n <= len(self.state):
            return
        size = max(n, 2 * len(self.state))
        for name, fill in self._FILL.items():
            setattr(self, name, grown(getattr(self, name), size, fill))

    def evictable(self, n: int) -> np.ndarray:
        """Mask over ids below n: READY and not pinned."""
        return (self.state[:n] == SlotState.READY) & (self.pins[:n] == 0)

    def take(self, slots: np.ndarray, layout: int, key_size: int) -> None:
        """Reserved slots: WRITING, pinned by their reservation, owned by a layout."""
        if len(slots) <= 8:          # a few: scalar stores, cheaper than 4 fancy ones
            for slot in slots.tolist():
                self.state[slot] = _WRITING
                self.pins[slot] += 1
                self.layout_of[slot] = layout
                self.key_size[slot] = key_size
            return
        self.state[slots] = _WRITING
        self.pins[slots] += 1
        self.layout_of[slots] = layout
        self.key_size[slots] = key_size

    def clear(self, slots: np.ndarray) -> None:
        self.state[slots] = _FREE
        self.layout_of[slots] = -1

    def clear_few(self, slots: list[int]) -> None:
        """clear() of a few slots given as a list: scalar stores."""
        state, layout_of = self.state, self.layout_of
        for slot in slots:
            state[slot] = _FREE
            layout_of[slot] = -1

    # A lease pins a slot once each time its key is named, and a request may name a key
    # twice. np.add.at counts repeats but costs many times what a fancy-indexed add does,
    # which counts a repeated slot once, and a leased Lookup of a long prompt pins and
    # releases thousands of slots. So repeats are looked
    # for first, in `mark`: each entry writes its position at its slot; a slot named twice
    # keeps only the last, so an earlier entry reads back another's position.
    def add_pins(self, slots: np.ndarray, delta: int) -> None:
        """pins[s] += delta for every entry s of slots (an id may repeat)."""
        if len(slots) > 1:
            at = np.arange(len(slots), dtype=np.int32)
            self.mark[slots] = at
            if not np.array_equal(self.mark[slots], at):
                np.add.at(self.pins, slots, delta)
                return
        self.pins[slots] += delta

    def groups(self, slots: np.ndarray) -> Iterator[tuple[int, int, np.ndarray]]:
        """(layout idx, key size, its slots) for each of the slots' (layout, key size)."""
        group = self.layout_of[slots].astype(np.int64) * _GROUP + self.key_size[slots]
        for g in np.unique(group).tolist():
            yield g // _GROUP, g % _GROUP, slots[group == g]
