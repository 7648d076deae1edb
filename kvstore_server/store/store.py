"""The page store: DRAM pages of every layout behind one lock, and their lifecycle.

The whole lifecycle across the tiers is drawn in tier.py; the DRAM half lives here:
reserve → WRITING → commit → READY → lease / release → evict (spilled to the tier below)
→ promote (read back by acquire), and delete. A READY page a session retains
(sessions.py) is pinned like a leased one until its TTL or release; a delete
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
with a reuse of its slot; only put_bytes copies under it, a few pages the caller bounds
(the fast path's small put: 256 KiB at most). The tier below is asked outside the lock too (it has its own),
except offer, which never waits.

Store is the per-request lifecycle over one lock, and the front of its parts, each an
object that owns its own state and shares the rest through one StoreState (state.py,
where each shared field is declared and what guards it): lookups and exists, how long a
prefix is stored (lookups.Lookups), slots coming free and eviction (evict.Eviction), the lease book: leases, their pins and endings
(lease_book.LeaseBook), sessions' retention of their prefixes, a long pin that eviction
respects (sessions.Retention), what is asked of the tier below, a lookup's reach and
read-backs (below.Below), and the bulk operations an admin runs, evict, clear, spill
at stop, stats (admin.Admin). Over 400 lines because it is that front: the parts' state
as the server and the tests read it, and a one-line delegation per part's call (about
130 lines), beside the puts, gets and deletes themselves.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from kvstore_protocol.keys import Packed
from kvstore_protocol.layout import PageLayout

from ..errors import Outcome, Reason, StoreError
from ..region import HEADER_BYTES, Region
from ..removals import Cause, RemovalRing
from ..scope import Scope
from ..tenants import DEFAULT_TENANT
from ..tier import NullTier, PageInfo, Tier
from .admin import Admin, Invalidation
from .below import Below
from .evict import Eviction
from .eviction import PolicyFactory, make_policy
from .few_reads import FewReads
from .holdback import HoldBack
from .index import FEW_KEYS
from .layouts import DEFAULT_MAX_LAYOUTS, LayoutInfo, LayoutRegistry
from .lease_book import LeaseBook
from .leases import DEFAULT_LEASE_MEMORY, FOREVER, LeaseKind, LeaseTable
from .lookups import Lookups
from .metrics import StoreCollector
from .pool import Pool
from .presence import AREA_BYTES, Presence
from .quota import TenantLedger
from .retention import RetentionLimits
from .sessions import Retained, Retention
from .slots import SlotState, SlotTable
from .state import StoreState
from .stats import StoreStats
from .timed_lock import TimedLock
from .values import Pinned, Reservation

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

__all__ = ["FOREVER", "LayoutInfo", "Pinned", "Reservation", "Retained", "Store"]

FREE, WRITING, READY, DOOMED = SlotState
_READY = int(READY)                           # for numpy: see lease_book._DOOMED

# Up to this many keys, a slot array is read as Python ints (_absent, _placed): numpy's
# forms cost a few calls whatever the count.
FEW_LEADING = 64
_NONE_MISSING = np.empty(0, dtype=np.int64)      # acquire: no key is missing
_FEW_STORES = 4         # a commit's slots up to this many are stored one by one


def _absent(slots: np.ndarray) -> list[int]:
    """Indices of the -1 entries."""
    if len(slots) <= FEW_LEADING:
        return [i for i, slot in enumerate(slots.tolist()) if slot < 0]
    return np.flatnonzero(slots < 0).tolist()


class ThroughTier(Protocol):
    """What the store asks of the tier it writes through to at commit: offer() alone (a
    Tier, or the far tier's write-through view, far.wiring.through)."""

    def offer(self, layout_id: bytes, key: bytes, page) -> bool: ...


class Store:
    """Pages of every layout in one shared region, with leases and policy eviction."""

    def __init__(self, region: Region, *, lease_ttl: float = 30.0,
                 lease_memory: int = DEFAULT_LEASE_MEMORY,
                 max_layouts: int = DEFAULT_MAX_LAYOUTS,
                 high_watermark: float = 0.95, low_watermark: float = 0.85,
                 clock: Callable[[], float] = time.monotonic,
                 lower: Tier | None = None,
                 policy: PolicyFactory | str | None = None,
                 through: ThroughTier | None = None, presence: bool = False,
                 retention: RetentionLimits | None = None,
                 removals: RemovalRing | None = None) -> None:
        """lower: the tier below DRAM (tier.py); evicted pages are offered to it, and a
        lookup, exists or acquire that misses in DRAM asks it. policy: the eviction
        policy, or the name of one (eviction.make_policy). through: a tier that is
        offered every page at commit as well (the far tier under --far-write through, so
        other hosts see a page at once), not only when it leaves DRAM. presence: keep the
        presence map in the region's last AREA_BYTES (kvstore_server.store.presence), while no
        tier below DRAM holds pages (the area is set aside either way). retention: each
        tenant's retention quota and session cap (retention.py; None: the defaults).
        removals: where pages that leave this server are recorded (removals.py; None: a
        ring of the default size; the disk tier records into the same one)."""
        self.region = region
        area = AREA_BYTES if presence else 0
        self._s = s = StoreState(
            mem=region.mem, pool=Pool(region.size - HEADER_BYTES - area, base=HEADER_BYTES),
            lower=lower if lower is not None else NullTier(), clock=clock,
            started_at=clock(), lock=TimedLock(), slots=SlotTable(),
            layouts=LayoutRegistry(max_layouts), policy=make_policy(policy),
            tenants=TenantLedger(),
            removals=removals if removals is not None else RemovalRing())
        self.through = through
        # Same-host clients answer misses from it (None: off); the store's lock guards it.
        self.presence: Presence | None = None
        if presence and not s.lower.holds_pages:
            at = region.size - area
            self.presence = s.layouts.presence = Presence(
                region.mem[:HEADER_BYTES], region.mem[at:], at)
            self.presence.start()
        self._eviction = Eviction(s, high_watermark=high_watermark,
                                  low_watermark=low_watermark)
        self._book = LeaseBook(s, self._eviction, ttl=lease_ttl, memory=lease_memory)
        self._retention = Retention(s, self._book, retention or RetentionLimits())
        self._eviction.dropping.append(self._retention.forget)
        self._below = Below(s, self)
        self._lookups = Lookups(s, self._book, self._below)
        self._few = FewReads(s, self._book, self._eviction)
        self._admin = Admin(s, self._eviction, self._book, self._retention, self._below)

    # -- the parts' state, as the server and the tests read it ----------------------
    @property
    def mem(self) -> np.ndarray:
        return self._s.mem

    @property
    def pool(self) -> Pool:
        return self._s.pool

    @property
    def lower(self) -> Tier:
        return self._s.lower

    @lower.setter
    def lower(self, tier: Tier) -> None:
        self._s.lower = tier

    @property
    def removals(self) -> RemovalRing:
        """Where pages that leave this server are recorded (removals.py)."""
        return self._s.removals

    @property
    def clock(self) -> Callable[[], float]:
        return self._s.clock

    @property
    def lease_ttl(self) -> float:
        return self._book.ttl

    @property
    def lease_memory(self) -> int:
        return self._book.memory

    @lease_memory.setter
    def lease_memory(self, nbytes: int) -> None:
        self._book.memory = nbytes

    @property
    def high_watermark(self) -> float:
        return self._eviction.high_watermark

    @property
    def low_watermark(self) -> float:
        return self._eviction.low_watermark

    @property
    def pressure(self) -> threading.Event:
        """Set when usage crosses the high watermark (the evictor thread waits on it)."""
        return self._eviction.pressure

    @property
    def evictions(self) -> int:
        return self._eviction.evictions

    @property
    def promotions(self) -> int:
        """Pages read back from the tier below."""
        return self._below.promotions

    @property
    def retention(self) -> RetentionLimits:
        return self._retention.limits

    @property
    def _lock(self) -> TimedLock:
        return self._s.lock

    @property
    def _slots(self) -> SlotTable:
        return self._s.slots

    @property
    def _layouts(self) -> LayoutRegistry:
        return self._s.layouts

    @property
    def _leases(self) -> LeaseTable:
        return self._book.table

    @property
    def _held_back(self) -> HoldBack:
        return self._book.held_back

    _find = staticmethod(StoreState.find)

    # -- layouts --------------------------------------------------------------------
    def register_layout(self, layout: PageLayout, tenant: str = DEFAULT_TENANT) -> LayoutInfo:
        """Idempotent: the same layout of one tenant always gets the same LayoutInfo; its
        layout_id is scoped_layout_id(tenant, layout.layout_id)."""
        with self._s.lock:
            try:
                cls = self._s.pool.class_for(layout.page_bytes)
            except ValueError as exc:
                raise StoreError(Outcome.INVALID, str(exc)) from None
            return self._s.layouts.register(layout, tenant, cls)

    def info(self, layout_id: bytes) -> LayoutInfo:
        """The registered layout (StoreError, reason LAYOUT_UNKNOWN, if none). A dict
        read, safe without the lock: layouts are only ever added."""
        return self._s.layouts.info(layout_id)

    def layouts(self) -> list[LayoutInfo]:
        return list(self._s.layouts.by_idx)

    def in_dram(self, layout_id: bytes, keys: Sequence[bytes]) -> np.ndarray:
        """One bool per key: its page READY in DRAM (the far tier's watch of far-only
        pages, far/watch.py); all False for a layout not registered."""
        held = np.zeros(len(keys), dtype=bool)
        try:
            info = self._s.layouts.info(layout_id)
        except StoreError:
            return held
        by_size: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            by_size.setdefault(len(key), []).append(i)
        with self._s.lock:
            for at in by_size.values():
                held[at] = self._s.find(info, Packed.of([keys[i] for i in at])) >= 0
        return held

    # -- lookups: Lookups' ------------------------------------------------------------
    def lookup(self, layout_ids: Sequence[bytes], keys: Packed | Sequence[bytes],
               lease_ttl: float = 0.0) -> tuple[int, int]:
        """(leading keys present in every layout, lease id or 0): Lookups.lookup."""
        return self._lookups.lookup(layout_ids, keys, lease_ttl)

    def lookup_pinned(self, layout_ids: Sequence[bytes], keys: Packed | Sequence[bytes],
                      lease_ttl: float = 0.0) -> tuple[int, int, list[np.ndarray]]:
        """Like lookup, and where the counted pages lie (Lookups.lookup_pinned)."""
        return self._lookups.lookup_pinned(layout_ids, keys, lease_ttl)

    def count_misses(self, layout_ids: Sequence[bytes], n: int) -> None:
        """n keys a client counted as missed on its own (Lookups.count_misses)."""
        self._lookups.count_misses(layout_ids, n)

    def exists(self, layout_id: bytes, keys: Packed | Sequence[bytes]) -> np.ndarray:
        """One bool per key: stored in this layout, in DRAM or below (Lookups.exists)."""
        return self._lookups.exists(layout_id, keys)

    # -- puts -----------------------------------------------------------------------
    def reserve(self, layout_id: bytes, keys: Packed | Sequence[bytes],
                ttl: float | None = None, quota: int = 0) -> Reservation:
        """WRITING slots for the keys not yet present; the caller writes, then commits.
        quota: bytes the layout's tenant may hold (0 = unlimited); see quota.py."""
        keys = Packed.of(keys)
        s, book = self._s, self._book
        with s.lock:
            info = s.layouts.info(layout_id)
            wanted, new_keys, in_flight = self._wanted(info, keys)
            if ttl != FOREVER and not book.may_lease(len(wanted), len(wanted)):
                raise StoreError(Outcome.EXHAUSTED,
                                 book.full(f"Reserve of {len(wanted)} pages refused"))
            got = self._claim(info, keys, len(wanted), quota)
            for key, slot in zip(new_keys, got.tolist(), strict=True):
                info.writing[key] = slot
            lease = book.table.grant(LeaseKind.RESERVE, got,
                                     book.ttl if ttl is None else ttl,
                                     info.idx, new_keys, owner=info.tenant)
            slots, offsets = self._placed(len(keys), wanted, got)
            return Reservation(lease.lease_id, info, slots, offsets, in_flight)

    def put_bytes(self, layout_id: bytes, keys: Packed, data: memoryview,
                  quota: int = 0) -> tuple[int, int, int]:
        """reserve, the pages' bytes (data: every key's page, in key order) copied in and
        commit, in one hold of the lock, with no lease between: for a put whose bytes the
        server already holds (fastpath Ops.put says why). (stored, skipped, in flight)."""
        keys = Packed.of(keys)
        s = self._s
        with s.lock:
            info = s.layouts.info(layout_id)
            pb = info.page_bytes
            if len(data) != len(keys) * pb:
                raise StoreError(Outcome.INVALID, (
                    f"Put of {len(keys)} pages of {pb} bytes needs {len(keys) * pb} bytes "
                    f"of data, got {len(data)}"))
            wanted, live_keys, in_flight = self._wanted(info, keys)
            got = self._claim(info, keys, len(wanted), quota)
            slot_list = got.tolist()
            offset, mem = s.pool.offset, s.mem.data
            for i, slot in zip(wanted, slot_list, strict=True):
                off = int(offset[slot])
                mem[off:off + pb] = data[i * pb:(i + 1) * pb]
            pins = s.slots.pins
            for slot in slot_list:              # the reservation's pin (slots.take)
                pins[slot] -= 1
            offer = self._make_ready(info, slot_list, live_keys)
        if offer is not None:
            self._offer_through(info, live_keys, *offer)
        return len(wanted), len(keys) - len(wanted) - in_flight, in_flight

    def _wanted(self, info: LayoutInfo, keys: Packed
                ) -> tuple[list[int], list[bytes], int]:
        """(indexes of the keys a put stores: not READY, not being written, each named
        once; those keys; how many are being written by another reservation), under the
        lock. The keys come back with their indexes: each is sliced once, here."""
        wanted: list[int] = []
        new_keys: list[bytes] = []
        seen: set[bytes] = set()
        in_flight = 0
        writing = info.writing
        for i in self._absent(info, keys):
            key = keys.key(i)
            if key in writing:
                in_flight += 1
            elif key not in seen:
                wanted.append(i)
                new_keys.append(key)
                seen.add(key)
        return wanted, new_keys, in_flight

    def _claim(self, info: LayoutInfo, keys: Packed, n: int, quota: int) -> np.ndarray:
        """n WRITING slots of info's class, charged to its tenant (under the lock):
        room made within the quota, EXHAUSTED where the pool has none."""
        s = self._s
        if quota:
            self._eviction.room_for(info, n, quota)
        got = self._eviction.alloc(info.cls, n)
        if len(got) < n:
            s.pool.free(got)
            raise StoreError(Outcome.EXHAUSTED,
                             f"pool full: no room for {n} pages of "
                             f"{info.page_bytes} bytes; every page is leased or being "
                             "written")
        s.slots.grow(s.pool.id_capacity)
        s.slots.take(got, info.idx, keys.size)
        s.tenants.charge(info, len(got))
        self._eviction.note_usage()
        return got

    def _absent(self, info: LayoutInfo, keys: Packed) -> list[int]:
        """Indices of the keys not READY in this layout (under the lock): a few keys
        found as a list (find_few), with no array made and read back."""
        if len(keys) <= FEW_KEYS:
            index = info.ready.get(keys.size)
            if index is None or not len(keys):
                return list(range(len(keys)))
            return [i for i, slot in enumerate(index.find_few(keys.data)) if slot < 0]
        return _absent(self._s.find(info, keys))

    def _placed(self, n: int, wanted: list[int], got: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
        """(slot, pool offset) of each of n keys: got[j] for key wanted[j], -1 for the
        rest. A few keys as Python ints (see FEW_LEADING): the array form is 5 calls."""
        if n <= FEW_LEADING:
            slot_list, off_list = [-1] * n, [-1] * n
            offset = self._s.pool.offset
            for i, slot in zip(wanted, got.tolist(), strict=True):
                slot_list[i] = slot
                off_list[i] = int(offset[slot])
            return np.array(slot_list, dtype=np.int64), np.array(off_list, dtype=np.int64)
        slots = np.full(n, -1, dtype=np.int64)
        slots[wanted] = got
        return slots, np.where(slots >= 0, self._s.pool.offset[np.maximum(slots, 0)], -1)

    def commit(self, lease_id: int, tenant: str | None = None, *,
               write_through: bool = True) -> int:
        """Make a reservation's pages visible; returns how many became READY.
        tenant: the caller, who must own the lease (None: the server itself).
        write_through False: not offered to the through tier (a page read back from it)."""
        s, book = self._s, self._book
        with s.lock:
            lease = book.take(lease_id, LeaseKind.RESERVE, tenant)
            info = s.layouts.by_idx[lease.layout]
            slots = lease.slots
            slot_list = slots.tolist()
            pins = s.slots.pins
            if len(slot_list) == 1:         # one scalar store: a fancy-indexed -= costs more
                pins[slot_list[0]] -= 1
            else:
                pins[slots] -= 1            # a reservation's slots are distinct
            live, live_keys = [], []
            writing = info.writing
            # States read once as a list: a numpy scalar read a key cost half the hold.
            for key, slot, state in zip(lease.keys, slot_list,
                                        s.slots.state[slots].tolist(), strict=True):
                if state == WRITING and writing.get(key) == slot:
                    del writing[key]
                    live.append(slot)
                    live_keys.append(key)
                elif state == DOOMED and pins[slot] == 0:
                    self._eviction.free([slot])     # deleted while being written
            offer = self._make_ready(info, live, live_keys, write_through)
        if offer is not None:
            self._offer_through(info, live_keys, *offer)
        return len(live)

    def _make_ready(self, info: LayoutInfo, live: list[int], live_keys: list[bytes],
                    offer: bool = True) -> tuple[np.ndarray, list[int]] | None:
        """Written slots become READY pages of their keys (under the lock). Where they
        are to be offered to the through tier: the slots, pinned for _offer_through, and
        their offsets; else None."""
        s = self._s
        if live:
            info.index_for(len(live_keys[0])).insert(b"".join(live_keys), live)
        if len(live) <= _FEW_STORES:
            # A few: scalar stores, where each fancy store costs several (as touch).
            now = s.clock() - s.started_at
            state, committed = s.slots.state, s.slots.committed_at
            for slot in live:
                state[slot] = _READY
                committed[slot] = now
            s.touch_few(live)
        else:
            live_arr = np.array(live, dtype=np.int64)
            s.slots.state[live_arr] = _READY
            s.slots.committed_at[live_arr] = s.clock() - s.started_at
            s.touch(live_arr)
        info.bytes_in += len(live) * info.page_bytes
        if self.through is None or not offer or not live:
            return None
        live_arr = np.array(live, dtype=np.int64)
        # Offered outside the lock (each offer copies a page into the tier's queue:
        # 64 pages of 1 MiB would hold the lock for milliseconds), the slots pinned
        # meanwhile so that no eviction or delete reuses them under the copy.
        self._book.pin(live_arr)
        return live_arr, s.pool.offset[live_arr].tolist()

    def _offer_through(self, info: LayoutInfo, live_keys: list[bytes], live: np.ndarray,
                       offsets: list[int]) -> None:
        """Offer the pages _make_ready pinned to the through tier, then unpin them."""
        s = self._s
        assert self.through is not None
        pb = info.page_bytes
        try:
            for key, off in zip(live_keys, offsets, strict=True):
                self.through.offer(info.layout_id, key, s.mem[off:off + pb])
        finally:
            with s.lock:
                self._book.unpin(live)

    def abort(self, lease_id: int, tenant: str | None = None) -> bool:
        """Drop a reservation: its slots are freed and its keys never become visible.
        False if it was unknown or had already expired (and so was undone already), or
        is another tenant's."""
        return self._book.abort(lease_id, tenant)

    # -- gets -----------------------------------------------------------------------
    def acquire(self, layout_id: bytes, keys: Packed | Sequence[bytes],
                ttl: float | None = None, quota: int = 0) -> Pinned:
        """Pin every key's page for reading, reading pages on the tier below back into
        DRAM first; NOT_FOUND names the first key stored nowhere. quota: bytes the
        layout's tenant may hold (0 = unlimited): a page read back is the tenant's like a
        page it puts, so the read-back is held to its quota as a put is (reserve)."""
        keys = Packed.of(keys)
        s, book = self._s, self._book
        for attempt in (0, 1):
            with s.lock:
                info = s.layouts.info(layout_id)
                index = info.ready.get(keys.size)
                if index is not None and 0 < len(keys) <= FEW_KEYS:
                    # A few keys found as a list: which are missing is read from it.
                    found = index.find_few(keys.data)
                    slots = np.array(found, dtype=np.int64)
                    missing = (np.array([i for i, slot in enumerate(found) if slot < 0],
                                        dtype=np.int64) if -1 in found else _NONE_MISSING)
                else:
                    slots = s.find(info, keys)
                    missing = np.flatnonzero(slots < 0)
                if not missing.size:
                    if ttl != FOREVER and not book.may_lease(len(slots)):
                        raise StoreError(Outcome.EXHAUSTED, book.full(
                            f"Acquire of {len(slots)} pages refused"))
                    book.pin(slots)
                    s.touch(slots)
                    info.bytes_out += len(keys) * info.page_bytes
                    info.served += len(keys)
                    lease = book.table.grant(LeaseKind.READ, slots,
                                             book.ttl if ttl is None else ttl,
                                             owner=info.tenant)
                    return Pinned(lease.lease_id, info, slots, s.pool.offset[slots])
                # The pages already here become the most recent, so that making room
                # for the read-back (a quota, a full pool) takes other pages first.
                s.touch(slots[slots >= 0])
            if attempt or not self._below.promote(info, keys, missing, quota):
                first = int(missing[0])
                raise StoreError(Outcome.NOT_FOUND,
                                 f"key {first} of {len(keys)} ({keys.key(first).hex()}) is "
                                 f"not stored in layout {info.layout.layout_id.hex()}",
                                 reason=Reason.PAGES_MISSING)
        raise AssertionError("unreachable")

    def pin_read(self, layout_id: bytes, keys: Packed, quota: int = 0) -> Pinned:
        """acquire(ttl=FOREVER) for pages the server sends itself and unpins in a
        `finally` (a Get on either transport; end it with unpin_read): the same pins,
        touches and counts, but no lease when every page is in DRAM (lease_id 0). Such a
        lease was never a client's to end, nor expired or broken, and granting and
        ending it was a quarter of a one-page Get's store time. The stats count it as
        a lease still (LeaseBook.reading). A page on the tier below is read back by
        acquire, under a lease as before."""
        s = self._s
        with s.lock:
            info = s.layouts.info(layout_id)
            slots = s.find(info, keys)
            if slots[0] >= 0 if len(slots) == 1 else not (slots < 0).any():
                self._book.pin(slots)
                self._book.reading += 1
                s.touch(slots)
                info.bytes_out += len(keys) * info.page_bytes
                info.served += len(keys)
                return Pinned(0, info, slots, s.pool.offset[slots])
        return self.acquire(layout_id, keys, FOREVER, quota)

    def pin_few(self, layout_id: bytes, keys: Packed,
                now: Callable[[LayoutInfo, list[int]], bool] | None = None
                ) -> tuple[LayoutInfo, list[int], list[int]] | None:
        """pin_read of up to FEW_READS keys all in DRAM, as ints: (layout, slots, offsets),
        or None (nothing pinned: ask pin_read); now: pages used under the lock, unpinned
        (FewReads.pin). End it with unpin_few (few_reads.py)."""
        return self._few.pin(layout_id, keys, now)

    def unpin_few(self, slots: list[int]) -> None:
        """End a pin_few: its pins go (a DOOMED page is freed with its last)."""
        self._few.unpin(slots)

    def unpin_read(self, pinned: Pinned) -> None:
        """End a pin_read: its pins go (a DOOMED page is freed with its last)."""
        if pinned.lease_id:
            self._book.release(pinned.lease_id)
            return
        with self._s.lock:
            self._book.reading -= 1
            self._book.unpin(pinned.slots)

    # -- deletes --------------------------------------------------------------------
    def delete(self, layout_id: bytes, keys: Packed | Sequence[bytes]) -> int:
        """Delete pages; a leased one turns invisible now and is freed at release."""
        keys = Packed.of(keys)
        s = self._s
        with s.lock:
            info = s.layouts.info(layout_id)
            index = info.ready.get(keys.size)
            gone: np.ndarray | list[int]
            if len(keys) <= FEW_KEYS:
                # A few keys (an engine's per-block delete): found and removed as Python
                # ints (find_few, remove_slots of a list), no per-key array.
                found = (index.find_few(keys.data) if index is not None and len(keys)
                         else [-1] * len(keys))
                # A key may repeat in one request: drop its slot once, or the pool would
                # take it back twice and later hand it to two pages.
                distinct = sorted({slot for slot in found if slot >= 0})
                if distinct and index is not None:
                    index.remove_slots(distinct)
                at_ready = [i for i, slot in enumerate(found) if slot >= 0]
                at_absent = [i for i, slot in enumerate(found) if slot < 0]
                gone = distinct            # a list: dropped by scalar reads and stores
            else:
                ready = (index.remove(keys.rows) if index is not None and len(keys)
                         else np.full(len(keys), -1, dtype=np.int64))
                at_ready = np.flatnonzero(ready >= 0).tolist()
                at_absent = np.flatnonzero(ready < 0).tolist()
                gone = np.unique(ready[ready >= 0])      # a repeated key: dropped once
            writing = [slot for i in at_absent
                       if (slot := info.writing.pop(keys.key(i), -1)) >= 0]
            if len(gone):
                self._eviction.drop(gone)
            if writing:
                self._eviction.drop(np.array(writing, dtype=np.int64))
            deleted = len(gone)
        in_dram = list(dict.fromkeys(keys.select(at_ready)))
        removed = list(in_dram)
        if s.lower.holds_pages and len(keys):
            # A page on both tiers counts once; one only on the tier below counts too
            # (it used to answer 0 for them). The tier returns once the delete is durable.
            s.lower.delete(layout_id, in_dram)
            held = set(in_dram)
            others = [k for k in dict.fromkeys(keys.select(at_absent)) if k not in held]
            below = s.lower.delete(layout_id, others)
            deleted += below
            if below:            # which of them the tier held it does not say: all
                removed += others
        # Recorded once the delete is durable (removals.py).
        s.removals.record(layout_id, removed, Cause.DELETED)
        return deleted

    # -- leases, retention: the lease book's and retention's ------------------------
    def release(self, lease_id: int, tenant: str | None = None, pages_read: int = 0) -> bool:
        """End a lease (LeaseBook.release): False if unknown, expired or another's."""
        return self._book.release(lease_id, tenant, pages_read)

    def expire_leases(self) -> int:
        """End the leases past their expiry and the sessions past their TTL, in one lock
        hold (LeaseBook.expire, Retention.expire); returns the leases ended."""
        with self._s.lock:
            ended = self._book.expire()
            self._retention.expire()
            return ended

    def break_leases(self) -> int:
        """Admin --force: undo every lease and reservation a client holds, let go of the
        slots held back, and end every session's retention (LeaseBook.break_all)."""
        with self._s.lock:
            gone, held = self._book.break_all()
            self._retention.end_all()       # sessions' pins are the same kind of hold
        self._book.said_broken(gone, held)
        return len(gone)

    def retain(self, layout_id: bytes, keys: Packed, session: str, ttl: float,
               quota: int = 0) -> Retained:
        """Keep a session's leading run of keys in DRAM for ttl s (Retention.retain)."""
        return self._retention.retain(layout_id, keys, session, ttl, quota)

    def retain_many(self, layout_id: bytes, keys: Packed,
                    asks: Sequence[tuple[str, float, np.ndarray]],
                    quota: int = 0) -> list[Retained]:
        """Several sessions' retains, answered in order (Retention.retain_many)."""
        return self._retention.retain_many(layout_id, keys, asks, quota)

    def release_retention(self, session: str, tenant: str) -> int:
        """End a tenant's session now: pages it no longer keeps (0 if none such)."""
        return self._retention.release(session, tenant)

    # -- eviction and admin: Eviction's and Admin's ---------------------------------
    def evict_to_watermark(self, batch: int = 256) -> int:
        """Evict until usage is under the low watermark (the evictor thread's turn)."""
        return self._eviction.evict_to_watermark(batch)

    def evict(self, *, layout_id: bytes | None = None, nbytes: int | None = None,
              everything: bool = False, tier: str = "dram") -> tuple[int, int, int]:
        """Admin eviction (Admin.evict): (pages, bytes, pages skipped because leased)."""
        return self._admin.evict(layout_id=layout_id, nbytes=nbytes,
                                 everything=everything, tier=tier)

    def clear(self) -> tuple[int, int]:
        """Delete every page of every layout, in every tier (Admin.clear)."""
        return self._admin.clear()

    def invalidate(self, scope: Scope) -> Invalidation:
        """Delete the scope's pages from every tier (Admin.invalidate)."""
        return self._admin.invalidate(scope)

    def spill_all(self, timeout: float) -> tuple[int, int]:
        """Write every DRAM page to the tier below, for a graceful stop (Admin.spill_all)."""
        return self._admin.spill_all(timeout)

    def inspect(self, layout_id: bytes, key: bytes) -> PageInfo:
        """Where one page is and its state (Admin.inspect)."""
        return self._admin.inspect(layout_id, key)

    def stats(self) -> StoreStats:
        """The store's stats and its tiers' (Admin.stats)."""
        return self._admin.stats()

    def register_metrics(self, registry: CollectorRegistry) -> None:
        """DRAM's kvstore_* families (store/metrics.py), then the tiers' below."""
        registry.register(StoreCollector(self.stats))
        self._s.lower.register_metrics(registry)
