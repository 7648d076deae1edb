"""The page store: index, slots, leases and eviction behind one lock.

The page lifecycle, owned here:

    reserve ──► WRITING ──write bytes──► commit ──► READY ◄──touch── lookup / get
       │         (invisible,                          │  ▲
       │          RESERVE lease)                      │  └─ READ lease pins it while copied out
       └─ abort / reservation expiry: slot freed,     ├─ evict: unleased READY pages, LRU order,
          key never visible                           │   handed to the tier below (disk) if any
                                                      └─ delete: freed now, or DOOMED (invisible)
                                                          until its last lease is released

Tenants: a layout belongs to one tenant (tenants.py). A slot's page bytes are charged to
that tenant from reserve until the slot is freed, whichever way it goes; a reserve that
would take the tenant past its quota first evicts the tenant's own coldest pages
(_make_room). Pages read back from the tier below are reserved the same way, so held to
the same quota; and a reserve that needs a new slab extent is held to the tenant's share
of the pool's slabs (_keep_footprint, footprint.py). A lease remembers its tenant, and
only that tenant may end it; an admin may break every client's lease (break_leases).

Concurrency: one lock guards the index, the slot arrays, the policy and the leases.
Critical sections are short and vectorised; the bytes are copied outside the lock, into
slots a RESERVE lease owns or out of slots a READ lease pins, so no copy can race with a
reuse of its slot.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from typing import Callable, Sequence

import numpy as np

from kvstore_client.keys import Packed
from kvstore_client.layout import PageLayout
from kvstore_client.units import format_size

from .disk import NoDisk, Tier
from .errors import Outcome, StoreError
from .footprint import Footprints
from .index import KeyIndex
from .leases import Lease, LeaseKind, LeaseTable
from .lru import LRUPolicy
from .pool import Pool
from .region import HEADER_BYTES, Region
from .tenants import DEFAULT_TENANT, scoped_layout_id
from .timed_lock import TimedLock

__all__ = ["Store", "LayoutInfo", "FREE", "WRITING", "READY", "DOOMED", "FOREVER"]

log = logging.getLogger(__name__)

# Slot states (uint8 per slot id).
FREE, WRITING, READY, DOOMED = 0, 1, 2, 3
STATE_NAMES = {FREE: "FREE", WRITING: "WRITING", READY: "READY", DOOMED: "DOOMED"}

# A lease the RPC layer releases itself in a `finally` (a Put or Get stream in this
# process) never expires: expiring it would let the slot be reused under a live copy.
FOREVER = math.inf
# Layouts one Lookup may name: one per tensor/pipeline-parallel rank of an engine.
MAX_LOOKUP_LAYOUTS = 256
# A tenant over its quota evicts this share of the quota beyond what it needs (_make_room).
QUOTA_BATCH = 1 / 32
# Keys of a lookup asked of the tier below at once: it stops at the first one missing.
_PROBE_CHUNK = 1024
# Pages an admin eviction or clear handles a lock hold: 256 evicted to the disk tier held
# it about 11 ms on the dev VM (each page is offered, a copy into the write queue).
ADMIN_BATCH = 256


def _owns(tenant: str | None, lease: Lease) -> bool:
    """May this caller end the lease? None is the server itself, which may end any."""
    return tenant is None or lease.owner == tenant


@dataclasses.dataclass(slots=True)
class LayoutInfo:
    """A registered layout, its index of keys, and its counters."""

    idx: int
    layout: PageLayout
    layout_id: bytes                # the store's id: scoped to the tenant (tenants.py)
    cls: int                        # pool size class of its pages
    tenant: str = DEFAULT_TENANT    # whose pages these are: quota and lease ownership
    # READY pages only, one vectorised hash table per key size (a request's keys all
    # have one size), so a lookup is a few numpy calls and no per-key state check
    ready: dict[int, KeyIndex] = dataclasses.field(default_factory=dict)
    # key -> slot id of pages being written (reserved, not yet committed); small and
    # short-lived, so a dict
    writing: dict[bytes, int] = dataclasses.field(default_factory=dict)
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_in: int = 0
    bytes_out: int = 0

    @property
    def page_bytes(self) -> int:
        return self.layout.page_bytes

    @property
    def layer_bytes(self) -> int:
        return self.layout.layer_bytes


@dataclasses.dataclass(frozen=True, slots=True)
class Reservation:
    """Slots for a put: slots[i] = -1 where keys[i] is not this put's to write: already
    stored or named earlier in the request (skipped), or being written by another
    reservation (in flight: stored only if that one commits, so a caller that must have
    the page stored puts it again later)."""

    lease_id: int
    info: LayoutInfo
    slots: np.ndarray
    offsets: np.ndarray       # byte offset in the region of each slot (-1 if not written)
    in_flight: int = 0

    @property
    def skipped(self) -> int:
        return int(np.count_nonzero(self.slots < 0)) - self.in_flight


@dataclasses.dataclass(frozen=True, slots=True)
class Pinned:
    """Pages pinned by a READ lease, in the order of the keys asked."""

    lease_id: int
    info: LayoutInfo
    slots: np.ndarray
    offsets: np.ndarray


class Store:
    """Pages of every layout in one shared region, with leases and LRU eviction."""

    def __init__(self, region: Region, *, lease_ttl: float = 30.0,
                 high_watermark: float = 0.95, low_watermark: float = 0.85,
                 clock: Callable[[], float] = time.monotonic,
                 lower: Tier | None = None) -> None:
        """lower: the tier below DRAM (disk.DiskTier); evicted pages are offered to it,
        and a lookup, exists or acquire that misses in DRAM asks it."""
        self.region = region
        self.mem = region.mem
        self.pool = Pool(region.size - HEADER_BYTES, base=HEADER_BYTES)
        self.lease_ttl = lease_ttl
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self.clock = clock
        self.lower: Tier = lower if lower is not None else NoDisk()
        self.promotions = 0                    # pages read back from the tier below
        # Guards everything below. Timed: the longest hold is the longest one call can
        # stall the others (limits.py bounds it; /metrics shows it).
        self._lock = TimedLock()
        # Page bytes of each tenant's slots (WRITING, READY, or DOOMED until released),
        # charged when reserved and refunded in _free: what a quota limits.
        self._tenant_bytes: dict[str, int] = {}
        # Each tenant's slots per size class: its share of the slabs (footprint.py).
        self._footprints = Footprints()
        self._layouts: dict[bytes, LayoutInfo] = {}
        self._by_idx: list[LayoutInfo] = []
        self._policy = LRUPolicy()
        self._leases = LeaseTable(clock)
        n = 1024
        self._state = np.zeros(n, dtype=np.uint8)
        self._pins = np.zeros(n, dtype=np.int32)       # live leases holding each slot
        self._layout_of = np.full(n, -1, dtype=np.int32)
        # Seconds since start, float32 (4 bytes a page; precise to ~0.1 s after 10 days).
        self._committed_at = np.zeros(n, dtype=np.float32)
        self._touched_at = np.zeros(n, dtype=np.float32)
        self._key_size = np.zeros(n, dtype=np.uint8)   # which of the layout's indexes
        self.evictions = 0
        self.started_at = clock()
        self.pressure = threading.Event()      # set when usage crosses the high watermark

    # -- layouts --------------------------------------------------------------------
    def register_layout(self, layout: PageLayout, tenant: str = DEFAULT_TENANT) -> LayoutInfo:
        """Idempotent: the same layout of one tenant always gets the same LayoutInfo; its
        layout_id is scoped_layout_id(tenant, layout.layout_id)."""
        layout_id = scoped_layout_id(tenant, layout.layout_id)
        with self._lock:
            info = self._layouts.get(layout_id)
            if info is not None:
                return info
            try:
                cls = self.pool.class_for(layout.page_bytes)
            except ValueError as exc:
                raise StoreError(Outcome.INVALID, str(exc)) from None
            info = LayoutInfo(len(self._by_idx), layout, layout_id, cls, tenant)
            self._layouts[layout_id] = info
            self._by_idx.append(info)
            log.info("registered layout %s: %s, %d layers, %d tokens/page, %d bytes/page",
                     layout_id.hex(), layout.model, layout.num_layers, layout.page_tokens,
                     layout.page_bytes)
            return info

    def info(self, layout_id: bytes) -> LayoutInfo:
        info = self._layouts.get(layout_id)
        if info is None:
            raise StoreError(Outcome.INVALID, f"unknown layout {layout_id.hex() or '(empty)'}: "
                                              "call RegisterLayout first")
        return info

    def layouts(self) -> list[LayoutInfo]:
        return list(self._by_idx)

    # -- lookups --------------------------------------------------------------------
    @staticmethod
    def _find(info: LayoutInfo, keys: Packed) -> np.ndarray:
        """The READY slot of each key, -1 where there is none."""
        index = info.ready.get(keys.size)
        if index is None or not len(keys):
            return np.full(len(keys), -1, dtype=np.int64)
        return index.find(keys.rows)

    def _touch(self, slots: np.ndarray) -> None:
        # Reversed: the prefix's head becomes the most recent, its tail goes first.
        self._policy.touch(slots[::-1])
        self._touched_at[slots] = self.clock() - self.started_at

    def lookup(self, layout_ids: Sequence[bytes], keys: Packed | Sequence[bytes],
               lease_ttl: float = 0.0) -> tuple[int, int]:
        """(leading keys present in every layout, lease id or 0)."""
        keys = Packed.of(keys)
        if not layout_ids:
            raise StoreError(Outcome.INVALID, "lookup needs at least one layout_id")
        if len(layout_ids) > MAX_LOOKUP_LAYOUTS:
            # Each layout costs a full pass over the keys under the lock: uncapped, one
            # request of 20k ids and 2k keys held it for 0.5 s (found by fuzzing).
            raise StoreError(Outcome.INVALID, f"lookup names {len(layout_ids)} layouts; at "
                                              f"most {MAX_LOOKUP_LAYOUTS} (one per rank)")
        layout_ids = list(dict.fromkeys(layout_ids))     # a repeated id counts once
        with self._lock:
            infos = [self.info(layout_id) for layout_id in layout_ids]
            found = [self._find(info, keys) for info in infos]
            if isinstance(self.lower, NoDisk):
                count = min(int(np.argmin(f >= 0)) if (f < 0).any() else len(keys)
                            for f in found)
                return self._count_and_lease(infos, keys, found, count, lease_ttl)
        # The tier below is asked outside the store's lock: it has its own, and its probe
        # costs a dict lookup a key (a Lookup of 60 M keys held the store's lock 11.5 s).
        count = min(self._reach(info, keys, slots) for info, slots in zip(infos, found))
        run = keys if count == len(keys) else Packed(keys.data[:count * keys.size], keys.size)
        with self._lock:
            # Find the run's DRAM pages again, to touch and pin them in this hold: one
            # may have moved down meanwhile (it is then read back by Acquire, like any
            # page of the run on the tier below).
            found = [self._find(info, run) for info in infos]
            return self._count_and_lease(infos, keys, found, count, lease_ttl)

    def _count_and_lease(self, infos: list[LayoutInfo], keys: Packed, found: list[np.ndarray],
                         count: int, lease_ttl: float) -> tuple[int, int]:
        """Count the hits, touch the run's DRAM pages, and lease them if asked: the
        pages of the tier below are counted, not leased; Acquire reads them back."""
        dram = [slots[:count][slots[:count] >= 0] for slots in found]
        for info, run_slots in zip(infos, dram):
            info.hits += count
            info.misses += len(keys) - count
            self._touch(run_slots)
        if lease_ttl <= 0:
            return count, 0
        pinned = np.concatenate(dram)
        if not pinned.size:
            return count, 0
        np.add.at(self._pins, pinned, 1)    # add.at: a key may repeat
        return count, self._leases.grant(LeaseKind.READ, pinned, lease_ttl,
                                         owner=infos[0].tenant).lease_id

    def _reach(self, info: LayoutInfo, keys: Packed, slots: np.ndarray) -> int:
        """How many leading keys are stored, in DRAM (slots >= 0) or on the tier below;
        the tier is asked about the gaps a chunk at a time, up to the first one it lacks."""
        gaps = np.flatnonzero(slots < 0)
        for start in range(0, gaps.size, _PROBE_CHUNK):
            chunk = gaps[start:start + _PROBE_CHUNK]
            held = self.lower.contains(info.layout_id, keys.select(chunk))
            if not held.all():
                return int(chunk[int(np.argmin(held))])
        return len(keys)

    def exists(self, layout_id: bytes, keys: Packed | Sequence[bytes]) -> np.ndarray:
        """One bool per key: stored in this layout, in DRAM or on the tier below."""
        keys = Packed.of(keys)
        with self._lock:
            info = self.info(layout_id)
            present = self._find(info, keys) >= 0
        missing = np.flatnonzero(~present)
        if missing.size and not isinstance(self.lower, NoDisk):
            # Outside the store's lock, as in lookup.
            present[missing] = self.lower.contains(info.layout_id, keys.select(missing))
        return present

    # -- puts -----------------------------------------------------------------------
    def reserve(self, layout_id: bytes, keys: Packed | Sequence[bytes],
                ttl: float | None = None, quota: int = 0) -> Reservation:
        """WRITING slots for the keys not yet present; the caller writes, then commits.
        quota: bytes the layout's tenant may hold (0 = unlimited); see _make_room."""
        keys = Packed.of(keys)
        with self._lock:
            info = self.info(layout_id)
            slots = np.full(len(keys), -1, dtype=np.int64)
            wanted = []
            seen = set()
            in_flight = 0
            for i in np.flatnonzero(self._find(info, keys) < 0).tolist():
                key = keys.key(i)
                if key in info.writing:
                    in_flight += 1
                elif key not in seen:
                    wanted.append(i)
                    seen.add(key)
            self._make_room(info, len(wanted), quota)
            if quota:
                self._keep_footprint(info, len(wanted), quota)
            got = self._alloc(info.cls, len(wanted))
            if len(got) < len(wanted):
                self.pool.free(got)
                raise StoreError(Outcome.EXHAUSTED,
                                 f"pool full: no room for {len(wanted)} pages of "
                                 f"{info.page_bytes} bytes; every page is leased or being "
                                 "written")
            new_keys = keys.select(wanted)
            self._grow()
            slots[wanted] = got
            self._state[got] = WRITING
            self._pins[got] += 1
            self._layout_of[got] = info.idx
            self._key_size[got] = keys.size
            for key, slot in zip(new_keys, got.tolist()):
                info.writing[key] = slot
            self._footprints.add(info.tenant, info.cls, len(got))
            self._tenant_bytes[info.tenant] = (self._tenant_bytes.get(info.tenant, 0)
                                               + len(got) * info.page_bytes)
            lease = self._leases.grant(LeaseKind.RESERVE, got,
                                       self.lease_ttl if ttl is None else ttl,
                                       info.idx, new_keys, owner=info.tenant)
            if self.pool.used_bytes > self.high_watermark * self.pool.capacity_bytes:
                self.pressure.set()
            offsets = np.where(slots >= 0, self.pool.offset[np.maximum(slots, 0)], -1)
            return Reservation(lease.lease_id, info, slots, offsets, in_flight)

    def _make_room(self, info: LayoutInfo, n: int, quota: int) -> None:
        """Keep info's tenant within quota (bytes, 0 = unlimited) when n more of its pages
        are reserved, by evicting that tenant's own least recently used unleased pages;
        EXHAUSTED (nothing evicted) when those cannot free enough.

        A quota caps a tenant's share of the pool, so that it cannot push the others'
        pages out; it does not make a full tenant's saves fail. This is a cache: like
        the pool as a whole, a tenant at its quota keeps its hot pages and drops its
        cold ones. Eviction here never touches another tenant's pages.

        Finding a tenant's victims scans every slot, under the store's lock: 7.3 ms per
        reserve of 16 pages with 400k pages held (dev VM), when each reserve at the quota
        evicted just what it needed, so every put of a full tenant paid it and held up
        every other tenant's calls. It evicts up to QUOTA_BATCH of the quota more than it
        needs, in whole pages (as the pool's watermarks do for the whole pool): the scan
        then runs once per that much of the tenant's puts (0.22 ms per reserve, same
        test)."""
        used = self._tenant_bytes.get(info.tenant, 0)
        need = n * info.page_bytes
        over = used + need - quota
        if not quota or over <= 0:
            return
        asked = f"{n} pages of {format_size(info.page_bytes)}"
        if need > quota:
            raise StoreError(Outcome.EXHAUSTED, (
                f"tenant {info.tenant!r} asked for {asked}, more than its whole quota of "
                f"{format_size(quota)} (it holds {format_size(used)}): store fewer at once"))
        target = over + int(quota * QUOTA_BATCH)
        mine = [i for i in self._by_idx if i.tenant == info.tenant]
        n_ids = self.pool.id_capacity
        eligible = self._evictable() & np.isin(self._layout_of[:n_ids], [i.idx for i in mine])
        # Enough victims even if every one is of the tenant's smallest page size.
        victims = self._policy.victims(-(-target // min(i.page_bytes for i in mine)), eligible)
        page_bytes = np.array([i.page_bytes for i in self._by_idx], dtype=np.int64)
        freed = np.cumsum(page_bytes[self._layout_of[victims]])
        if not freed.size or freed[-1] < over:
            raise StoreError(Outcome.EXHAUSTED, (
                f"tenant {info.tenant!r} is at its quota of {format_size(quota)}: it holds "
                f"{format_size(used)}, asked for {asked} more, and its other pages are "
                "leased or being written"))
        # What it needs, then the whole pages that fit in the batch.
        count = max(int(np.searchsorted(freed, over)) + 1,
                    int(np.searchsorted(freed, target, side="right")))
        self._evict(victims[:count])

    def _keep_footprint(self, info: LayoutInfo, n: int, quota: int) -> None:
        """Keep the tenant's share of the pool's slabs within its quota when n more of
        its pages need a new extent (footprint.py says why and how); EXHAUSTED when its
        own pages of the class cannot make room in the extents already open."""
        free = self.pool.free_slots(info.cls)
        if n <= free:
            return                          # no new slabs: the byte quota is enough
        per = self.pool.extent_bytes(info.cls)
        new_bytes = -(-(n - free) * self.pool.slot_bytes(info.cls) // per) * per
        after = self._footprints.bytes_of(info.tenant, self.pool.class_extent_bytes,
                                          (info.cls, n, new_bytes))
        if after <= max(quota, new_bytes):
            return
        n_ids = self.pool.id_capacity
        mine = [i.idx for i in self._by_idx if i.tenant == info.tenant and i.cls == info.cls]
        eligible = self._evictable() & np.isin(self._layout_of[:n_ids], mine)
        victims = self._policy.victims(n - free, eligible)
        if len(victims) < n - free:
            raise StoreError(Outcome.EXHAUSTED, (
                f"tenant {info.tenant!r}: {n} pages of {format_size(info.page_bytes)} need "
                f"a new {format_size(per)} slab extent, and its pages would then take "
                f"{format_size(int(after))} of the pool's slabs, past its quota of "
                f"{format_size(quota)} (pages of many sizes each take whole slabs); its "
                "other pages of this size are leased or being written"))
        self._evict(victims)

    def commit(self, lease_id: int, tenant: str | None = None) -> int:
        """Make a reservation's pages visible; returns how many became READY.
        tenant: the caller, who must own the lease (None: the server itself)."""
        with self._lock:
            lease = self._take(lease_id, LeaseKind.RESERVE, tenant)
            info = self._by_idx[lease.layout]
            slots = lease.slots
            self._pins[slots] -= 1
            live, live_keys = [], []
            # States read once as a list: a numpy scalar read a key cost half the hold.
            for key, slot, state in zip(lease.keys, slots.tolist(),
                                        self._state[slots].tolist()):
                if state == WRITING and info.writing.get(key) == slot:
                    del info.writing[key]
                    live.append(slot)
                    live_keys.append(key)
                elif state == DOOMED and self._pins[slot] == 0:
                    self._free([slot])          # deleted while being written
            live_arr = np.array(live, dtype=np.int64)
            if live:
                size = len(live_keys[0])
                index = info.ready.get(size)
                if index is None:
                    index = info.ready[size] = KeyIndex(size)
                index.insert(b"".join(live_keys), live_arr)
            self._state[live_arr] = READY
            self._committed_at[live_arr] = self.clock() - self.started_at
            self._touch(live_arr)
            info.bytes_in += len(live) * info.page_bytes
            return len(live)

    def abort(self, lease_id: int, tenant: str | None = None) -> bool:
        """Drop a reservation: its slots are freed and its keys never become visible.
        False if it was unknown or had already expired (and so was undone already), or
        is another tenant's."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if (lease is None or lease.kind is not LeaseKind.RESERVE
                    or not _owns(tenant, lease)):
                return False
            self._undo_reservation(self._leases.pop(lease_id))
            return True

    def _undo_reservation(self, lease: Lease) -> None:
        info = self._by_idx[lease.layout]
        self._pins[lease.slots] -= 1
        for key, slot in zip(lease.keys, lease.slots.tolist()):
            if info.writing.get(key) == slot:
                del info.writing[key]
            if self._pins[slot] == 0:
                self._free([slot])
            else:
                self._state[slot] = DOOMED

    # -- gets -----------------------------------------------------------------------
    def acquire(self, layout_id: bytes, keys: Packed | Sequence[bytes],
                ttl: float | None = None, quota: int = 0) -> Pinned:
        """Pin every key's page for reading, reading pages on the tier below back into
        DRAM first; NOT_FOUND names the first key stored nowhere. quota: bytes the
        layout's tenant may hold (0 = unlimited): a page read back is the tenant's like a
        page it puts, so the read-back is held to its quota as a put is (reserve)."""
        keys = Packed.of(keys)
        for attempt in (0, 1):
            with self._lock:
                info = self.info(layout_id)
                slots = self._find(info, keys)
                missing = np.flatnonzero(slots < 0)
                if not missing.size:
                    np.add.at(self._pins, slots, 1)     # add.at: a key may repeat
                    self._touch(slots)
                    info.bytes_out += len(keys) * info.page_bytes
                    lease = self._leases.grant(LeaseKind.READ, slots,
                                               self.lease_ttl if ttl is None else ttl,
                                               owner=info.tenant)
                    return Pinned(lease.lease_id, info, slots, self.pool.offset[slots])
                # The pages already here become the most recent, so that making room
                # for the read-back (a quota, a full pool) takes other pages first.
                self._touch(slots[slots >= 0])
            if attempt or not self._promote(info, keys, missing, quota):
                first = int(missing[0])
                raise StoreError(Outcome.NOT_FOUND,
                                 f"key {first} of {len(keys)} ({keys.key(first).hex()}) is "
                                 f"not stored in layout {info.layout.layout_id.hex()}")
        raise AssertionError("unreachable")

    def _promote(self, info: LayoutInfo, keys: Packed, missing: np.ndarray,
                 quota: int = 0) -> bool:
        """Read the missing pages back from the tier below into DRAM (one batched read,
        outside the lock, into slots a reservation owns, within the tenant's quota);
        False if one is not there or cannot be read intact. The reservation is aborted
        whatever goes wrong: one left behind never expired, and its keys could not be
        stored again until a restart."""
        if isinstance(self.lower, NoDisk):
            return False
        wanted = keys.select(missing)
        if not self.lower.contains(info.layout_id, wanted).all():
            return False
        res = self.reserve(info.layout_id, wanted, ttl=FOREVER, quota=quota)
        committed = False
        try:
            todo = np.flatnonzero(res.slots >= 0)
            pb = info.page_bytes
            views = [self.mem[off:off + pb] for off in res.offsets[todo].tolist()]
            ok = self.lower.read_into(info.layout_id, [wanted[i] for i in todo], views)
            if not all(ok):             # a corrupt or unreadable page: never served
                return False
            promoted = self.commit(res.lease_id)
            committed = True
        finally:
            if not committed:
                self.abort(res.lease_id)
        with self._lock:
            self.promotions += promoted
        return True

    def release(self, lease_id: int, tenant: str | None = None) -> bool:
        """End a READ lease; False if it was unknown, had already expired, or is another
        tenant's (tenant None: the server itself)."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or not _owns(tenant, lease):
                return False
            self._leases.pop(lease_id)
            if lease.kind is LeaseKind.RESERVE:
                self._undo_reservation(lease)
            else:
                self._unpin(lease.slots)
            return True

    def _unpin(self, slots: np.ndarray) -> None:
        np.subtract.at(self._pins, slots, 1)
        doomed = slots[(self._state[slots] == DOOMED) & (self._pins[slots] == 0)]
        if doomed.size:
            self._free(np.unique(doomed))

    def _take(self, lease_id: int, kind: LeaseKind, tenant: str | None = None) -> Lease:
        lease = self._leases.get(lease_id)
        # Another tenant's lease reads as unknown: ids are guessable, existence is not news.
        if lease is None or lease.kind is not kind or not _owns(tenant, lease):
            raise StoreError(Outcome.EXPIRED, f"{kind.value} lease {lease_id} is unknown or "
                                              "has expired")
        return self._leases.pop(lease_id)

    def expire_leases(self) -> int:
        """Undo every lease past its expiry (a client that died holding it)."""
        with self._lock:
            gone = self._leases.expired()
            self._undo_leases(gone)
            if gone:
                log.info("expired %d leases (%d pages) not released in time", len(gone),
                         sum(len(lease.slots) for lease in gone))
            return len(gone)

    def break_leases(self) -> int:
        """Admin --force: undo every lease and reservation a client holds now, as if it
        had expired (a client that died holding them, before --lease-ttl ends them). A
        client still copying from a page so released may read a reused slot: for an
        operator who knows its clients are gone. Put and Get streams are never broken."""
        with self._lock:
            gone = self._leases.take_breakable()
            self._undo_leases(gone)
        if gone:
            log.warning("admin broke %d leases (%d pages)", len(gone),
                        sum(len(lease.slots) for lease in gone))
        return len(gone)

    def _undo_leases(self, leases: list[Lease]) -> None:
        for lease in leases:
            if lease.kind is LeaseKind.RESERVE:
                self._undo_reservation(lease)
            else:
                self._unpin(lease.slots)

    # -- deletes --------------------------------------------------------------------
    def delete(self, layout_id: bytes, keys: Packed | Sequence[bytes]) -> int:
        """Delete pages; a leased one turns invisible now and is freed at release."""
        keys = Packed.of(keys)
        with self._lock:
            info = self.info(layout_id)
            index = info.ready.get(keys.size)
            ready = (index.remove(keys.rows) if index is not None and len(keys)
                     else np.full(len(keys), -1, dtype=np.int64))
            writing = [info.writing.pop(keys.key(i), -1) for i in np.flatnonzero(ready < 0)]
            # A key may repeat in one request: drop its slot once, or the pool would take
            # it back twice and later hand it to two pages.
            gone = np.unique(ready[ready >= 0])
            self._drop(gone)
            self._drop(np.array([s for s in writing if s >= 0], dtype=np.int64))
            deleted = len(gone)
        if not isinstance(self.lower, NoDisk) and len(keys):
            # A page on both tiers counts once; one only on the tier below counts too
            # (it used to answer 0 for them). The tier returns once the delete is durable.
            in_dram = set(keys.select(np.flatnonzero(ready >= 0)))
            self.lower.delete(layout_id, list(in_dram))
            others = [k for k in dict.fromkeys(keys.select(np.flatnonzero(ready < 0)))
                      if k not in in_dram]
            deleted += self.lower.delete(layout_id, others)
        return deleted

    def _drop(self, slots: np.ndarray) -> None:
        """Slots already out of the index: free them, or doom them while pinned."""
        if not slots.size:
            return
        pinned = self._pins[slots] > 0
        self._state[slots[pinned]] = DOOMED
        self._policy.remove(slots[pinned])
        self._free(slots[~pinned])

    # -- slots and eviction -----------------------------------------------------------
    def _grow(self) -> None:
        n = self.pool.id_capacity
        if n <= len(self._state):
            return
        size = max(n, 2 * len(self._state))
        for name, fill in (("_state", 0), ("_pins", 0), ("_layout_of", -1),
                           ("_committed_at", 0), ("_touched_at", 0), ("_key_size", 0)):
            old = getattr(self, name)
            new = np.full(size, fill, dtype=old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)

    def _free(self, slots) -> None:
        slots = np.asarray(slots, dtype=np.int64)
        if not slots.size:
            return
        owners = self._layout_of[slots]
        per_layout = np.bincount(owners[owners >= 0], minlength=len(self._by_idx))
        for idx in np.flatnonzero(per_layout).tolist():
            info = self._by_idx[idx]
            self._tenant_bytes[info.tenant] -= int(per_layout[idx]) * info.page_bytes
            self._footprints.remove(info.tenant, info.cls, int(per_layout[idx]))
        self._state[slots] = FREE
        self._layout_of[slots] = -1
        self._policy.remove(slots)
        self.pool.free(slots)

    def _evictable(self) -> np.ndarray:
        self._grow()
        n = self.pool.id_capacity
        return (self._state[:n] == READY) & (self._pins[:n] == 0)

    def _evict(self, slots: np.ndarray) -> int:
        """Evict these unleased READY slots; returns bytes freed."""
        if not slots.size:
            return 0
        group = self._layout_of[slots].astype(np.int64) * 256 + self._key_size[slots]
        for g in np.unique(group).tolist():
            members = slots[group == g]
            info = self._by_idx[g // 256]
            index = info.ready[g % 256]
            if not isinstance(self.lower, NoDisk):
                # Write-behind: offer copies the page into the tier's staging memory and
                # returns at once (or drops it when the queue is full).
                pb = info.page_bytes
                for key, slot in zip(index.keys_of(members), members.tolist()):
                    off = int(self.pool.offset[slot])
                    self.lower.offer(info.layout_id, key.tobytes(), self.mem[off:off + pb])
            index.remove_slots(members)
            info.evictions += len(members)
        freed = int(self.pool.class_bytes[self.pool.cls[slots]].sum())
        self.evictions += len(slots)
        self._free(slots)
        return freed

    def _alloc(self, cls: int, n: int) -> np.ndarray:
        """n slots of class cls, evicting least recently used pages if needed."""
        got = self.pool.alloc(cls, n)
        self._grow()
        if len(got) == n:
            return got
        parts = [got]
        missing = n - len(got)
        # First the class's own pages: each eviction frees exactly one usable slot.
        n_ids = self.pool.id_capacity
        mine = self._evictable() & (self.pool.cls[:n_ids] == cls)
        self._evict(self._policy.victims(missing, mine))
        more = self.pool.alloc(cls, missing)
        parts.append(more)
        missing -= len(more)
        # Then other classes' pages, oldest first, until whole extents come free.
        batch = max(16, missing)
        while missing > 0:
            victims = self._policy.victims(batch, self._evictable())
            if victims.size == 0:
                break
            self._evict(victims)
            more = self.pool.alloc(cls, missing)
            parts.append(more)
            missing -= len(more)
        return np.concatenate(parts)

    def _enough(self, victims: np.ndarray, nbytes: int) -> int:
        """How many of the victims (in order) free at least nbytes (0 for nbytes <= 0)."""
        if nbytes <= 0:
            return 0
        sizes = self.pool.class_bytes[self.pool.cls[victims]]
        return int(np.searchsorted(np.cumsum(sizes), nbytes)) + 1

    def evict_to_watermark(self, batch: int = 256) -> int:
        """Evict LRU pages until usage is under the low watermark; returns pages evicted.
        Runs in the evictor thread, a batch per lock hold, so requests interleave."""
        evicted = 0
        while True:
            with self._lock:
                high = self.high_watermark * self.pool.capacity_bytes
                low = self.low_watermark * self.pool.capacity_bytes
                if self.pool.used_bytes <= (low if evicted else high):
                    self.pressure.clear()
                    return evicted
                victims = self._policy.victims(batch, self._evictable())
                if victims.size == 0:
                    return evicted
                victims = victims[: self._enough(victims, self.pool.used_bytes - low)]
                self._evict(victims)
                evicted += len(victims)

    def evict(self, *, layout_id: bytes | None = None, nbytes: int | None = None,
              everything: bool = False, tier: str = "dram") -> tuple[int, int, int]:
        """Admin eviction from tier "dram" (to the tier below), "disk" (gone), or "all":
        (pages, bytes, pages skipped because leased)."""
        if tier not in ("dram", "disk", "all"):
            raise StoreError(Outcome.INVALID, f"tier must be dram, disk or all, got {tier!r}")
        pages = freed = leased = 0
        if tier in ("dram", "all"):
            pages, freed, leased = self._evict_dram(layout_id, nbytes)
        if tier in ("disk", "all") and not isinstance(self.lower, NoDisk):
            if layout_id is not None:
                self.info(layout_id)
            more, more_bytes = self.lower.evict(nbytes=nbytes, layout_id=layout_id,
                                                everything=nbytes is None and layout_id is None)
            pages, freed = pages + more, freed + more_bytes
        return pages, freed, leased

    def _evict_dram(self, layout_id: bytes | None, nbytes: int | None) -> tuple[int, int, int]:
        with self._lock:
            n = self.pool.id_capacity
            live = self._state[:n] == READY
            idx = None if layout_id is None else self.info(layout_id).idx
            if idx is not None:
                live &= self._layout_of[:n] == idx
            leased = int(np.count_nonzero(live & (self._pins[:n] > 0)))
            eligible = live & (self._pins[:n] == 0)
            if nbytes is not None:
                victims = self._policy.victims(int(np.count_nonzero(eligible)), eligible)
                victims = victims[: self._enough(victims, nbytes)]
            else:
                victims = np.flatnonzero(eligible)
        # A batch a lock hold, as the evictor does: evicting 65,536 pages in one hold (each
        # offered to the disk tier) held the lock 2.9 s. A victim leased or freed since it
        # was chosen is passed over; one whose slot went to another page meanwhile is
        # evicted in its place (of its layout, if one was named): the same to a cache.
        pages = freed = 0
        for start in range(0, len(victims), ADMIN_BATCH):
            with self._lock:
                chunk = victims[start:start + ADMIN_BATCH]
                ok = (self._state[chunk] == READY) & (self._pins[chunk] == 0)
                if idx is not None:
                    ok &= self._layout_of[chunk] == idx
                chunk = chunk[ok]
                freed += self._evict(chunk)
                pages += len(chunk)
        return pages, freed, leased

    def clear(self) -> tuple[int, int]:
        """Delete every page of every layout, in every tier (leased ones when released);
        a batch of pages a lock hold, as admin eviction."""
        pages = touched = 0
        for info in self.layouts():
            with self._lock:
                n = self.pool.id_capacity
                mine = np.flatnonzero((self._layout_of[:n] == info.idx)
                                      & (self._state[:n] == READY))
                writing = np.array(list(info.writing.values()), dtype=np.int64)
                info.writing.clear()
                self._drop(writing)
            touched += bool(mine.size or writing.size)
            for start in range(0, len(mine), ADMIN_BATCH):
                with self._lock:
                    chunk = mine[start:start + ADMIN_BATCH]
                    chunk = chunk[(self._state[chunk] == READY)
                                  & (self._layout_of[chunk] == info.idx)]
                    for size, index in info.ready.items():
                        index.remove_slots(chunk[self._key_size[chunk] == size])
                    self._drop(chunk)
                    pages += len(chunk)
        if not isinstance(self.lower, NoDisk):
            pages += self.lower.evict(everything=True)[0]
        return pages, touched

    def spill_all(self, timeout: float) -> tuple[int, int]:
        """Write every DRAM page to the tier below, for a graceful stop: (pages offered,
        pages left unwritten when the time ran out). The tier's queue is bounded, so this
        offers until it is full, waits for the writer, and goes on."""
        if isinstance(self.lower, NoDisk):
            return 0, 0
        deadline = time.monotonic() + timeout
        with self._lock:
            n = self.pool.id_capacity
            slots = np.flatnonzero(self._state[:n] == READY)
            group = self._layout_of[slots].astype(np.int64) * 256 + self._key_size[slots]
            todo = []
            for g in np.unique(group).tolist():
                members = slots[group == g]
                info = self._by_idx[g // 256]
                keys = info.ready[g % 256].keys_of(members)
                todo += [(info, k.tobytes(), int(self.pool.offset[m]))
                         for k, m in zip(keys, members.tolist())]
            # The pages stay pinned while offered: no request may reuse their slots.
            np.add.at(self._pins, slots, 1)
        offered = 0
        try:
            for info, key, off in todo:
                page = self.mem[off:off + info.page_bytes]
                while not self.lower.offer(info.layout_id, key, page):
                    if self.lower.stats()["failed"] or time.monotonic() > deadline:
                        return offered, len(todo) - offered
                    self.lower.flush(min(1.0, max(0.0, deadline - time.monotonic())))
                offered += 1
            left = self.lower.flush(max(0.0, deadline - time.monotonic()))
            return offered, left
        finally:
            with self._lock:
                self._unpin(slots)

    # -- introspection ----------------------------------------------------------------
    def inspect(self, layout_id: bytes, key: bytes) -> dict:
        with self._lock:
            info = self.info(layout_id)
            slot = int(self._find(info, Packed(key, len(key)))[0])
            if slot < 0:
                slot = info.writing.get(key)
            if slot is None:
                below = self.lower.describe(layout_id, key)
                if below is not None:
                    return below
                raise StoreError(Outcome.NOT_FOUND, f"key {key.hex()} is not stored in layout "
                                                    f"{layout_id.hex()}")
            now = self.clock() - self.started_at
            state = int(self._state[slot])
            return {
                "tier": "dram",
                "state": STATE_NAMES[state],
                "size_bytes": info.page_bytes,
                "age_seconds": float(now - self._committed_at[slot]) if state == READY else 0.0,
                "idle_seconds": float(now - self._touched_at[slot]) if state == READY else 0.0,
                "leases": int(self._pins[slot]),
                "slot_offset": int(self.pool.offset[slot]),
            }

    def stats(self) -> dict:
        with self._lock:
            n = self.pool.id_capacity
            ready = self._state[:n] == READY
            per_layout = np.bincount(self._layout_of[:n][ready], minlength=len(self._by_idx))
            layouts = []
            tenants: dict[str, dict] = {}
            for info in self._by_idx:
                pages = int(per_layout[info.idx])
                tenant = tenants.setdefault(info.tenant, {
                    "name": info.tenant, "pages": 0,
                    "used_bytes": self._tenant_bytes.get(info.tenant, 0)})
                tenant["pages"] += pages
                layouts.append({
                    "info": info, "pages": pages,
                    "used_bytes": pages * self.pool.slot_bytes(info.cls),
                    "hits": info.hits, "misses": info.misses, "evictions": info.evictions,
                    "bytes_in": info.bytes_in, "bytes_out": info.bytes_out,
                })
            return {
                "capacity_bytes": self.pool.capacity_bytes,
                "used_bytes": self.pool.used_bytes,
                "pages": int(np.count_nonzero(ready)),
                "hits": sum(i.hits for i in self._by_idx),
                "misses": sum(i.misses for i in self._by_idx),
                "evictions": self.evictions,
                "bytes_in": sum(i.bytes_in for i in self._by_idx),
                "bytes_out": sum(i.bytes_out for i in self._by_idx),
                "leases": len(self._leases),
                "leased_pages": int(np.count_nonzero(self._pins[:n] > 0)),
                "uptime_seconds": self.clock() - self.started_at,
                "promotions": self.promotions,
                "layouts": layouts,
                "tenants": list(tenants.values()),
                "lower": None if isinstance(self.lower, NoDisk) else self.lower.stats(),
                "lock": self._lock.holds(),
            }
