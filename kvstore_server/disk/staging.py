"""The disk tier's write-behind queue: staged page copies in a ring over one arena.

Not thread-safe: the disk tier calls it under its lock. An offer copies its page into
the arena (outside the lock, into space taken here) and returns; the writer takes the
oldest ready entries in batches and frees them in the order they were taken, so the used
part of the arena is one run [tail, head) that may wrap once. The arena is one untouched
mapping made at start, so memory is used only as pages queue.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from .slotfile import ALIGN, aligned_buffer

__all__ = ["Pending", "StagingRing"]

# A write batch: one round of the writer's bookkeeping (written 8 MiB a call).
BATCH_BYTES = 16 << 20
BATCH_PAGES = 256


@dataclasses.dataclass(slots=True, eq=False)
class Pending:
    """A page offered and not yet written: its slot image is arena[off : off + slot_bytes]."""

    layout_id: bytes
    key: bytes
    off: int
    nbytes: int
    slot_bytes: int
    ready: bool = False         # the offer's copy into the arena has finished
    cancelled: bool = False     # deleted, evicted or dropped while queued: do not write


class StagingRing:
    """Pages offered and not yet written, oldest first, and where each one's copy is."""

    def __init__(self, nbytes: int) -> None:
        self.arena: np.ndarray = aligned_buffer(nbytes // ALIGN * ALIGN)
        self.ring: collections.deque[Pending] = collections.deque()     # FIFO, oldest first
        self.head = 0                       # next free byte of the ring
        self.queued: dict[bytes, dict[bytes, Pending]] = {}   # layout -> key -> pending

    def __len__(self) -> int:
        return len(self.arena)

    def find(self, layout_id: bytes, key: bytes) -> Pending | None:
        return self.queued.get(layout_id, {}).get(key)

    def push(self, entry: Pending) -> None:
        self.ring.append(entry)
        self.queued.setdefault(entry.layout_id, {})[entry.key] = entry

    def alloc(self, nbytes: int) -> int:
        """Offset of nbytes free in the arena, or -1. Writes free in FIFO order, so the
        used part is one run [tail, head) that may wrap once."""
        size = len(self.arena)
        tail = self.ring[0].off if self.ring else size
        if not self.ring:
            self.head = 0
        if not self.ring or self.head > tail:     # free: [head, size) and [0, tail)
            if self.head + nbytes <= size:
                off = self.head
            elif nbytes <= tail:
                off = 0                             # wrap; the end's leftover stays unused
            else:
                return -1
        elif self.head + nbytes <= tail:           # wrapped: free is [head, tail)
            off = self.head
        else:
            return -1
        self.head = off + nbytes
        return off

    def pending(self) -> int:
        """Entries still to write (not cancelled)."""
        return sum(1 for e in self.ring if not e.cancelled)

    def take_batch(self) -> list[Pending]:
        """The oldest ready entries, a write batch of them; they stay queued until done."""
        batch: list[Pending] = []
        nbytes = 0
        for entry in self.ring:
            if not entry.ready or len(batch) == BATCH_PAGES or nbytes > BATCH_BYTES:
                break
            batch.append(entry)
            nbytes += entry.slot_bytes
        return batch

    def done(self, batch: list[Pending]) -> None:
        """The batch was written (or lost): forget it and free its arena space."""
        for entry in batch:
            queued = self.queued.get(entry.layout_id, {})
            if queued.get(entry.key) is entry:
                del queued[entry.key]
        if self.ring and self.ring[0] is batch[0]:    # else cancel_all emptied it
            for _ in batch:
                self.ring.popleft()

    def cancel_all(self) -> int:
        """Drop every queued entry; returns how many were still to write."""
        dropped = 0
        for entry in self.ring:
            dropped += not entry.cancelled
            entry.cancelled = True
        self.ring.clear()
        self.queued.clear()
        return dropped
