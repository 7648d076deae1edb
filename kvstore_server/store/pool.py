"""Slots in the shared region: fixed-size slots per size class, carved in extents.

The region is cut into slabs of `slab_bytes` (8 MiB, or a power of two about a quarter
of a small region).
A size class (one per distinct slot size, i.e. per page size rounded up to 4 KiB) takes
an *extent* of one or more contiguous slabs when it runs out of slots, and cuts it into
equal slots; when every slot of an extent is free again the slabs go back to the region,
so a layout that stops being used hands its memory to the others. Nothing is allocated
on the request path but list pops: the region is one mapping made at start.

    region:  | slab 0 | slab 1 | slab 2 | slab 3 | slab 4 | ...
    extents: [ class A: 128 slots of 64 KiB ][ class B: 2 slots of 4 MiB ][ free ...

Slot ids are small integers, recycled, so per-slot state can live in flat numpy arrays
(`offset`, `cls`) instead of one Python object per page: that keeps the index under
200 bytes a page. Not safe for concurrent use: the store's lock guards it.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import numpy as np

__all__ = ["SLOT_ALIGN", "Pool"]

SLOT_ALIGN = 4096           # slots start on page boundaries (O_DIRECT, DMA friendly)
_DEFAULT_SLAB = 8 << 20
_MAX_EXTENT_SLABS = 8


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


@dataclasses.dataclass(slots=True)
class _Extent:
    cls: int
    first_slab: int
    n_slabs: int
    ids: np.ndarray         # slot ids of this extent
    free: list[int]         # ids not in use


@dataclasses.dataclass(slots=True)
class _SizeClass:
    slot_bytes: int
    extent_slabs: int       # slabs per extent, chosen to waste the least
    slots_per_extent: int
    # Extents with free slots, in the order they joined; alloc takes from the first. An
    # OrderedDict: a dict's first key is found past every entry deleted before it, and
    # alloc deletes extents from the front as they fill, so refilling a pool whose
    # extents were all part free (7,813 extents of 64 KiB slots, 64 GiB) took an alloc
    # of 8 slots from 3.5 to 9.4 us as it went (medians of each quarter of the refill);
    # with this, 2.7-2.9 us throughout.
    partial: OrderedDict[int, None] = dataclasses.field(default_factory=OrderedDict)


class Pool:
    """Allocates slots of per-class sizes from a region of `size` bytes."""

    def __init__(self, size: int, slab_bytes: int | None = None, base: int = 0) -> None:
        """size: bytes to carve; base: offset of the first slab in the region."""
        self.base = base
        if slab_bytes is None:
            # A power of two, so power-of-two pages tile slabs with no waste.
            slab_bytes = min(_DEFAULT_SLAB, 1 << max(12, (size // 4).bit_length() - 1))
        self.slab_bytes = slab_bytes
        self.n_slabs = size // slab_bytes
        self.capacity_bytes = self.n_slabs * slab_bytes
        self._slab_free = np.ones(self.n_slabs, dtype=bool)
        self._classes: list[_SizeClass] = []
        self._class_extents: list[int] = []           # size class -> extents it holds
        self.class_bytes = np.zeros(0, dtype=np.int64)   # size class -> slot bytes
        self._class_by_size: dict[int, int] = {}
        self._extents: dict[int, _Extent] = {}       # extent id -> extent
        self._next_extent = 0
        self.offset = np.zeros(1024, dtype=np.int64)  # slot id -> byte offset in region
        self.cls = np.full(1024, -1, dtype=np.int32)  # slot id -> size class (-1 = none)
        self._extent_of = np.zeros(1024, dtype=np.int32)
        self._spare_ids: list[int] = []               # ids of released extents, reused first
        self._parked: dict[int, int] = {}             # size class -> its parked extent's id
        self._next_id = 0
        self.used_bytes = 0                           # bytes of slots handed out

    # -- size classes ---------------------------------------------------------------
    def class_for(self, page_bytes: int) -> int:
        """The size class for pages of this size, created on first use."""
        slot = _round_up(page_bytes, SLOT_ALIGN)
        if slot > self.slab_bytes * min(_MAX_EXTENT_SLABS, self.n_slabs):
            raise ValueError(f"page of {page_bytes} bytes does not fit the pool "
                             f"(largest slot: {self.slab_bytes * min(_MAX_EXTENT_SLABS, self.n_slabs)} bytes)")
        if slot not in self._class_by_size:
            best: tuple[float, int] | None = None
            for k in range(1, min(_MAX_EXTENT_SLABS, self.n_slabs) + 1):
                span = k * self.slab_bytes
                if span < slot:
                    continue
                waste = (span % slot) / span
                if best is None or waste < best[0] - 0.02:
                    best = (waste, k)
            if best is None:            # unreachable: the check above found a span
                raise ValueError(f"page of {page_bytes} bytes does not fit the pool")
            k = best[1]
            self._class_by_size[slot] = len(self._classes)
            self._classes.append(_SizeClass(slot, k, k * self.slab_bytes // slot))
            self._class_extents.append(0)
            self.class_bytes = np.array([c.slot_bytes for c in self._classes], dtype=np.int64)
        return self._class_by_size[slot]

    def slot_bytes(self, cls: int) -> int:
        return self._classes[cls].slot_bytes

    def extent_bytes(self, cls: int) -> int:
        """Bytes of one extent of class cls: what its next new extent takes from the region."""
        return self._classes[cls].extent_slabs * self.slab_bytes

    def free_slots(self, cls: int) -> int:
        """Slots of class cls free in its extents: how many it can hand out with no new one."""
        return sum(len(self._extents[e].free) for e in self._classes[cls].partial)

    def class_extent_bytes(self, cls: int) -> int:
        """Bytes of the extents class cls holds now."""
        return self._class_extents[cls] * self.extent_bytes(cls)

    @property
    def num_classes(self) -> int:
        return len(self._classes)

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    @property
    def id_capacity(self) -> int:
        """One past the largest slot id ever handed out (size of per-slot arrays)."""
        return self._next_id

    # -- allocation -----------------------------------------------------------------
    def alloc(self, cls: int, n: int) -> np.ndarray:
        """Up to n free slot ids of class cls; fewer (maybe none) when the region is full."""
        c = self._classes[cls]
        out: list[int] = []
        while len(out) < n:
            if c.partial:
                ext = self._extents[next(iter(c.partial))]
            else:
                new = self._new_extent(cls)
                if new is None:
                    break
                ext = new
            take = min(n - len(out), len(ext.free))
            out.extend(ext.free[-take:])
            del ext.free[-take:]
            if not ext.free:
                c.partial.pop(self._extent_id(ext), None)
        self.used_bytes += len(out) * c.slot_bytes
        ids = np.array(out, dtype=np.int64)
        if len(out) < 2:
            return ids
        # In offset order, so the pages of one put lie in adjacent slots wherever the free
        # slots allow: a reader then moves a run of pages with one copy (one cudaMemcpy
        # instead of one per page; see bench/shm_bench.py, "pool runs").
        return ids[np.argsort(self.offset[ids], kind="stable")]

    def free(self, ids: np.ndarray | list[int]) -> None:
        """Return slots; an extent whose slots are all free goes back to the region."""
        for slot in ids if isinstance(ids, list) else np.asarray(ids, dtype=np.int64).tolist():
            ext_id = int(self._extent_of[slot])
            ext = self._extents[ext_id]
            c = self._classes[ext.cls]
            ext.free.append(slot)
            self.used_bytes -= c.slot_bytes
            c.partial[ext_id] = None
            if len(ext.free) == len(ext.ids):
                self._park(ext_id)

    def can_grow(self, cls: int) -> bool:
        """Whether a new extent for cls would fit in the free slabs right now."""
        return self._find_run(self._classes[cls].extent_slabs) is not None

    # -- extents --------------------------------------------------------------------
    def _extent_id(self, ext: _Extent) -> int:
        return int(self._extent_of[int(ext.ids[0])])

    def _find_run(self, k: int) -> int | None:
        free = self._slab_free
        if k == 1:
            hits = np.flatnonzero(free)
            return int(hits[0]) if hits.size else None
        # Start of the first run of k free slabs: a window sum equal to k.
        window = np.convolve(free.astype(np.int32), np.ones(k, dtype=np.int32), "valid")
        hits = np.flatnonzero(window == k)
        return int(hits[0]) if hits.size else None

    def _new_ids(self, n: int) -> np.ndarray:
        ids: list[int] = []
        while self._spare_ids and len(ids) < n:
            ids.append(self._spare_ids.pop())
        fresh = n - len(ids)
        if fresh:
            ids.extend(range(self._next_id, self._next_id + fresh))
            self._next_id += fresh
            if self._next_id > len(self.offset):
                grow = max(self._next_id, 2 * len(self.offset))
                for name, fill in (("offset", 0), ("cls", -1), ("_extent_of", 0)):
                    old = getattr(self, name)
                    new = np.full(grow, fill, dtype=old.dtype)
                    new[: len(old)] = old
                    setattr(self, name, new)
        return np.array(ids, dtype=np.int64)

    def _new_extent(self, cls: int) -> _Extent | None:
        c = self._classes[cls]
        parked = self._parked.pop(cls, None)
        if parked is not None:                  # its slabs are still free: taken back
            ext = self._extents[parked]
            self._slab_free[ext.first_slab:ext.first_slab + ext.n_slabs] = False
            c.partial[parked] = None
            self._class_extents[cls] += 1
            return ext
        first = self._find_run(c.extent_slabs)
        if first is None:
            return None
        for other, ext_id in list(self._parked.items()):     # a parked one under the run
            ext = self._extents[ext_id]
            if first < ext.first_slab + ext.n_slabs and ext.first_slab < first + c.extent_slabs:
                del self._parked[other]
                self._release_extent(ext_id)
        self._slab_free[first:first + c.extent_slabs] = False
        ids = self._new_ids(c.slots_per_extent)
        base = self.base + first * self.slab_bytes
        ext_id = self._next_extent
        self._next_extent += 1
        self.offset[ids] = base + np.arange(len(ids), dtype=np.int64) * c.slot_bytes
        self.cls[ids] = cls
        self._extent_of[ids] = ext_id
        ext = _Extent(cls, first, c.extent_slabs, ids, ids[::-1].tolist())
        self._extents[ext_id] = ext
        c.partial[ext_id] = None
        self._class_extents[cls] += 1
        return ext

    # An extent whose slots all came free goes back to the region at once: its slabs
    # are free, the class no longer counts it. But its ids and offsets stay made, and the
    # class's next new extent takes it back (no run to find, no ids to make: a put that
    # lands in an empty class, and a delete that empties it, made and unmade a whole
    # extent each time, ids and all). Only when another class's new extent is given its
    # slabs are its ids given up (_release_extent). One parked extent per class.
    def _park(self, ext_id: int) -> None:
        """The extent's slabs back to the region, its ids kept for its class's next extent."""
        ext = self._extents[ext_id]
        earlier = self._parked.get(ext.cls)
        if earlier is not None:
            self._release_extent(earlier)
        self._parked[ext.cls] = ext_id
        self._classes[ext.cls].partial.pop(ext_id, None)
        self._class_extents[ext.cls] -= 1
        self._slab_free[ext.first_slab:ext.first_slab + ext.n_slabs] = True

    def _release_extent(self, ext_id: int) -> None:
        """A parked extent's ids go back to the spares (its slabs are free already)."""
        ext = self._extents.pop(ext_id)
        self.cls[ext.ids] = -1
        self._spare_ids.extend(ext.ids.tolist())
