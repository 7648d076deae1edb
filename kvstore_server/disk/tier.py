"""The disk tier: pages evicted from DRAM, written behind to slot files, read back on a miss.

A page's life here (the DRAM side is in store.py; the bytes on disk in slotfile.py):

    offer ──► QUEUED: copied into staging memory; offer returns at once. contains and
       │      read_into already see it (read_into copies it from staging)
       │  writer thread: takes a slot (a free one, a new one at the end of the file, or
       ▼  the least recently used page's) and writes payload + header in one pwritev
    READY ◄──touch── read_into, and an offer of a page already here (no second write)
       ├─ evicted when a write needs room, or by evict(): its slot is rewritten, or blanked
       │   (a punched hole) in the writer's next round. A kill before that round ends
       │   can bring a page evicted for room back at restart, and that is allowed: it is
       │   still the right page for its key (the slot's header names layout and key, its
       │   checksum is checked before it is served, and a key names its contents: the
       │   store never stores a key twice), an eviction for room promises nothing, and
       │   the rebuild evicts down to the capacity. An eviction of a layout or of
       │   everything (admin evict, clear) is durable, as a delete is
       └─ delete: the same, and it returns only once the slot is blank or rewritten, even
           for a page evicted just before it (_durable): a deleted key never comes back.
           A slot being read is freed only when the read ends

Inclusive: a page read back stays here until this tier evicts it, so when DRAM evicts it
again the offer costs nothing. A key names its page's contents (keys are unique within a
layout), so a page already here or queued is never written twice.

A put never waits on the disk: offer only copies into a fixed arena of staging memory made
once (a ring: the writer frees in the order offers took), and drops the page when the ring
is full. A disk that fills (ENOSPC) or fails (EIO) turns writes off for good (logged once,
`failed` in stats); reads of what is already here go on.

Parts: the staging ring (staging.py), the slots, index and eviction (slots.py), the
bytes on disk (slotfile.py) and their batched I/O and folder lock (slot_io.py); this module
is the shell: the lock, the writer thread and the Tier interface (tier.py).
Over 400 lines because reads, durable deletes and the writer's rounds all wait on one
condition of that lock and read best beside it.

Concurrency: one lock guards the index, the slot arrays, the policy and the queue; no I/O
runs under it. A read pins its slots (a pinned slot is never reused), reads and checks them
outside the lock, then unpins; the writer picks slots under the lock and writes outside it.
The lock never calls out, so offer may be called under the store's lock.

Restart: the index is rebuilt from the slot headers (SlotFile.scan); torn or corrupt slots
are skipped and counted, the later generation of a duplicated key wins, and the LRU order is
the order of the generations. A rebuild reads each slot's header once and is bound by the
disk's read speed (tests/unit/test_disk.py's restart of 100k pages prints its rate).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..errors import StoreError
from ..removals import Cause, RemovalRing
from ..store.eviction import PolicyFactory, make_policy
from ..store.layouts import LAYOUT_ID_BYTES
from ..store.slots import SlotState
from ..tier import Page, PageInfo, Tier, TierInvalidation, TierName, TierStats
from ..tier_metrics import TierGauges
from .slot_io import SlotRead, SlotWrite, folder_gone, lock_folder, read_slots, runs_of, write_slots
from .slotfile import (
    ALIGN,
    MAX_KEY,
    SlotFile,
    SlotHeader,
    aligned_buffer,
    probe_direct,
    seal,
    slot_bytes_for,
)
from .slots import DiskSlots
from .staging import Pending, StagingRing
from .stats import DiskCollector, DiskCounters, DiskStats

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from ..scope import Scope

__all__ = ["DiskStats", "DiskTier"]

log = logging.getLogger("kvstore_server.disk")

# os.pwritev's signature: the seam through which tests inject ENOSPC and EIO.
PwriteV = Callable[[int, Sequence[memoryview], int], int]

# Longest a delete waits for its slots to be blanked (_durable): reads in flight on them,
# the writer's round in progress, the blanking. Past it the delete returns, not durable.
DURABLE_WAIT = 10.0

# Slot states (slots.py): WRITING here is taken by the writer, invisible; DOOMED is
# deleted or evicted while a read pins it, freed when the last read ends.
FREE, WRITING, READY, DOOMED = SlotState


def _as_u8(page: Page) -> np.ndarray:
    arr = np.asarray(page)
    if not arr.flags.c_contiguous:
        raise ValueError("a page must be one contiguous buffer")
    return arr.reshape(-1).view(np.uint8)


class DiskTier:
    """Pages in slot files under `directory`, at most capacity_bytes of slots, evicted in
    the order of an eviction policy (LRU by default)."""

    def __init__(self, directory: str, capacity_bytes: int, *, queue_bytes: int = 256 << 20,
                 direct: bool | None = None, clock: Callable[[], float] = time.monotonic,
                 pwritev: PwriteV = os.pwritev,
                 policy: PolicyFactory | str | None = None,
                 removals: RemovalRing | None = None) -> None:
        """queue_bytes: staging memory for pages not yet written, in slot-sized pieces
        (256 MiB holds 255 pages of 1 MiB: one eviction batch of the store); offers beyond
        it are dropped. Counted in bytes, not pages, because layouts' pages differ in size
        a thousandfold; an untouched mapping, so memory is used only as pages queue.
        direct: O_DIRECT I/O, so spilled pages do not fill the page cache too (DRAM is
        the cache); None = where the file system allows it. clock: times the rebuild.
        pwritev: a seam for tests (disk full, I/O errors). policy: the eviction policy, or
        the name of one (eviction.make_policy). removals: where pages leaving this host
        from here are recorded (the store's ring, removals.py; None: not recorded)."""
        if capacity_bytes <= 0 or queue_bytes < ALIGN:
            raise ValueError("capacity_bytes must be > 0 and queue_bytes at least 4 KiB")
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.capacity_bytes = capacity_bytes
        self._folder_lock = lock_folder(directory)
        self.direct = probe_direct(directory) if direct is None else direct
        self._pwritev = pwritev
        self._lock = threading.Lock()       # guards everything below
        self._wake = threading.Condition(self._lock)   # the writer waits on it, flush too
        self._staging = StagingRing(queue_bytes)     # the write-behind queue
        # Slots: small integer ids, their state in flat arrays (see pool.py for why).
        self._slots = DiskSlots(capacity_bytes, make_policy(policy), self._wake.notify_all)
        # Writer rounds (see _durable): started, finished, and the one a delete waits for.
        self._rounds = self._rounds_done = self._rounds_wanted = 0
        self._failed = False
        self._error = ""                    # why writes stopped
        self._closing = False
        self.counters = DiskCounters()
        # Where pages evicted to make room go (link(): the chain links the far tier here,
        # under --far-write evict, for they are leaving the host); None: they are forgotten.
        self.below: Tier | None = None
        self.removals = removals
        started = clock()
        self._rebuild()
        self.rebuild_seconds = clock() - started
        self._writer = threading.Thread(target=self._run, name="disk-writer", daemon=True)
        self._writer.start()

    # -- the Tier interface ---------------------------------------------------------------
    name = TierName.DISK
    probe_chunk = 0                 # a probe is a dict lookup a key: the store's chunks

    @property
    def tiers(self) -> tuple[Tier, ...]:
        return (self,)

    def link(self, below: Tier) -> None:
        self.below = below

    def offer(self, layout_id: bytes, key: bytes, page: Page) -> bool:
        src = _as_u8(page)
        if len(layout_id) != LAYOUT_ID_BYTES or not 1 <= len(key) <= MAX_KEY:
            raise ValueError(f"layout id must be {LAYOUT_ID_BYTES} bytes and a key 1 to "
                             f"{MAX_KEY}, got {len(layout_id)} and {len(key)}")
        sb = slot_bytes_for(src.nbytes)
        with self._lock:
            if (self._failed or self._closing
                    or sb > min(len(self._staging), self.capacity_bytes)):
                self.counters.refused += 1
                return False
            sid = self._slots.index.get(layout_id, {}).get(key)
            if sid is not None:
                self._slots.policy.touch(np.array([sid]))
                return True
            if key in self._staging.queued.get(layout_id, ()):
                return True
            off = self._staging.alloc(sb)
            if off < 0:
                self.counters.drops += 1
                return False
            entry = Pending(layout_id, key, off, src.nbytes, sb)
            self._staging.push(entry)
        self._staging.arena[off:off + src.nbytes] = src     # the copy, outside the lock
        with self._lock:
            entry.ready = True
            self._wake.notify()
        return True

    def contains(self, layout_id: bytes, keys: Sequence[bytes]) -> np.ndarray:
        with self._lock:
            index = self._slots.index.get(layout_id, {})
            queued = self._staging.queued.get(layout_id, {})
            return np.fromiter((k in index or k in queued for k in keys), dtype=bool,
                               count=len(keys))

    def read_into(  # noqa: C901 - a page's three states (stored, staged, wrong size), one pass
            self, layout_id: bytes, keys: Sequence[bytes], outs: Sequence[Page]) -> list[bool]:
        if len(outs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(outs)} output buffers")
        arrs = [_as_u8(out) for out in outs]
        result = [False] * len(keys)
        reads: list[SlotRead] = []
        pinned: list[tuple[int, int]] = []          # (key number, slot id) of each read
        with self._lock:
            index = self._slots.index.get(layout_id, {})
            queued = self._staging.queued.get(layout_id, {})
            found = [index.get(k) for k in keys]
            for i, (key, sid, arr) in enumerate(zip(keys, found, arrs, strict=True)):
                # A page of this layout is always the caller's page size: a slot whose
                # header checks out with another length was not written for this page (a
                # forged or stray file). Corrupt, like a checksum that fails: dropped,
                # counted, never served (it used to raise, and a promotion leaked the
                # reservation it was reading into).
                entry = queued.get(key)
                size = int(self._slots.plen[sid]) if sid is not None else \
                    entry.nbytes if entry is not None else arr.nbytes
                if arr.nbytes != size:
                    log.warning("disk tier: key %s holds %d bytes, %d expected: dropped as "
                                "corrupt", key.hex(), size, arr.nbytes)
                    self.counters.corrupt_pages += sid is None or \
                        self._slots.name_of[sid] == (layout_id, key)
                    if sid is not None:
                        if self._slots.name_of[sid] == (layout_id, key):   # once if repeated
                            self._slots.drop(sid, self._rounds)
                    elif entry is not None:     # always: the page was found queued
                        entry.cancelled = True
                        del queued[key]
                    found[i] = None
            for i, (key, sid) in enumerate(zip(keys, found, strict=True)):
                if sid is None:
                    entry = queued.get(key)
                    if entry is not None and entry.ready:   # not written yet: copy it now
                        arrs[i][:] = self._staging.arena[entry.off:entry.off + entry.nbytes]
                        result[i] = True
                    continue
                self._slots.pins[sid] += 1
                pinned.append((i, sid))
                slots = self._slots
                reads.append(SlotRead(slots.file_of[sid], int(slots.idx[sid]), arrs[i],
                                      SlotHeader(layout_id, key, int(slots.plen[sid]),
                                                 int(slots.gen[sid]), int(slots.pxxh[sid]))))
            if pinned:                      # reversed: a prefix's head stays hottest
                self._slots.policy.touch(np.array([sid for _, sid in pinned[::-1]]))
        status = read_slots(reads) if reads else []
        with self._lock:
            for (i, sid), ok, read in zip(pinned, status, reads, strict=True):
                self._slots.pins[sid] -= 1
                if ok:
                    result[i] = True
                    self.counters.reads += 1
                    self.counters.bytes_read += read.out.nbytes
                elif ok is None:
                    self.counters.read_errors += 1
                else:                       # checksum failed: drop it, never return it
                    self.counters.corrupt_pages += 1
                    if self._slots.name_of[sid] == (layout_id, keys[i]):
                        self._slots.drop(sid, self._rounds)
                if self._slots.state[sid] == DOOMED and self._slots.pins[sid] == 0:
                    self._slots.release(sid)
        if status.count(False) or status.count(None):
            log.warning("disk tier: of %d pages read, %d failed their checksum (dropped) and "
                        "%d could not be read", len(reads), status.count(False),
                        status.count(None))
        return result

    def delete(self, layout_id: bytes, keys: Sequence[bytes]) -> int:
        with self._lock:
            index = self._slots.index.get(layout_id, {})
            queued = self._staging.queued.get(layout_id, {})
            held, dropped = 0, []
            for key in keys:
                entry = queued.pop(key, None)
                if entry is not None:
                    entry.cancelled = True
                sid = index.get(key)
                if sid is not None:
                    self._slots.drop(sid, self._rounds)
                    dropped.append(sid)
                held += entry is not None or sid is not None
            if held or self._freed_since_round(layout_id, keys):
                self._durable(dropped)
            return held

    def describe(self, layout_id: bytes, key: bytes) -> PageInfo | None:
        # Ages are not kept for disk pages (their generation orders them): 0.
        with self._lock:
            sid = self._slots.index.get(layout_id, {}).get(key)
            if sid is not None:
                return PageInfo(self.name, "READY", int(self._slots.plen[sid]),
                                leases=int(self._slots.pins[sid]),
                                slot_offset=self._slots.file_of[sid].offset(int(self._slots.idx[sid])))
            entry = self._staging.queued.get(layout_id, {}).get(key)
            if entry is not None:
                return PageInfo(self.name, "QUEUED", entry.nbytes)
        return None

    def evict(self, *, nbytes: int | None = None, layout_id: bytes | None = None,
              everything: bool = False) -> tuple[int, int]:
        if nbytes is None and layout_id is None and not everything:
            raise ValueError("evict needs nbytes, layout_id or everything")
        with self._lock:
            if layout_id is not None:
                eligible = np.zeros(len(self._slots.state), dtype=bool)
                eligible[list(self._slots.index.get(layout_id, {}).values())] = True
            else:
                eligible = self._slots.state == READY
            if nbytes is None:              # a whole layout, or everything: queued ones too
                for lid, queued in self._staging.queued.items():
                    if layout_id in (None, lid):
                        for entry in queued.values():
                            entry.cancelled = True
                        queued.clear()
                victims = np.flatnonzero(eligible)
            else:
                victims = self._slots.policy.victims(int(np.count_nonzero(eligible)), eligible)
                victims = victims[: self._slots.enough(victims, nbytes)]
            freed = int(self._slots.sbytes[victims].sum())
            # A byte amount's victims are recorded here; a layout's or all, by the store.
            gone = [self._name(sid) for sid in victims.tolist()] if nbytes is not None else []
            for sid in victims.tolist():
                self._slots.drop(sid, self._rounds)
            self.counters.evictions += len(victims)
            if nbytes is None and (victims.size or self._slots.unblanked):   # as a delete
                self._durable(victims.tolist())
        self._removed(gone)
        return len(victims), freed

    def invalidate(self, scope: Scope, known: Sequence[bytes]) -> TierInvalidation:
        # The disk keeps no layout records: it forgets the layouts it is told of.
        removed = 0
        try:
            for layout_id in known:
                removed += self.evict(layout_id=layout_id)[0]
        except (OSError, StoreError) as exc:
            return TierInvalidation(tuple(known), removed, str(exc))
        return TierInvalidation(tuple(known), removed)

    def flush(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        with self._wake:
            while not self._failed and not self._closing and self._staging.pending():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._wake.wait(left)
            return self._staging.pending()

    holds_pages = True

    def stats(self) -> DiskStats:
        """Counters since start (TierStats says what each means)."""
        with self._lock:
            queued = [e for e in self._staging.ring if not e.cancelled]
            return DiskStats(
                self.name, self.capacity_bytes, self._slots.used, self._slots.pages,
                **dataclasses.asdict(self.counters), failed=self._failed, error=self._error,
                pages_by_layout={lid: len(keys) for lid, keys in self._slots.index.items() if keys},
                queued_pages=len(queued), queued_bytes=sum(e.slot_bytes for e in queued),
                queue_capacity_bytes=len(self._staging), direct_io=self.direct,
                rebuild_seconds=self.rebuild_seconds)

    def levels(self) -> tuple[TierStats, ...]:
        return (self.stats(),)

    def register_metrics(self, registry: CollectorRegistry) -> None:
        registry.register(TierGauges(self.levels))
        registry.register(DiskCollector(self.stats))

    def close(self) -> None:
        """Stop the writer after the batch it is writing (call flush first to keep the
        queue), blank the slots freed since, and close the files."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._wake.notify_all()
        self._writer.join()
        for file in self._slots.files.values():
            file.close()
        os.close(self._folder_lock)

    def _durable(self, dropped: list[int]) -> None:
        """Wait (under the lock, which the wait gives up) until no slot freed so far can
        bring its page back at a restart: a delete acknowledged and then lost to a SIGKILL
        came back once in 20 tries, from a slot the writer had not blanked yet.

        A freed slot stops holding its page when the writer blanks it, or overwrites it
        with a page it reused the slot for. Both happen in a writer round: the round
        takes every freed slot not yet reused, blanks them, and writes its batch into the
        slots it takes. So once a round that started after now has finished, every slot
        freed before now is blank or rewritten, including one the round in progress frees
        (a queued page deleted while being written). Slots pinned by a read are freed
        when the read ends, so they are waited for first. This costs the caller the rest
        of the writer's round (one batch, at most staging.BATCH_BYTES) and the blanking.

        Durable against a killed process (the blank is in the kernel when pwrite or
        fallocate returns), not against a power cut: there is no fsync."""
        deadline = time.monotonic() + DURABLE_WAIT
        doomed = [sid for sid in dropped if self._slots.state[sid] == DOOMED]
        while any(self._slots.state[sid] == DOOMED for sid in doomed) and not self._closing:
            if not self._wake.wait(max(0.0, deadline - time.monotonic())):
                break
        want = self._rounds + 1
        self._rounds_wanted = max(self._rounds_wanted, want)
        self._wake.notify_all()
        while self._rounds_done < want and not self._closing:
            if not self._wake.wait(max(0.0, deadline - time.monotonic())):
                self.counters.undurable_deletes += 1
                log.warning("disk tier: a delete returns before its slots were blanked "
                            "(the writer took over %.0fs); a kill now could bring the "
                            "pages back", DURABLE_WAIT)
                return

    def _freed_since_round(self, layout_id: bytes, keys: Sequence[bytes]) -> bool:
        """Whether any of these pages was forgotten here (evicted, most often) so recently
        that its slot may not be blank yet: a slot freed while round r was the latest
        started is blank or rewritten once round r + 1 has ended."""
        if not self._slots.unblanked:
            return False
        done = self._rounds_done
        return any(self._slots.unblanked.get((layout_id, key), -1) >= done for key in keys)

    # -- restart --------------------------------------------------------------------------
    def _rebuild(self) -> None:
        """The index from the slot headers (DiskSlots.rebuild), then evicted down to the
        capacity, which a restart with a smaller one or a kill that left freed slots not
        yet blanked can exceed. Under the lock, like every eviction (it notifies the
        writer, which blanks the slots)."""
        self.counters.corrupt_pages += self._slots.rebuild(self.directory, self.direct)
        self.counters.rebuilt_pages = self._slots.pages
        with self._lock:
            self.counters.evictions += self._slots.make_room(0, self._rounds)
        if self._slots.pages or self.counters.corrupt_pages:
            log.info("disk tier: %d pages (%d MiB) found in %s; %d corrupt or torn slots "
                     "skipped", self._slots.pages, self._slots.used >> 20, self.directory,
                     self.counters.corrupt_pages)

    # -- the writer thread ----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._lock:
                while not (self._closing or self._slots.discard
                           or self._rounds_done < self._rounds_wanted
                           or (self._staging.ring and self._staging.ring[0].ready
                               and not self._failed)):
                    self._wake.wait()
                if self._closing and not self._slots.discard:
                    return
                self._rounds += 1
                round_ = self._rounds
                slots = self._slots
                blank = [(slots.file_of[sid], int(slots.idx[sid])) for sid in slots.discard]
                self._slots.discard.clear()
                batch = [] if self._closing or self._failed else self._staging.take_batch()
            try:
                # Only this thread allocates slots, so none of these is reused meanwhile.
                for file, idx, n in runs_of(blank):
                    file.blank(idx, self._pwritev, n)
                if batch:
                    self._write(batch)
            except Exception as exc:
                log.exception("disk writer failed")
                with self._lock:
                    self._fail(exc)
            with self._lock:                # a delete may wait for this round (_durable)
                self._rounds_done = round_
                if self._slots.unblanked:
                    self._slots.unblanked = {name: r for name, r in self._slots.unblanked.items()
                                       if r >= round_}
                self._wake.notify_all()

    def _write(self, batch: list[Pending]) -> None:
        if folder_gone(self._folder_lock):
            raise OSError(errno.ENOENT, "the folder was removed while the server ran "
                                        "(its lock file is gone)", self.directory)
        for sb in {e.slot_bytes for e in batch} - self._slots.files.keys():
            file = SlotFile(self.directory, sb, self.direct)    # opened outside the lock
            with self._lock:
                self._slots.files[sb], self._slots.free[sb] = file, []
        with self._lock:
            live = [e for e in batch if not e.cancelled]
            need = sum(e.slot_bytes for e in live)
            leaving: list[SlotRead] = []            # victims the tier below is offered
            gone: list[tuple[bytes, bytes]] = []    # pages leaving the host (removals.py)
            self.counters.evictions += self._slots.make_room(
                need, self._rounds,
                (lambda sid: leaving.append(self._slot_read(sid))) if self.below is not None
                else (lambda sid: gone.append(self._name(sid))))
            plan = []                               # (entry, slot id, generation)
            for entry in live:
                if self._slots.used + entry.slot_bytes > self.capacity_bytes:
                    self.counters.refused += 1   # what is left is being read
                    gone.append((entry.layout_id, entry.key))
                    continue
                plan.append((entry, self._slots.alloc(entry.slot_bytes), self._slots.next_gen))
                self._slots.next_gen += 1
            arena, slots = self._staging.arena, self._slots
            writes = [SlotWrite(slots.file_of[sid], int(slots.idx[sid]),
                                arena[e.off:e.off + e.slot_bytes]) for e, sid, _ in plan]
        if leaving:                 # before their slots are rewritten (this thread only)
            gone += self._spill_below(leaving)
        sums = [seal(w.image, e.layout_id, e.key, e.nbytes, gen)
                for w, (e, _, gen) in zip(writes, plan, strict=True)]
        written, error = write_slots(writes, self._pwritev)
        with self._lock:
            done: list[tuple[int, int, int, int]] = []   # (slot id, generation, xxh, bytes)
            for (entry, sid, gen), pxxh, ok in zip(plan, sums, written, strict=True):
                if not ok or entry.cancelled:
                    self.counters.refused += not entry.cancelled   # lost to the error
                    if not entry.cancelled:
                        gone.append((entry.layout_id, entry.key))
                    self._slots.release(sid)      # blanked, so an old page there cannot return
                    continue
                done.append((sid, gen, pxxh, entry.nbytes))
                self._slots.name_of[sid] = (entry.layout_id, entry.key)
                self._slots.index.setdefault(entry.layout_id, {})[entry.key] = sid
            if done:
                sids, gens, pxxhs, sizes = (np.array(col, dtype=np.uint64) for col in zip(*done, strict=True))
                sids = sids.astype(np.int64)
                slots = self._slots
                slots.gen[sids], slots.pxxh[sids], slots.plen[sids] = gens, pxxhs, sizes
                self._slots.state[sids] = READY
                self._slots.policy.touch(sids)
                self._slots.pages += len(done)
                self.counters.writes += len(done)
                self.counters.bytes_written += int(sizes.sum())
            self._staging.done(batch)
            if error is not None:
                self._fail(error)
            self._wake.notify_all()
        self._removed(gone)

    def _name(self, sid: int) -> tuple[bytes, bytes]:
        """(layout id, key) of READY slot sid."""
        name = self._slots.name_of[sid]
        assert name is not None               # a READY slot has a name
        return name

    def _removed(self, gone: list[tuple[bytes, bytes]]) -> None:
        """Record pages that left the host from here (none goes to a tier below)."""
        if self.removals is None or not gone:
            return
        by_layout: dict[bytes, list[bytes]] = {}
        for layout_id, key in gone:
            by_layout.setdefault(layout_id, []).append(key)
        for layout_id, keys in by_layout.items():
            self.removals.record(layout_id, keys, Cause.EVICTED)

    def _slot_read(self, sid: int) -> SlotRead:
        """A read of READY slot sid's page, its buffer not yet made (_spill_below)."""
        slots = self._slots
        name = slots.name_of[sid]
        assert name is not None               # a READY slot has a name
        layout_id, key = name
        return SlotRead(slots.file_of[sid], int(slots.idx[sid]), np.empty(0, np.uint8),
                        SlotHeader(layout_id, key, int(slots.plen[sid]), int(slots.gen[sid]),
                                   int(slots.pxxh[sid])))

    def _spill_below(self, leaving: list[SlotRead]) -> list[tuple[bytes, bytes]]:
        """Offer pages this tier evicts to the tier below: they are leaving the host (the
        far tier under --far-write evict). One page at a time through one buffer, so the
        memory is one slot whatever the batch; a page that fails its checksum is not
        offered. Runs in the writer thread, before the victims' slots are rewritten.
        Returns the pages not taken below: gone from every tier of this server."""
        buf = aligned_buffer(max(r.file.slot_bytes for r in leaving))
        lost = []
        for r in leaving:
            read = dataclasses.replace(r, out=buf[:r.expect.payload_len])
            if not (read_slots([read])[0] and self.below is not None
                    and self.below.offer(r.expect.layout_id, r.expect.key, read.out)):
                lost.append((r.expect.layout_id, r.expect.key))
        return lost

    def _fail(self, exc: BaseException) -> None:
        """Stop taking pages after a write failed: drop the queue, keep serving reads."""
        if not self._failed:
            self._failed = True
            self._error = str(exc)
            log.error("disk tier in %s stops taking pages: a write failed (%s); pages "
                      "already on disk are still served", self.directory, exc)
        # The queued pages will never be written: they leave the host here (removals.py).
        self._removed([(e.layout_id, e.key) for e in self._staging.ring if not e.cancelled])
        self.counters.refused += self._staging.cancel_all()
        self._wake.notify_all()
