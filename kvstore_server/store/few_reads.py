"""Gets of a few keys whose pages are all in DRAM, pinned and unpinned as Python ints.

A Get of a page or a block (an engine's per-layer and per-block calls) is the common
call over the fast path, and the generic pin (Store.pin_read) builds for it what a Get
of thousands needs: arrays of slots and offsets, a values object, numpy's batch forms of
the pin, the touch and the unpin, each a few calls into numpy that cost as much for one
key as for hundreds. Here, for up to FEW_READS keys, one hold of the lock finds, pins and
touches them as Python ints, and one more unpins them (pages stored side by side, as a
Put's are, by slices; SCATTERED_FROM or more scattered, by one fancy-indexed array):

    pin   find_few -> every key READY? -> touched now, counted served
                                      -> used at once (`now`)? done: nothing pinned
                                      -> else pins += 1 each
                                      -> else None: the caller takes pin_read's way
                                         (a read-back from below, or NOT_FOUND)
    unpin pins -= 1 each; a DOOMED page (deleted or evicted while sent) goes free with
          its last pin, as LeaseBook.unpin frees it

The pins are the same pins pin_read takes: no eviction, delete or put reuses a pinned
slot until its unpin, so the caller sends the pages' bytes after the lock is dropped. The
stats count such a read as a lease (LeaseBook.reading), as they count pin_read's.

`now` lets a caller use the pages before the lock is dropped, where it can do so without
waiting: the fast path's one-page Get hands the kernel its answer with a send that never
blocks (MSG_DONTWAIT), and the kernel has copied every byte of it when the send returns
whole. Its pages then need no pin, and the Get holds the lock once, not twice; a send cut
short pins them as above, and the rest is sent after. The hold grows by that one send of
a bounded size (the caller's to bound), which never waits for the peer.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvstore_protocol.keys import Packed

from .evict import Eviction
from .index import FEW_READS
from .layouts import LayoutInfo
from .lease_book import LeaseBook
from .slots import SlotState
from .state import SCATTERED_FROM, StoreState, side_by_side

__all__ = ["FewReads"]

_DOOMED = int(SlotState.DOOMED)


class FewReads:
    """pin and unpin of up to FEW_READS keys all in DRAM (see the module docstring)."""

    def __init__(self, s: StoreState, book: LeaseBook, eviction: Eviction) -> None:
        self._s = s
        self._book = book
        self._eviction = eviction

    def pin(self, layout_id: bytes, keys: Packed,
            now: Callable[[LayoutInfo, list[int]], bool] | None = None
            ) -> tuple[LayoutInfo, list[int], list[int]] | None:
        """(layout, slots, pool offsets) of keys all READY in DRAM, pinned; None where one
        is not (nothing pinned), or for more than FEW_READS keys or none. now(layout,
        offsets): called under the lock; True when it has used the pages whole, and then
        nothing is pinned (slots is [], and there is nothing to unpin)."""
        n = keys.n
        if not 0 < n <= FEW_READS:
            return None
        s = self._s
        with s.lock:
            info = s.layouts.info(layout_id)
            index = info.ready.get(keys.size)
            if index is None:
                return None
            slots = index.find_few(keys.data)
            if -1 in slots:
                return None
            run = side_by_side(slots)       # slices, not a store per slot
            first = slots[0]
            scattered = None
            if run:
                s.touch_span(first, n)
                offsets = s.pool.offset[first:first + n].tolist()
            elif n < SCATTERED_FROM:
                s.touch_few(slots)
                offset = s.pool.offset
                offsets = [int(offset[slot]) for slot in slots]
            else:                           # a store per slot would cost more
                scattered = np.array(slots, dtype=np.int64)
                s.touch(scattered)
                offsets = s.pool.offset[scattered].tolist()
            info.bytes_out += n * info.page_bytes
            info.served += n
            if now is not None and now(info, offsets):
                return info, [], offsets
            pins = s.slots.pins
            if run:
                pins[first:first + n] += 1
            elif scattered is not None:
                self._book.pin(scattered)       # a slot named twice, twice
            else:
                for slot in slots:          # a slot named twice is pinned twice
                    pins[slot] += 1
            self._book.reading += 1
            return info, slots, offsets

    def unpin(self, slots: list[int]) -> None:
        """End a pin: one pin fewer on each slot; a DOOMED slot's last goes free."""
        if not slots:                       # used under the lock: nothing pinned
            return
        s = self._s
        with s.lock:
            self._book.reading -= 1
            pins, state = s.slots.pins, s.slots.state
            if side_by_side(slots):
                first, end = slots[0], slots[0] + len(slots)
                pins[first:end] -= 1
                # DOOMED is rare (a page deleted or evicted while sent): one read says
                # (of a list: `in` on the array itself costs several times more).
                if _DOOMED in state[first:end].tolist():
                    freed = [slot for slot in slots if not pins[slot] and state[slot] == _DOOMED]
                    if freed:
                        self._eviction.free(freed)
                return
            if len(slots) >= SCATTERED_FROM:   # as a lease's: one array
                self._book.unpin(np.array(slots, dtype=np.int64))
                return
            freed = []
            for slot in slots:
                left = pins[slot] - 1
                pins[slot] = left
                if left == 0 and state[slot] == _DOOMED:
                    freed.append(slot)
            if freed:
                self._eviction.free(freed)
