"""Store's leases: the memory clients' leases may take, and their ending (released by
their client, expired, or broken by an admin).

A mixin of Store (store.py), which owns the lock and the lease table; a READ lease's end
unpins its pages (a DOOMED page is freed with its last pin), a RESERVE lease's end undoes
the reservation as abort does. A lease that expires ends in two steps: at once it is
gone (a reservation's keys never become visible, a commit or release of it is refused),
but its slots stay pinned for another lease_ttl (--lease-ttl), since its client may be
only slow and still copying (holdback.py says why); then they are unpinned as above.

The leases clients hold are bounded in bytes (lease_memory; leases.DEFAULT_LEASE_MEMORY
says why), slots held back counted with them: past it a leased Lookup answers its count
without a lease (as it does for pages on the tier below: the client acquires them when
it reads), and Acquire and Reserve are refused with RESOURCE_EXHAUSTED. A Put or Get
stream's own lease is not counted: the handler threads bound those.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from .errors import Outcome, StoreError
from .holdback import HoldBack
from .layouts import LayoutRegistry
from .leases import FOREVER, Lease, LeaseKind, LeaseTable, footprint
from .slots import SlotState, SlotTable
from .timed_lock import TimedLock

__all__ = ["StoreLeases", "owns"]

log = logging.getLogger("kvstore_server.store")

DOOMED = SlotState.DOOMED
# The same as a plain int, for numpy: an IntEnum compared with an array sends numpy's
# attribute probes through the enum's metaclass on every comparison.
_DOOMED = int(DOOMED)
_FEW_PINS = 8          # up to this many slots, pins are counted one by one (see _pin)


def owns(tenant: str | None, lease: Lease) -> bool:
    """May this caller end the lease? None is the server itself, which may end any. A
    client may end its tenant's leases, but never one that does not expire: a Put or Get
    stream in the server holds it while its copy runs and ends it itself (a client that
    ended one let the slot be reused under the copy)."""
    return tenant is None or (lease.owner == tenant and lease.expires_at != FOREVER)



class StoreLeases:
    """Store's lease endings; the attributes below are Store's (store.py)."""

    _lock: TimedLock
    _slots: SlotTable
    _leases: LeaseTable
    _held_back: HoldBack            # slots of expired leases, pinned a while longer
    _layouts: LayoutRegistry
    clock: Callable[[], float]      # the lease table's
    lease_ttl: float                # the longest lease a client gets, and the hold-back
    lease_memory: int               # bytes clients' leases may take; 0 = unlimited
    _lease_warned = float("-inf")   # time.monotonic() of the last "leases full" warning

    if TYPE_CHECKING:               # Store's own, used here
        def _undo_reservation(self, lease: Lease) -> None: ...
        def _forget_reservation(self, lease: Lease) -> None: ...
        def _free(self, slots) -> None: ...
        def expire_retentions(self) -> int: ...
        def end_retentions(self) -> int: ...

    def _may_lease(self, slots: int, keys: int = 0) -> bool:
        """Whether a client's lease of `slots` slots and `keys` keys fits lease_memory
        (under the lock)."""
        return (not self.lease_memory
                or self._leases.held + self._held_back.held + footprint(slots, keys)
                <= self.lease_memory)

    def _leases_full(self, what: str) -> str:
        """Why a lease was not given (logged once a minute): for the refusal's message."""
        why = (f"{what}: the leases clients hold take {self._leases.held} bytes of the "
               f"server's memory and the slots held back after theirs expired "
               f"{self._held_back.held}, the most it allows ({self.lease_memory}, "
               "--lease-memory); release leases, or wait for them to expire (--lease-ttl)")
        now = time.monotonic()
        if now - self._lease_warned > 60:
            self._lease_warned = now
            log.warning("%s (%d leases)", why, len(self._leases))
        return why

    def release(self, lease_id: int, tenant: str | None = None, pages_read: int = 0) -> bool:
        """End a lease: a READ lease unpins its pages; a RESERVE lease is undone, as abort
        does. False if it was unknown, had already expired, or is another tenant's
        (tenant None: the server itself). pages_read: of a READ lease, the pages its
        holder read in each layout, counted as served (a same-host engine reads a leased
        Lookup's pages from the pool with no Acquire, which counts them otherwise)."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or not owns(tenant, lease):
                return False
            self._leases.pop(lease_id)
            if lease.kind is LeaseKind.RESERVE:
                self._undo_reservation(lease)
            else:
                if pages_read > 0:
                    self._count_read(lease.slots, pages_read)
                self._unpin(lease.slots)
            return True

    def _count_read(self, slots: np.ndarray, pages_read: int) -> None:
        """pages_read pages of each layout whose pages these leased slots are, at most as
        many as it has among them, served (Acquire's count and bytes)."""
        layouts, counts = np.unique(self._slots.layout_of[slots], return_counts=True)
        for idx, count in zip(layouts.tolist(), counts.tolist(), strict=True):
            if idx >= 0:
                info = self._layouts.by_idx[idx]
                info.served += min(pages_read, count)
                info.bytes_out += min(pages_read, count) * info.page_bytes

    # A few pages (up to _FEW_PINS) are the common acquire of an engine's hot path, and
    # numpy's ufunc.at and fancy indexing cost as much on an array of one as on hundreds:
    # a few scalar reads and writes cost less. Many slots keep the vector form
    # (SlotTable.add_pins: a key may repeat; a scalar loop counts repeats by itself).
    def _pin(self, slots: np.ndarray) -> None:
        if len(slots) <= _FEW_PINS:
            pins = self._slots.pins
            for slot in slots.tolist():
                pins[slot] += 1
        else:
            self._slots.add_pins(slots, 1)

    def _unpin(self, slots: np.ndarray) -> None:
        if len(slots) <= _FEW_PINS:
            pins, state = self._slots.pins, self._slots.state
            doomed = []
            for slot in slots.tolist():
                pins[slot] -= 1
                if pins[slot] == 0 and state[slot] == _DOOMED:
                    doomed.append(slot)
            if doomed:
                self._free(np.array(doomed, dtype=np.int64))
            return
        self._slots.add_pins(slots, -1)
        doomed = slots[(self._slots.state[slots] == _DOOMED) & (self._slots.pins[slots] == 0)]
        if doomed.size:
            self._free(np.unique(doomed))

    def _take(self, lease_id: int, kind: LeaseKind, tenant: str | None = None) -> Lease:
        lease = self._leases.get(lease_id)
        # Another tenant's lease reads as unknown: ids are guessable, existence is not news.
        if lease is None or lease.kind is not kind or not owns(tenant, lease):
            raise StoreError(Outcome.EXPIRED, f"{kind.value} lease {lease_id} is unknown or "
                                              "has expired")
        self._leases.pop(lease_id)
        return lease

    def expire_leases(self) -> int:
        """End every lease past its expiry (a client that died holding it, or one that is
        slow) and hold its slots back for another lease_ttl; unpin the slots held back
        long enough. Returns the leases ended."""
        with self._lock:
            gone = self._leases.expired()
            for lease in gone:
                if lease.kind is LeaseKind.RESERVE:
                    self._forget_reservation(lease)
                self._held_back.add(lease.expires_at + self.lease_ttl, lease.slots)
            for slots in self._held_back.due(self.clock()):
                self._unpin(slots)
            self.expire_retentions()        # sessions' TTLs, on the same turn
            if gone:
                log.info("expired %d leases (%d pages) not released in time; their slots "
                         "are held back for another %.1f s, in case a client is only slow",
                         len(gone), sum(len(lease.slots) for lease in gone), self.lease_ttl)
            return len(gone)

    def break_leases(self) -> int:
        """Admin --force: undo every lease and reservation a client holds now, as if it
        had expired (a client that died holding them, before --lease-ttl ends them). A
        client still copying from a page so released may read a reused slot: for an
        operator who knows its clients are gone; the slots held back after leases expired
        go too, and every session's retention ends. Put and Get streams are never broken."""
        with self._lock:
            gone = self._leases.take_breakable()
            for lease in gone:
                if lease.kind is LeaseKind.RESERVE:
                    self._undo_reservation(lease)
                else:
                    self._unpin(lease.slots)
            held = self._held_back.take_all()
            for slots in held:
                self._unpin(slots)
            self.end_retentions()           # sessions' pins are the same kind of hold
        if gone or held:
            log.warning("admin broke %d leases (%d pages) and let go of %d pages held back "
                        "after their leases expired", len(gone),
                        sum(len(lease.slots) for lease in gone),
                        sum(len(slots) for slots in held))
        return len(gone)
