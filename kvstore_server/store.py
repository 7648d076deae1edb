"""The page store: DRAM pages of every layout behind one lock, and their lifecycle.

The whole lifecycle across the tiers is drawn in tier.py; the DRAM half lives here:
reserve → WRITING → commit → READY → lease / release → evict (spilled to the tier below)
→ promote (read back by acquire), and delete. A READY page a session retains
(store_retention.py) is pinned like a leased one until its TTL or release; a delete
still removes it and ends its retention. Its parts, each in a module of its own:
the slot table (slots.py), the layout registry (layouts.py), victim selection over an
eviction policy (eviction.py, lru.py), tenants' quotas (quota.py), leases (leases.py),
stats values (stats.py), and the tier below (tier.py).

Tenants: a layout belongs to one tenant (tenants.py), and its slots are charged to that
tenant (quota.py); pages read back from the tier below are reserved the same way, so held
to the same quota. A lease remembers its tenant, and only that tenant may end it; an admin
may break every client's lease (break_leases).

Concurrency: one lock guards the registry, the slot table, the policy, the ledger and the
leases. Critical sections are short and vectorised; the bytes are copied outside the lock,
into slots a RESERVE lease owns or out of slots a READ lease pins, so no copy can race
with a reuse of its slot. The tier below is asked outside the lock too (it has its own),
except offer, which never waits.

Store is one class over one lock, written as mixins by idea: the per-request lifecycle
here, slots coming free and eviction in store_evict.py, lease endings in store_leases.py,
the bulk operations an admin runs (evict, clear, spill at stop) in store_admin.py, what
is asked of the tier below (a lookup's reach, read-backs) in store_below.py, sessions'
retention of their prefixes (a long pin that eviction respects) in store_retention.py.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from kvstore_protocol.keys import Packed
from kvstore_protocol.layout import MAX_LOOKUP_LAYOUTS, PageLayout

from .errors import Outcome, Reason, StoreError
from .eviction import PolicyFactory, make_policy
from .holdback import HoldBack
from .index import FEW_KEYS
from .layouts import DEFAULT_MAX_LAYOUTS, LayoutInfo, LayoutRegistry
from .leases import DEFAULT_LEASE_MEMORY, FOREVER, Lease, LeaseKind, LeaseTable
from .pool import Pool
from .presence import AREA_BYTES, Presence
from .quota import TenantLedger
from .region import HEADER_BYTES, Region
from .removals import Cause, RemovalRing
from .retention import RetentionLimits, RetentionTable
from .slots import SlotState, SlotTable
from .stats import StoreStats
from .store_admin import StoreAdmin
from .store_below import PROBE_CHUNK, StoreBelow
from .store_evict import StoreEviction
from .store_leases import StoreLeases, owns
from .store_retention import Retained, StoreRetention
from .store_values import Pinned, Reservation
from .tenants import DEFAULT_TENANT
from .tier import NullTier, Tier
from .timed_lock import TimedLock

__all__ = ["FOREVER", "LayoutInfo", "Pinned", "Reservation", "Retained", "Store"]

FREE, WRITING, READY, DOOMED = SlotState
_READY, _DOOMED = int(READY), int(DOOMED)     # for numpy: see store_leases._DOOMED

_NONE_MISSING = np.empty(0, dtype=np.int64)      # acquire: no key is missing


# Up to this many keys, _leading reads them as Python ints: its numpy form is three calls.
_FEW_LEADING = 64


def _leading(slots: np.ndarray) -> int:
    """How many leading entries are slots (>= 0), up to the first -1."""
    if len(slots) <= _FEW_LEADING:
        listed = slots.tolist()
        return listed.index(-1) if -1 in listed else len(listed)
    return int(np.argmin(slots >= 0)) if (slots < 0).any() else len(slots)


def _absent(slots: np.ndarray) -> list[int]:
    """Indices of the -1 entries."""
    if len(slots) <= _FEW_LEADING:
        return [i for i, slot in enumerate(slots.tolist()) if slot < 0]
    return np.flatnonzero(slots < 0).tolist()


class Store(StoreLeases, StoreEviction, StoreAdmin, StoreBelow, StoreRetention):
    """Pages of every layout in one shared region, with leases and policy eviction."""

    def __init__(self, region: Region, *, lease_ttl: float = 30.0,
                 lease_memory: int = DEFAULT_LEASE_MEMORY,
                 max_layouts: int = DEFAULT_MAX_LAYOUTS,
                 high_watermark: float = 0.95, low_watermark: float = 0.85,
                 clock: Callable[[], float] = time.monotonic,
                 lower: Tier | None = None,
                 policy: PolicyFactory | str | None = None,
                 through: Tier | None = None, presence: bool = False,
                 retention: RetentionLimits | None = None,
                 removals: RemovalRing | None = None) -> None:
        """lower: the tier below DRAM (tier.py); evicted pages are offered to it, and a
        lookup, exists or acquire that misses in DRAM asks it. policy: the eviction
        policy, or the name of one (eviction.make_policy). through: a tier that is
        offered every page at commit as well (the far tier under --far-write through, so
        other hosts see a page at once), not only when it leaves DRAM. presence: keep the
        presence map in the region's last AREA_BYTES (kvstore_server.presence), while no
        tier below DRAM holds pages (the area is set aside either way). retention: each
        tenant's retention quota and session cap (retention.py; None: the defaults).
        removals: where pages that leave this server are recorded (removals.py; None: a
        ring of the default size; the disk tier records into the same one)."""
        self.region = region
        self.mem = region.mem
        area = AREA_BYTES if presence else 0
        self.pool = Pool(region.size - HEADER_BYTES - area, base=HEADER_BYTES)
        self.lease_ttl = lease_ttl
        self.lease_memory = lease_memory     # bytes clients' leases may take (store_leases)
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self.clock = clock
        self.lower: Tier = lower if lower is not None else NullTier()
        self.through = through
        # Keys the tier below is asked about at once (see _reach): a far tier pays a
        # round trip per call, so it asks for bigger chunks than the disk tier's.
        self._probe_chunk = max(PROBE_CHUNK, self.lower.probe_chunk)
        # Guards everything below. Timed: the longest hold is the longest one call can
        # stall the others (limits.py bounds it; /metrics shows it).
        self._lock = TimedLock()
        self.promotions = 0                    # pages read back from the tier below
        self.evictions = 0
        self._tenants = TenantLedger()
        self._layouts = LayoutRegistry(max_layouts)
        # Same-host clients answer misses from it (None: off); the store's lock guards it.
        self.presence: Presence | None = None
        if presence and not self.lower.holds_pages:
            at = region.size - area
            self.presence = self._layouts.presence = Presence(
                region.mem[:HEADER_BYTES], region.mem[at:], at)
            self.presence.start()
        self._policy = make_policy(policy)
        self._leases = LeaseTable(clock)
        self._held_back = HoldBack()           # slots of expired leases (store_leases)
        self.retention = retention or RetentionLimits()
        self._retained = RetentionTable()      # sessions' pins (store_retention)
        self._slots = SlotTable()
        self.removals = removals if removals is not None else RemovalRing()
        self.started_at = clock()
        self.pressure = threading.Event()      # set when usage crosses the high watermark

    def stats(self) -> StoreStats:
        """StoreAdmin's stats, with the sessions' retention: a retained page is pinned,
        but by no lease, so it leaves leased_pages (a slot's pins are its live leases',
        its held-back leases' and its sessions')."""
        base = super().stats()
        with self._lock:
            n = self.pool.id_capacity
            pins = self._slots.pins[:n].astype(np.int64)
            for held in (self._held_back.counts, self._retained.count):
                k = min(n, len(held))
                pins[:k] -= held[:k]
            return dataclasses.replace(
                base, leased_pages=int(np.count_nonzero(pins > 0)),
                retained_pages=self._retained.pages(),
                retention_sessions=len(self._retained),
                retention_refused=self._retained.refused())

    # -- layouts --------------------------------------------------------------------
    def register_layout(self, layout: PageLayout, tenant: str = DEFAULT_TENANT) -> LayoutInfo:
        """Idempotent: the same layout of one tenant always gets the same LayoutInfo; its
        layout_id is scoped_layout_id(tenant, layout.layout_id)."""
        with self._lock:
            try:
                cls = self.pool.class_for(layout.page_bytes)
            except ValueError as exc:
                raise StoreError(Outcome.INVALID, str(exc)) from None
            return self._layouts.register(layout, tenant, cls)

    def info(self, layout_id: bytes) -> LayoutInfo:
        """The registered layout (StoreError, reason LAYOUT_UNKNOWN, if none). A dict
        read, safe without the lock: layouts are only ever added."""
        return self._layouts.info(layout_id)

    def layouts(self) -> list[LayoutInfo]:
        return list(self._layouts.by_idx)

    # -- lookups --------------------------------------------------------------------
    @staticmethod
    def _find(info: LayoutInfo, keys: Packed) -> np.ndarray:
        """The READY slot of each key, -1 where there is none."""
        index = info.ready.get(keys.size)
        if index is None or not len(keys):
            return np.full(len(keys), -1, dtype=np.int64)
        if len(keys) <= FEW_KEYS:            # no numpy call on the way (index.find_few)
            return np.array(index.find_few(keys.data), dtype=np.int64)
        return index.find(keys.rows)

    def _touch(self, slots: np.ndarray) -> None:
        # Reversed: the prefix's head becomes the most recent, its tail goes first.
        self._policy.touch(slots[::-1])
        self._slots.touched_at[slots] = self.clock() - self.started_at

    def lookup(self, layout_ids: Sequence[bytes], keys: Packed | Sequence[bytes],
               lease_ttl: float = 0.0) -> tuple[int, int]:
        """(leading keys present in every layout, lease id or 0)."""
        count, lease_id, _ = self._lookup(layout_ids, keys, lease_ttl, offsets=False)
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
            # request of 20k ids and 2k keys held it for 0.5 s (found by fuzzing).
            raise StoreError(Outcome.INVALID, f"lookup names {len(layout_ids)} layouts; at "
                                              f"most {MAX_LOOKUP_LAYOUTS} (one per rank)")
        layout_ids = list(dict.fromkeys(layout_ids))     # a repeated id counts once
        with self._lock:
            infos = [self.info(layout_id) for layout_id in layout_ids]
            if not self.lower.holds_pages and self._first_absent(infos, keys):
                return self._missed(infos, len(keys))
            found = [self._find(info, keys) for info in infos]
            if not self.lower.holds_pages:
                count = min(_leading(f) for f in found)
                return self._count_and_lease(infos, keys, found, count, lease_ttl, offsets)
        # The tier below is asked outside the store's lock: it has its own, and its probe
        # costs a dict lookup a key (a Lookup of 60 M keys held the store's lock 11.5 s).
        count = min(self._reach(info, keys, slots) for info, slots in zip(infos, found, strict=True))
        run = keys if count == len(keys) else Packed(keys.data[:count * keys.size], keys.size)
        with self._lock:
            # Find the run's DRAM pages again, to touch and pin them in this hold: one
            # may have moved down meanwhile (it is then read back by Acquire, like any
            # page of the run on the tier below).
            found = [self._find(info, run) for info in infos]
            return self._count_and_lease(infos, keys, found, count, lease_ttl, offsets)

    def count_misses(self, layout_ids: Sequence[bytes], n: int) -> None:
        """n keys a client counted as missed on its own, from the presence map
        (kvstore_server.presence): misses of each of these layouts registered here."""
        with self._lock:
            self._missed([info for layout_id in dict.fromkeys(layout_ids)
                          if (info := self._layouts.get(layout_id)) is not None], n)

    # A prefix whose first key is absent counts 0, found from that key alone. The batch
    # path's ~25 numpy calls cost little warm but much with the caches cold, as a request
    # after idle finds them. A 64-key lookup that hits nothing (dev VM, in-process, the
    # CPU caches evicted between calls; five runs side by side, medians): 144-178 us
    # through the batch, 42-58 us here; warm, 34 against 3.4 us.
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
        run = [slots[:count] for slots in found]
        # Without a tier below, every page of the run is in DRAM (count stops at the
        # first one absent): no mask to take.
        dram = [slots[slots >= 0] for slots in run] if self.lower.holds_pages else run
        for info, run_slots in zip(infos, dram, strict=True):
            info.hits += count
            info.misses += len(keys) - count
            self._touch(run_slots)
        pinned = dram[0] if len(dram) == 1 else np.concatenate(dram)
        if lease_ttl <= 0 or not pinned.size:
            return count, 0, []
        if not self._may_lease(pinned.size):
            self._leases_full("a leased Lookup answered without a lease")
            return count, 0, []
        self._pin(pinned)                           # a key may repeat: pinned as often
        lease_id = self._leases.grant(LeaseKind.READ, pinned, lease_ttl,
                                      owner=infos[0].tenant).lease_id
        if not offsets:
            return count, lease_id, []
        offset = self.pool.offset
        return count, lease_id, [np.where(s >= 0, offset[np.maximum(s, 0)], -1) for s in run]

    def exists(self, layout_id: bytes, keys: Packed | Sequence[bytes]) -> np.ndarray:
        """One bool per key: stored in this layout, in DRAM or on the tier below."""
        keys = Packed.of(keys)
        with self._lock:
            info = self.info(layout_id)
            present = self._find(info, keys) >= 0
        missing = np.flatnonzero(~present)
        if missing.size and self.lower.holds_pages:
            # Outside the store's lock, as in lookup.
            present[missing] = self.lower.contains(info.layout_id, keys.select(missing))
        return present

    # -- puts -----------------------------------------------------------------------
    def reserve(self, layout_id: bytes, keys: Packed | Sequence[bytes],
                ttl: float | None = None, quota: int = 0) -> Reservation:
        """WRITING slots for the keys not yet present; the caller writes, then commits.
        quota: bytes the layout's tenant may hold (0 = unlimited); see quota.py."""
        keys = Packed.of(keys)
        with self._lock:
            info = self.info(layout_id)
            wanted = []
            seen = set()
            in_flight = 0
            for i in _absent(self._find(info, keys)):
                key = keys.key(i)
                if key in info.writing:
                    in_flight += 1
                elif key not in seen:
                    wanted.append(i)
                    seen.add(key)
            if ttl != FOREVER and not self._may_lease(len(wanted), len(wanted)):
                raise StoreError(Outcome.EXHAUSTED,
                                 self._leases_full(f"Reserve of {len(wanted)} pages refused"))
            if quota:
                self._room_for(info, len(wanted), quota)
            got = self._alloc(info.cls, len(wanted))
            if len(got) < len(wanted):
                self.pool.free(got)
                raise StoreError(Outcome.EXHAUSTED,
                                 f"pool full: no room for {len(wanted)} pages of "
                                 f"{info.page_bytes} bytes; every page is leased or being "
                                 "written")
            new_keys = keys.select(wanted)
            self._slots.grow(self.pool.id_capacity)
            self._slots.take(got, info.idx, keys.size)
            for key, slot in zip(new_keys, got.tolist(), strict=True):
                info.writing[key] = slot
            self._tenants.charge(info, len(got))
            lease = self._leases.grant(LeaseKind.RESERVE, got,
                                       self.lease_ttl if ttl is None else ttl,
                                       info.idx, new_keys, owner=info.tenant)
            if self.pool.used_bytes > self.high_watermark * self.pool.capacity_bytes:
                self.pressure.set()
            slots, offsets = self._placed(len(keys), wanted, got)
            return Reservation(lease.lease_id, info, slots, offsets, in_flight)

    def _placed(self, n: int, wanted: list[int], got: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
        """(slot, pool offset) of each of n keys: got[j] for key wanted[j], -1 for the
        rest. A few keys as Python ints (see _FEW_LEADING): the array form is 5 calls."""
        if n <= _FEW_LEADING:
            slot_list, off_list = [-1] * n, [-1] * n
            offset = self.pool.offset
            for i, slot in zip(wanted, got.tolist(), strict=True):
                slot_list[i] = slot
                off_list[i] = int(offset[slot])
            return np.array(slot_list, dtype=np.int64), np.array(off_list, dtype=np.int64)
        slots = np.full(n, -1, dtype=np.int64)
        slots[wanted] = got
        return slots, np.where(slots >= 0, self.pool.offset[np.maximum(slots, 0)], -1)

    def commit(self, lease_id: int, tenant: str | None = None, *,
               write_through: bool = True) -> int:
        """Make a reservation's pages visible; returns how many became READY.
        tenant: the caller, who must own the lease (None: the server itself).
        write_through False: not offered to the through tier (a page read back from it)."""
        with self._lock:
            lease = self._take(lease_id, LeaseKind.RESERVE, tenant)
            info = self._layouts.by_idx[lease.layout]
            slots = lease.slots
            self._slots.pins[slots] -= 1
            live, live_keys = [], []
            # States read once as a list: a numpy scalar read a key cost half the hold.
            for key, slot, state in zip(lease.keys, slots.tolist(),
                                        self._slots.state[slots].tolist(), strict=True):
                if state == WRITING and info.writing.get(key) == slot:
                    del info.writing[key]
                    live.append(slot)
                    live_keys.append(key)
                elif state == DOOMED and self._slots.pins[slot] == 0:
                    self._free([slot])          # deleted while being written
            live_arr = np.array(live, dtype=np.int64)
            if live:
                info.index_for(len(live_keys[0])).insert(b"".join(live_keys), live_arr)
            self._slots.state[live_arr] = _READY
            self._slots.committed_at[live_arr] = self.clock() - self.started_at
            self._touch(live_arr)
            info.bytes_in += len(live) * info.page_bytes
            if self.through is None or not write_through or not live:
                return len(live)
            # Offered outside the lock (each offer copies a page into the tier's queue:
            # 64 pages of 1 MiB would hold the lock for milliseconds), the slots pinned
            # meanwhile so that no eviction or delete reuses them under the copy.
            self._pin(live_arr)
            offsets = self.pool.offset[live_arr].tolist()
        pb = info.page_bytes
        try:
            for key, off in zip(live_keys, offsets, strict=True):
                self.through.offer(info.layout_id, key, self.mem[off:off + pb])
        finally:
            with self._lock:
                self._unpin(live_arr)
        return len(live)

    def abort(self, lease_id: int, tenant: str | None = None) -> bool:
        """Drop a reservation: its slots are freed and its keys never become visible.
        False if it was unknown or had already expired (and so was undone already), or
        is another tenant's."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if (lease is None or lease.kind is not LeaseKind.RESERVE
                    or not owns(tenant, lease)):
                return False
            self._leases.pop(lease_id)
            self._undo_reservation(lease)
            return True

    def _undo_reservation(self, lease: Lease) -> None:
        """A reservation's keys never become visible; its slots go free now, or at their
        last unpin."""
        self._forget_reservation(lease)
        self._unpin(lease.slots)

    def _forget_reservation(self, lease: Lease) -> None:
        """A reservation's keys never become visible; its slots are DOOMED, freed at the
        unpin that ends the reservation's own pin (held back: store_leases)."""
        info = self._layouts.by_idx[lease.layout]
        for key, slot in zip(lease.keys, lease.slots.tolist(), strict=True):
            if info.writing.get(key) == slot:
                del info.writing[key]
        self._slots.state[lease.slots] = _DOOMED

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
                if len(slots) == 1 and slots[0] >= 0:   # one page, present: no numpy
                    missing = _NONE_MISSING
                else:
                    missing = np.flatnonzero(slots < 0)
                if not missing.size:
                    if ttl != FOREVER and not self._may_lease(len(slots)):
                        raise StoreError(Outcome.EXHAUSTED, self._leases_full(
                            f"Acquire of {len(slots)} pages refused"))
                    self._pin(slots)
                    self._touch(slots)
                    info.bytes_out += len(keys) * info.page_bytes
                    info.served += len(keys)
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
                                 f"not stored in layout {info.layout.layout_id.hex()}",
                                 reason=Reason.PAGES_MISSING)
        raise AssertionError("unreachable")

    # -- deletes --------------------------------------------------------------------
    def delete(self, layout_id: bytes, keys: Packed | Sequence[bytes]) -> int:
        """Delete pages; a leased one turns invisible now and is freed at release."""
        keys = Packed.of(keys)
        with self._lock:
            info = self.info(layout_id)
            index = info.ready.get(keys.size)
            ready = (index.remove(keys.rows) if index is not None and len(keys)
                     else np.full(len(keys), -1, dtype=np.int64))
            writing = [info.writing.pop(keys.key(int(i)), -1) for i in np.flatnonzero(ready < 0)]
            # A key may repeat in one request: drop its slot once, or the pool would take
            # it back twice and later hand it to two pages.
            gone = np.unique(ready[ready >= 0])
            self._drop(gone)
            self._drop(np.array([s for s in writing if s >= 0], dtype=np.int64))
            deleted = len(gone)
        in_dram = list(dict.fromkeys(keys.select(np.flatnonzero(ready >= 0))))
        removed = list(in_dram)
        if self.lower.holds_pages and len(keys):
            # A page on both tiers counts once; one only on the tier below counts too
            # (it used to answer 0 for them). The tier returns once the delete is durable.
            self.lower.delete(layout_id, in_dram)
            held = set(in_dram)
            others = [k for k in dict.fromkeys(keys.select(np.flatnonzero(ready < 0)))
                      if k not in held]
            below = self.lower.delete(layout_id, others)
            deleted += below
            if below:            # which of them the tier held it does not say: all
                removed += others
        # Recorded once the delete is durable (removals.py).
        self.removals.record(layout_id, removed, Cause.DELETED)
        return deleted
