"""The disk tier's slots: ids, their columns, free lists, the index, and eviction.

Not thread-safe: the disk tier calls it under its lock. A slot id names one slot of one
slot file (SlotFile); its state and header fields live in flat columns, as in the DRAM
slot table (slots.py), and its state is the same SlotState.
"""

from __future__ import annotations

import heapq
import logging
import os
from collections.abc import Callable
from typing import cast

import numpy as np

from ..store.eviction import EvictionPolicy, enough
from ..store.slots import SlotState, grown
from .slotfile import CORRUPT, SUFFIX, VALID, SlotFile

__all__ = ["DiskSlots"]

log = logging.getLogger("kvstore_server.disk")

FREE, WRITING, READY, DOOMED = SlotState

_COLUMNS = ("state", "pins", "sbytes", "idx", "gen", "plen", "pxxh")


class DiskSlots:
    """Every slot of the tier's files, and which page each READY one holds."""

    def __init__(self, capacity_bytes: int, policy: EvictionPolicy,
                 on_free: Callable[[], None]) -> None:
        """on_free: called when a slot is freed (the writer blanks it; a delete waits)."""
        self.capacity_bytes = capacity_bytes
        self.policy = policy
        self.on_free = on_free
        self.files: dict[int, SlotFile] = {}                    # slot bytes -> file
        self.free: dict[int, list[int]] = {}                    # slot bytes -> heap of ids
        # ^ lowest id first keeps files dense and new slots adjacent, so pages evicted
        #   together are written, and later read, with one call a run
        self.index: dict[bytes, dict[bytes, int]] = {}          # layout -> key -> READY id
        self.state = np.zeros(0, dtype=np.uint8)       # SlotState
        self.pins = np.zeros(0, dtype=np.int32)        # reads in flight on each slot
        self.sbytes = np.zeros(0, dtype=np.int64)      # slot size (0 = no slot yet)
        self.idx = np.zeros(0, dtype=np.int64)         # slot number within its file
        self.gen = np.zeros(0, dtype=np.uint64)
        self.plen = np.zeros(0, dtype=np.int64)        # payload bytes
        self.pxxh = np.zeros(0, dtype=np.uint64)       # payload checksum
        self.file_of: list[SlotFile] = []
        self.name_of: list[tuple[bytes, bytes] | None] = []     # (layout, key) if READY
        self.discard: set[int] = set()     # freed ids whose slots are still to be blanked
        # (layout, key) of pages forgotten here -> the writer round current when they were:
        # their slots may still hold them until the next round ends. A delete of one must
        # wait for that round though it no longer holds the page (DiskTier._durable).
        # Pruned as rounds end, so it holds at most the pages freed in about one round.
        self.unblanked: dict[tuple[bytes, bytes], int] = {}
        self.next_gen = 1
        self.used = 0                      # bytes of slots not FREE
        self.pages = 0

    def new_ids(self, file: SlotFile, first: int, n: int) -> np.ndarray:
        """Ids for slots first..first+n-1 of file. The arrays grow by doubling; ids past
        the last one handed out are FREE with size 0, so masks over them select nothing."""
        start = len(self.file_of)
        if start + n > len(self.state):
            size = max(start + n, 2 * len(self.state), 1024)
            for name in _COLUMNS:
                setattr(self, name, grown(getattr(self, name)[:start], size))
        self.sbytes[start:start + n] = file.slot_bytes
        self.idx[start:start + n] = np.arange(first, first + n)
        self.file_of.extend([file] * n)
        self.name_of.extend([None] * n)
        return np.arange(start, start + n)

    def alloc(self, slot_bytes: int) -> int:
        free = self.free[slot_bytes]
        if free:
            sid = heapq.heappop(free)
            self.discard.discard(sid)      # about to be overwritten: no need to blank
        else:
            file = self.files[slot_bytes]
            sid = int(self.new_ids(file, file.n_slots, 1)[0])
            file.n_slots += 1
        self.state[sid] = WRITING
        self.used += slot_bytes
        return sid

    def drop(self, sid: int, round_: int) -> None:
        """Forget a READY page: its slot is freed now, or when the reads pinning it end."""
        name = self.name_of[sid]
        if name is None:                # not READY: nothing to forget
            return
        layout_id, key = name
        del self.index[layout_id][key]
        self.name_of[sid] = None
        self.unblanked[layout_id, key] = round_
        self.pages -= 1
        self.policy.remove(np.array([sid]))
        if self.pins[sid]:
            self.state[sid] = DOOMED
        else:
            self.release(sid)

    def release(self, sid: int) -> None:
        """Free a slot; the writer blanks it unless it is reused first."""
        self.state[sid] = FREE
        self.used -= int(self.sbytes[sid])
        heapq.heappush(self.free[int(self.sbytes[sid])], sid)
        self.discard.add(sid)
        self.on_free()                  # wakes the writer, and a delete waiting in _durable

    def enough(self, victims: np.ndarray, nbytes: int) -> int:
        """How many of the victims (in order) free at least nbytes."""
        return enough(self.sbytes[victims], nbytes)

    def make_room(self, nbytes: int, round_: int,
                  leaving: Callable[[int], None] | None = None) -> int:
        """Evict unpinned pages, in the policy's order, until nbytes more fit; returns how
        many. round_: the writer round current now (unblanked). leaving: called with each
        victim's slot id before it is dropped (its name and place still set)."""
        deficit = self.used + nbytes - self.capacity_bytes
        eligible = (self.state == READY) & (self.pins == 0)
        if deficit <= 0 or not eligible.any():
            return 0
        smallest = int(self.sbytes[eligible].min())
        victims = self.policy.victims(-(-deficit // smallest), eligible)
        victims = victims[: self.enough(victims, deficit)]
        for sid in victims.tolist():
            if leaving is not None:
                leaving(sid)
            self.drop(sid, round_)
        return len(victims)

    def rebuild(self, directory: str, direct: bool) -> int:
        """Open every slot file in directory and index its valid slots (restart); torn or
        corrupt slots are skipped and returned as a count, the later generation of a
        duplicated key wins, and the policy's order is the order of the generations."""
        # The VALID slots of every file (a VALID slot's header names its layout and key).
        found_ids: list[np.ndarray] = []
        found_gens: list[np.ndarray] = []
        found_names: list[tuple[bytes, bytes]] = []
        corrupt_pages = 0
        for name in sorted(os.listdir(directory)):
            slot_bytes = SlotFile.slot_bytes_of(name)
            if slot_bytes is None:
                if name.endswith(SUFFIX):
                    log.warning("disk tier: ignoring %s in %s: not the name of a slot file "
                                "(the tier names them <slot bytes>.slots)", name, directory)
                continue
            try:
                file = SlotFile(directory, slot_bytes, direct)
            except OSError as exc:
                raise RuntimeError(f"disk tier: cannot open {name} in {directory}: "
                                   f"{exc.strerror or exc}; slot files must be regular files "
                                   "in the folder (not symlinks)") from None
            self.files[slot_bytes] = file
            scan = file.scan()
            ids = self.new_ids(file, 0, file.n_slots)
            self.gen[ids], self.plen[ids] = scan.generation, scan.payload_len
            self.pxxh[ids] = scan.payload_xxh
            valid = np.flatnonzero(scan.state == VALID)
            found_ids.append(ids[valid])
            found_gens.append(scan.generation[valid])
            found_names += cast("list[tuple[bytes, bytes]]",
                                [(scan.layout_ids[i], scan.keys[i]) for i in valid.tolist()])
            corrupt = ids[scan.state == CORRUPT]
            self.discard.update(corrupt.tolist())
            corrupt_pages += len(corrupt) + int(scan.torn_tail)
        ids = np.concatenate([np.zeros(0, np.int64), *found_ids])
        gens = np.concatenate([np.zeros(0, np.uint64), *found_gens])
        # Oldest first, so of two slots with one key the later write wins.
        order = np.argsort(gens, kind="stable")
        latest = dict(zip(map(found_names.__getitem__, order.tolist()), ids[order].tolist(), strict=True))
        live = np.array(list(latest.values()), dtype=np.int64)
        live = live[np.argsort(self.gen[live], kind="stable")]
        for (layout_id, key), sid in latest.items():
            self.index.setdefault(layout_id, {})[key] = sid
            self.name_of[sid] = (layout_id, key)
        self.state[live] = READY
        self.policy.touch(live)            # LRU order: the order of the writes
        self.pages, self.used = len(live), int(self.sbytes[live].sum())
        self.discard.update(set(ids.tolist()) - set(latest.values()))   # older duplicates
        n = len(self.file_of)
        for slot_bytes in self.files:
            free = (self.state[:n] == FREE) & (self.sbytes[:n] == slot_bytes)
            self.free[slot_bytes] = np.flatnonzero(free).tolist()   # ascending: a heap
        self.next_gen = int(gens.max()) + 1 if gens.size else 1
        return corrupt_pages
