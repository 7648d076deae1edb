"""The store's calls as every transport serves them: access, limits, ttl and quota, once.

The gRPC service (service.py) and the fast path (fastpath/ops.py) are two front doors to
the same calls. Each decodes its request into the arguments below, calls one method here
and encodes what it returns; neither applies a rule of its own. So a new rule is written
here once, and a request one door refuses the other refuses with the same outcome and
message (tests/integration/test_fastpath.py, test_the_same_request_limits_as_grpc).

Every call names who it acts for (a Principal the transport authenticated, auth.py), its
layout by the client's own id (scoped to the caller here, access.py) and its keys as they
arrived: packed bytes and one key's size, bounded here before anything is built from them
(limits.py). The rules, in the order each call applies them:

    keys      past --max-keys-per-request: INVALID, before any work on them
    same host Reserve/Acquire: the caller may map the pool, and proves it mapped this
              server's current region (its token)
    layout    the caller's own, or "unknown layout"
    ttl       a client's lease_ms (0 = the server's ttl), never past the server's ttl
    quota     the caller's bytes, on every call that may bring pages into DRAM

Get and Put move page bytes themselves, so they hand back a with-block: Reading releases
the pages it pinned, Writing aborts a reservation that was not committed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from kvstore_protocol.keys import Packed
from kvstore_protocol.layout import MAX_LOOKUP_LAYOUTS, PageLayout

from ..access import caller_layout, check_region_token, may_map
from ..auth import Principal
from ..errors import Outcome, StoreError
from ..region import Region
from ..removals import MAX_READ, RemovalRead
from ..store import FOREVER, Store
from ..store.layouts import LayoutInfo
from ..store.sessions import Retained
from ..store.values import Pinned, Reservation
from .limits import MAX_RETAIN_SESSIONS, RequestLimits, request_message_bytes

__all__ = ["Bounds", "Calls", "Found", "Reading", "Writing"]


@dataclasses.dataclass(frozen=True, slots=True)
class Found:
    """A lookup's answer: the leading pages stored in every layout, the lease on them (0:
    none asked or none found), and, where pins were asked and granted, each layout's
    offsets of those pages in the pool, valid for `ttl` seconds."""

    count: int
    lease_id: int
    offsets: list[np.ndarray]
    ttl: float


@dataclasses.dataclass(frozen=True, slots=True)
class Bounds:
    """What one request may ask for on this server (limits.py), for a client to split by."""

    max_keys: int
    max_request_bytes: int
    max_lookup_layouts: int
    max_retain_sessions: int


class Reading:
    """A Get's pages, pinned until the with-block ends (then released)."""

    __slots__ = ("_store", "pinned")

    def __init__(self, store: Store, pinned: Pinned) -> None:
        self._store = store
        self.pinned = pinned

    def __enter__(self) -> Pinned:
        return self.pinned

    def __exit__(self, *exc: object) -> None:
        self._store.unpin_read(self.pinned)


class Writing:
    """A Put's reserved slots: commit() stores them; leaving the with-block without a
    commit aborts, so no slot outlives the call."""

    __slots__ = ("_committed", "_store", "page_bytes", "reservation")

    def __init__(self, store: Store, reservation: Reservation, page_bytes: int) -> None:
        self._store = store
        self.reservation = reservation
        self.page_bytes = page_bytes
        self._committed = False

    def __enter__(self) -> Writing:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._committed:
            self._store.abort(self.reservation.lease_id)

    def commit(self) -> int:
        """Store the pages written; the number stored."""
        stored = self._store.commit(self.reservation.lease_id)
        self._committed = True
        return stored


class Calls:
    """The calls over one store, for every transport (see the module docstring)."""

    def __init__(self, store: Store, auth_on: bool,
                 limits: RequestLimits | None = None) -> None:
        """auth_on: an auth file names the tenants (layouts are checked by owner).
        limits: what one request may ask for (limits.py)."""
        self.store = store
        self.auth_on = auth_on
        self.limits = limits or RequestLimits()

    # -- the rules -----------------------------------------------------------------------
    def keys(self, data: bytes, key_size: int, method: str) -> Packed:
        """The request's keys, refused (INVALID) past the keys-per-request limit."""
        return self.limits.checked_keys(data, key_size, method)

    def layout(self, who: Principal, layout_id: bytes) -> bytes:
        """The store's id of the caller's layout (access.caller_layout)."""
        return caller_layout(self.store, self.auth_on, who, layout_id)

    def ttl(self, lease_ms: int) -> float:
        """A client's lease_ms (0 = the server's ttl), capped at the server's ttl: a lease
        is how long a client that died holding pages keeps them from everyone, and a
        client asking 2^32-1 ms held the whole pool for 49.7 days."""
        ttl = self.store.lease_ttl
        return min(lease_ms / 1000.0, ttl) if lease_ms else ttl

    def _same_host(self, who: Principal, token: bytes) -> None:
        may_map(who)
        check_region_token(self.store, token)

    def bounds(self) -> Bounds:
        """The limits above, as a client asks for them (the same for every caller)."""
        max_keys = self.limits.max_keys
        return Bounds(max_keys, request_message_bytes(max_keys), MAX_LOOKUP_LAYOUTS,
                      MAX_RETAIN_SESSIONS)

    # -- layouts and the region ----------------------------------------------------------
    def attach(self, who: Principal) -> Region:
        """The shared region, for a caller trusted to map it."""
        may_map(who)
        return self.store.region

    def register_layout(self, who: Principal, layout: PageLayout) -> LayoutInfo:
        return self.store.register_layout(layout, who.name)

    # -- control -------------------------------------------------------------------------
    def lookup(self, who: Principal, layout_ids: Sequence[bytes], data: bytes,
               key_size: int, lease_ms: int, pins: bool = False) -> Found:
        """How many leading pages every layout holds, leased for lease_ms where asked
        (0 = no lease: the common case). pins: also their offsets, for a caller that may
        map the pool and took a lease."""
        keys = self.keys(data, key_size, "Lookup")
        self.limits.lookup(len(layout_ids), len(keys))
        ttl = self.ttl(lease_ms) if lease_ms else 0.0
        if len(layout_ids) == 1:            # an engine's: its rank's layout
            layouts = [caller_layout(self.store, self.auth_on, who, layout_ids[0])]
        else:
            layouts = [self.layout(who, layout_id) for layout_id in layout_ids]
        if pins and ttl and who.shared_memory:
            count, lease_id, offsets = self.store.lookup_pinned(layouts, keys, ttl)
            return Found(count, lease_id, offsets, ttl)
        count, lease_id = self.store.lookup(layouts, keys, ttl)
        return Found(count, lease_id, [], ttl)

    def count_misses(self, who: Principal, layout_ids: Sequence[bytes], data: bytes,
                     key_size: int) -> None:
        """Count a lookup the client answered itself (a miss in its presence map). A
        layout this server does not know (it restarted) has nothing to count, and an
        error would only be logged by a client that does not wait for the answer."""
        keys = self.keys(data, key_size, "Lookup")
        self.limits.lookup(len(layout_ids), len(keys))
        known = []
        for layout_id in layout_ids:
            try:                    # noqa: SIM105 - a per-call loop: no context manager
                known.append(self.layout(who, layout_id))
            except StoreError:
                pass
        self.store.count_misses(known, len(keys))

    def exists(self, who: Principal, layout_id: bytes, data: bytes,
               key_size: int) -> np.ndarray:
        keys = self.keys(data, key_size, "Exists")
        return self.store.exists(self.layout(who, layout_id), keys)

    def delete(self, who: Principal, layout_id: bytes, data: bytes, key_size: int) -> int:
        keys = self.keys(data, key_size, "Delete")
        return self.store.delete(self.layout(who, layout_id), keys)

    def retain(self, who: Principal, layout_id: bytes, data: bytes, key_size: int,
               session: str, ttl_ms: int) -> Retained:
        keys = self.keys(data, key_size, "Retain")
        return self.store.retain(self.layout(who, layout_id), keys, session,
                                 ttl_ms / 1000.0, quota=who.quota_bytes)

    def retain_many(self, who: Principal, layout_id: bytes, data: bytes, key_size: int,
                    sessions: Sequence[tuple[str, int, bytes]]) -> list[Retained]:
        """Several sessions' retains: (session, ttl_ms, key indexes as little-endian
        uint32s into the keys sent) each, answered in order as retain answers each."""
        keys = self.keys(data, key_size, "RetainMany")
        if any(len(index) % 4 for _, _, index in sessions):
            raise StoreError(Outcome.INVALID, "RetainMany: a key_index is little-endian "
                                              "uint32s (4 bytes each)")
        indexes = [np.frombuffer(index, dtype="<u4").astype(np.int64)
                   for _, _, index in sessions]
        self.limits.retain_many(len(keys), indexes)
        return self.store.retain_many(
            self.layout(who, layout_id), keys,
            [(session, ttl_ms / 1000.0, idx)
             for (session, ttl_ms, _), idx in zip(sessions, indexes, strict=True)],
            quota=who.quota_bytes)

    def release_retention(self, who: Principal, session: str) -> int:
        return self.store.release_retention(session, who.name)

    def removals(self, who: Principal, layout_ids: Sequence[bytes], after_seq: int,
                 epoch: int, limit: int) -> RemovalRead:
        """Pages that left the server's last tier, of the caller's own layouts (another
        tenant's are "unknown"), after the cursor; limit 0 = as many as one read gives."""
        if len(layout_ids) > MAX_LOOKUP_LAYOUTS:
            raise StoreError(Outcome.INVALID, f"Removals names {len(layout_ids)} layouts; "
                                              f"at most {MAX_LOOKUP_LAYOUTS}")
        scoped = [self.layout(who, layout_id) for layout_id in layout_ids]
        return self.store.removals.read(scoped, after_seq, epoch, limit or MAX_READ)

    # -- leases: the same-host data plane and the end of every lease ---------------------
    def reserve(self, who: Principal, layout_id: bytes, data: bytes, key_size: int,
                token: bytes, lease_ms: int) -> Reservation:
        """Slots the caller writes through its own mapping of the pool."""
        keys = self.keys(data, key_size, "Reserve")
        self._same_host(who, token)
        return self.store.reserve(self.layout(who, layout_id), keys,
                                  ttl=self.ttl(lease_ms), quota=who.quota_bytes)

    def acquire(self, who: Principal, layout_id: bytes, data: bytes, key_size: int,
                token: bytes, lease_ms: int) -> Pinned:
        """Pages pinned for the caller to read through its own mapping of the pool."""
        keys = self.keys(data, key_size, "Acquire")
        self._same_host(who, token)
        return self.store.acquire(self.layout(who, layout_id), keys,
                                  ttl=self.ttl(lease_ms), quota=who.quota_bytes)

    def commit(self, who: Principal, lease_id: int) -> int:
        return self.store.commit(lease_id, who.name)

    def abort(self, who: Principal, lease_id: int) -> bool:
        return self.store.abort(lease_id, who.name)

    def release(self, who: Principal, lease_id: int, pages_read: int = 0) -> bool:
        """End a read lease; pages_read: how many were read under it (counted served)."""
        return self.store.release(lease_id, who.name, pages_read)

    # -- page bytes through the server ---------------------------------------------------
    def get(self, who: Principal, layout_id: bytes, data: bytes, key_size: int) -> Reading:
        """The pages pinned while the transport sends them. A key named 16,384 times
        would pin its page while 16,384 copies are sent: refused past the pool's size.
        Pages read back from disk are charged like a put: the tenant's quota holds."""
        keys = self.keys(data, key_size, "Get")
        layout = self.layout(who, layout_id)
        self.limits.get_bytes(len(keys), self.store.info(layout).page_bytes,
                              self.store.pool.capacity_bytes)
        return Reading(self.store, self.store.pin_read(layout, keys, quota=who.quota_bytes))

    def get_few(self, who: Principal, layout_id: bytes, data: bytes, key_size: int,
                now: Callable[[LayoutInfo, list[int]], bool] | None = None
                ) -> tuple[LayoutInfo, list[int], list[int]] | None:
        """get's pins as Python ints, for up to FEW_READS keys all in DRAM: (layout, slots,
        pool offsets), under the same rules as get; None where get must be asked instead
        (nothing pinned: a key below DRAM or missing, or more keys). The caller ends it
        with store.unpin_few once the pages are sent (store/few_reads.py); now: the
        transport's send without waiting, under the store's lock (FewReads.pin)."""
        keys = self.keys(data, key_size, "Get")
        layout = self.layout(who, layout_id)
        self.limits.get_bytes(len(keys), self.store.info(layout).page_bytes,
                              self.store.pool.capacity_bytes)
        return self.store.pin_few(layout, keys, now)

    def put(self, who: Principal, layout_id: bytes, data: bytes, key_size: int,
            data_len: int | None = None) -> Writing:
        """Slots the transport writes the pages into. data_len: the bytes the request
        says follow (where it says so before sending them), refused unless they fill
        exactly its pages."""
        keys = self.keys(data, key_size, "Put")
        layout = self.layout(who, layout_id)
        page_bytes = self.store.info(layout).page_bytes
        if data_len is not None:
            _fills(len(keys), page_bytes, data_len)
        reservation = self.store.reserve(layout, keys, ttl=FOREVER, quota=who.quota_bytes)
        return Writing(self.store, reservation, page_bytes)

    def put_bytes(self, who: Principal, layout_id: bytes, data: bytes, key_size: int,
                  pages: memoryview) -> tuple[int, int, int]:
        """put of pages the transport has already received (every key's, in key order),
        stored in one step (Store.put_bytes): (stored, skipped, in flight)."""
        keys = self.keys(data, key_size, "Put")
        layout = self.layout(who, layout_id)
        _fills(len(keys), self.store.info(layout).page_bytes, len(pages))
        return self.store.put_bytes(layout, keys, pages, quota=who.quota_bytes)


def _fills(n: int, page_bytes: int, data_len: int) -> None:
    """INVALID unless data_len bytes are exactly n pages."""
    if n * page_bytes != data_len:
        raise StoreError(Outcome.INVALID, (
            f"Put of {n} pages of {page_bytes} bytes needs {n * page_bytes} bytes of data, "
            f"the request says {data_len}"))
