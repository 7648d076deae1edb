"""Lookups: how long a prefix of keys is stored, counted per layout, touched, leased if asked.

A part of the store (store.py says what each part is): it owns no state of its own, and
works on the store's shared state (StoreState) with the lease book (a leased lookup pins
its DRAM pages) and the tier below (a prefix's reach past DRAM, asked outside the lock).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvstore_protocol.keys import Packed
from kvstore_protocol.layout import MAX_LOOKUP_LAYOUTS

from ..errors import Outcome, StoreError
from .below import Below
from .index import FEW_KEYS, FEW_READS
from .layouts import LayoutInfo
from .lease_book import LeaseBook
from .leases import LeaseKind
from .state import StoreState

__all__ = ["Lookups"]


class Lookups:
    """The store's lookups and exists over its shared state."""

    def __init__(self, state: StoreState, book: LeaseBook, below: Below) -> None:
        self._s = state
        self._book = book
        self._below = below

    def lookup(self, layout_ids: Sequence[bytes], keys: Packed | Sequence[bytes],
               lease_ttl: float = 0.0) -> tuple[int, int]:
        """(leading keys present in every layout, lease id or 0)."""
        keys = Packed.of(keys)
        if len(layout_ids) == 1 and keys.n <= FEW_READS:
            found = self._lookup_one(layout_ids[0], keys, lease_ttl)
            if found is not None:
                return found
        count, lease_id, _ = self._lookup(layout_ids, keys, lease_ttl, offsets=False)
        return count, lease_id

    # An engine's own lookup: its rank's one layout, a block of keys or a prompt's up to
    # FEW_READS (2,048 tokens in 16-token pages), leased or not. _lookup's general form (a
    # list of layouts made unique, a run per layout, the count taken over them) cost more
    # than the finds and touches it wraps: in one process, 9.4 us for 16 keys without a
    # lease against 5.6 here, the same work done, and 26-51 us for 32 to 128 keys
    # against 5-6 here (a prompt asked again: its run remembered, KeyIndex.find_leading).
    def _lookup_one(self, layout_id: bytes, keys: Packed, lease_ttl: float
                    ) -> tuple[int, int] | None:
        """_lookup of one layout and up to FEW_READS keys: (count, lease id or 0), hits
        and misses counted, the run touched and leased where asked; None where a tier
        below holds pages (its reach is asked outside the lock: _lookup's way)."""
        s = self._s
        with s.lock:
            if s.lower.holds_pages:
                return None
            info = s.layouts.info(layout_id)
            index = info.ready.get(keys.size)
            slots = index.find_leading(keys.data) if index is not None and keys.n else []
            count = len(slots)
            info.hits += count
            info.misses += keys.n - count
            if not count:
                return 0, 0
            s.touch_few(slots)
            if lease_ttl <= 0:
                return count, 0
            pinned = np.array(slots, dtype=np.int64)
            count, lease_id, _ = self._lease([info], [pinned], [pinned], count, lease_ttl,
                                             offsets=False)
            return count, lease_id

    def lookup_pinned(self, layout_ids: Sequence[bytes], keys: Packed | Sequence[bytes],
                      lease_ttl: float = 0.0) -> tuple[int, int, list[np.ndarray]]:
        """Like lookup, and where the counted pages lie: per distinct layout (in the order
        first named) the pool byte offset of each of the `count` pages, -1 for one on the
        tier below (counted, not leased: Acquire reads it back). [] without a lease."""
        return self._lookup(layout_ids, keys, lease_ttl, offsets=True)

    def _lookup(self, layout_ids: Sequence[bytes], keys: Packed | Sequence[bytes],
                lease_ttl: float, offsets: bool) -> tuple[int, int, list[np.ndarray]]:
        keys = Packed.of(keys)
        if not layout_ids:
            raise StoreError(Outcome.INVALID, "lookup needs at least one layout_id")
        if len(layout_ids) > MAX_LOOKUP_LAYOUTS:
            # Each layout costs a full pass over the keys under the lock: uncapped, one
            # request of thousands of ids held it far longer than any call should (found by fuzzing).
            raise StoreError(Outcome.INVALID, f"lookup names {len(layout_ids)} layouts; at "
                                              f"most {MAX_LOOKUP_LAYOUTS} (one per rank)")
        layout_ids = list(dict.fromkeys(layout_ids))     # a repeated id counts once
        s = self._s
        with s.lock:
            infos = [s.layouts.info(layout_id) for layout_id in layout_ids]
            if not s.lower.holds_pages and len(keys) <= FEW_KEYS:
                leading = self._find_leading(infos, keys)
                if not leading:
                    return self._missed(infos, len(keys))
                count = min(map(len, leading))
                return self._count_few(infos, keys, [f[:count] for f in leading], count,
                                       lease_ttl, offsets)
            # One key is found once: its own find says whether it is absent.
            if not s.lower.holds_pages and len(keys) > 1 and self._first_absent(infos, keys):
                return self._missed(infos, len(keys))
            if not s.lower.holds_pages:
                # Each layout's leading run alone: a prefix mostly absent past its head
                # probes none of its absent keys (KeyIndex.find_run).
                found = [s.find_run(info, keys) for info in infos]
                return self._count_and_lease(infos, keys, found, min(map(len, found)),
                                             lease_ttl, offsets)
            found = [s.find(info, keys) for info in infos]
        # The tier below is asked outside the store's lock: it has its own, and its probe
        # costs a dict lookup a key (a Lookup of 60 M keys held the store's lock seconds).
        count = min(self._below.reach(info, keys, slots) for info, slots
                    in zip(infos, found, strict=True))
        run = keys if count == len(keys) else Packed(keys.data[:count * keys.size], keys.size)
        with s.lock:
            # Find the run's DRAM pages again, to touch and pin them in this hold: one
            # may have moved down meanwhile (it is then read back by Acquire, like any
            # page of the run on the tier below).
            found = [s.find(info, run) for info in infos]
            return self._count_and_lease(infos, keys, found, count, lease_ttl, offsets)

    def count_misses(self, layout_ids: Sequence[bytes], n: int) -> None:
        """n keys a client counted as missed on its own, from the presence map
        (kvstore_server.store.presence): misses of each of these layouts registered here."""
        with self._s.lock:
            self._missed([info for layout_id in dict.fromkeys(layout_ids)
                          if (info := self._s.layouts.get(layout_id)) is not None], n)

    # A prefix whose first key is absent counts 0, found from that key alone. The batch
    # path's ~25 numpy calls cost little warm but much with the caches cold, as a request
    # after idle finds them: a lookup that hits nothing took several times longer through
    # the batch than here, cold or warm (in-process runs side by side).
    @staticmethod
    def _first_absent(infos: list[LayoutInfo], keys: Packed) -> bool:
        """Whether some layout lacks the first key in DRAM (False for no keys)."""
        if not len(keys):
            return False
        first = keys.data[:keys.size]
        for info in infos:
            index = info.ready.get(keys.size)
            if index is None or index.find_one(first) < 0:
                return True
        return False

    # A few keys (an engine's per-block or per-layer call): each layout's leading run by
    # KeyIndex.find_leading (its first key alone, so a prefix missing it counts 0 with
    # nothing more hashed; a run asked again, remembered), as Python lists up to the
    # first absent key: the array forms (_first_absent, then find and a count of its
    # leading slots) cost about as much again as the finds.
    @staticmethod
    def _find_leading(infos: list[LayoutInfo], keys: Packed) -> list[list[int]]:
        """Each layout's slots of the leading keys it holds, as many as every layout
        before it holds too; [] when some layout lacks the first key (or no keys)."""
        size, data = keys.size, keys.data
        count = len(keys)
        out = []
        for info in infos:
            index = info.ready.get(size)
            if index is None or not count:
                return []
            slots = index.find_leading(data[:count * size])
            if not slots:
                return []
            count = len(slots)
            out.append(slots)
        return out

    @staticmethod
    def _missed(infos: list[LayoutInfo], n: int) -> tuple[int, int, list[np.ndarray]]:
        """A lookup of n keys that counted none: its misses, no touch, no lease."""
        for info in infos:
            info.misses += n
        return 0, 0, []

    def _count_and_lease(self, infos: list[LayoutInfo], keys: Packed, found: list[np.ndarray],
                         count: int, lease_ttl: float, offsets: bool
                         ) -> tuple[int, int, list[np.ndarray]]:
        """Count the hits, touch the run's DRAM pages, and lease them if asked: the
        pages of the tier below are counted, not leased; Acquire reads them back.
        Returns (count, lease id or 0, offsets per layout if asked: see lookup_pinned)."""
        s = self._s
        run = [slots[:count] for slots in found]
        # Without a tier below, every page of the run is in DRAM (count stops at the
        # first one absent): no mask to take.
        dram = [slots[slots >= 0] for slots in run] if s.lower.holds_pages else run
        for info, run_slots in zip(infos, dram, strict=True):
            info.hits += count
            info.misses += len(keys) - count
            s.touch(run_slots)
        return self._lease(infos, run, dram, count, lease_ttl, offsets)

    def _count_few(self, infos: list[LayoutInfo], keys: Packed, run: list[list[int]],
                   count: int, lease_ttl: float, offsets: bool
                   ) -> tuple[int, int, list[np.ndarray]]:
        """_count_and_lease of a few keys' runs (count >= 1 each, all in DRAM), as lists:
        the hits counted and the pages touched with no array made (StoreState.touch_few);
        arrays only for a lease, which keeps its slots as one."""
        s = self._s
        for info, slots in zip(infos, run, strict=True):
            info.hits += count
            info.misses += len(keys) - count
            s.touch_few(slots)
        if lease_ttl <= 0:
            return count, 0, []
        arrays = [np.array(slots, dtype=np.int64) for slots in run]
        return self._lease(infos, arrays, arrays, count, lease_ttl, offsets)

    def _lease(self, infos: list[LayoutInfo], run: list[np.ndarray], dram: list[np.ndarray],
               count: int, lease_ttl: float, offsets: bool
               ) -> tuple[int, int, list[np.ndarray]]:
        """The lease on a lookup's counted DRAM pages (dram: each layout's), where asked:
        (count, lease id or 0, the run's offsets per layout if asked)."""
        s, book = self._s, self._book
        pinned = dram[0] if len(dram) == 1 else np.concatenate(dram)
        if lease_ttl <= 0 or not pinned.size:
            return count, 0, []
        if not book.may_lease(pinned.size):
            book.full("a leased Lookup answered without a lease")
            return count, 0, []
        book.pin(pinned)                            # a key may repeat: pinned as often
        lease_id = book.table.grant(LeaseKind.READ, pinned, lease_ttl,
                                    owner=infos[0].tenant).lease_id
        if not offsets:
            return count, lease_id, []
        offset = s.pool.offset
        return count, lease_id, [np.where(s >= 0, offset[np.maximum(s, 0)], -1) for s in run]

    def exists(self, layout_id: bytes, keys: Packed | Sequence[bytes]) -> np.ndarray:
        """One bool per key: stored in this layout, in DRAM or on the tier below."""
        keys = Packed.of(keys)
        s = self._s
        with s.lock:
            info = s.layouts.info(layout_id)
            present = s.find(info, keys) >= 0
        missing = np.flatnonzero(~present)
        if missing.size and s.lower.holds_pages:
            # Outside the store's lock, as in lookup.
            present[missing] = s.lower.contains(info.layout_id, keys.select(missing))
        return present
