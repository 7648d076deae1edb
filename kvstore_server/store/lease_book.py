"""Store's leases: the memory clients' leases may take, and their ending (released by
their client, expired, or broken by an admin).

LeaseBook owns the lease table, the slots held back and the lease budget, and puts and
takes the pins leases (and sessions' retention) hold on slots. A READ lease's end unpins
its pages (a DOOMED page is freed with its last pin), a RESERVE lease's end undoes the
reservation as abort does. A lease that expires ends in two steps: at once it is
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

import numpy as np

from ..errors import Outcome, StoreError
from .evict import Eviction
from .holdback import HoldBack
from .index import FEW_READS
from .leases import FOREVER, Lease, LeaseKind, LeaseTable, footprint
from .slots import SlotState
from .state import StoreState

__all__ = ["LeaseBook", "owns"]

log = logging.getLogger("kvstore_server.store")

DOOMED = SlotState.DOOMED
# The same as a plain int, for numpy: an IntEnum compared with an array sends numpy's
# attribute probes through the enum's metaclass on every comparison.
_DOOMED = int(DOOMED)
# Up to this many slots, pins skip add_pins' numpy search for repeats (see pin): a set of
# the listed slots costs less up to a Get's or a lookup's block (index.FEW_READS).
_FEW_PINS = FEW_READS


def owns(tenant: str | None, lease: Lease) -> bool:
    """May this caller end the lease? None is the server itself, which may end any. A
    client may end its tenant's leases, but never one that does not expire: a Put or Get
    stream in the server holds it while its copy runs and ends it itself (a client that
    ended one let the slot be reused under the copy)."""
    return tenant is None or (lease.owner == tenant and lease.expires_at != FOREVER)


class LeaseBook:
    """The store's leases, their pins and their endings; methods run under the store's
    lock unless they say they take it."""

    def __init__(self, state: StoreState, eviction: Eviction, *, ttl: float,
                 memory: int) -> None:
        self._s = state
        self._eviction = eviction               # frees a DOOMED slot at its last unpin
        self.table = LeaseTable(state.clock)
        # Gets in flight that pinned their pages with no lease (Store.pin_read): counted
        # with the table's leases in the stats, as their leases were.
        self.reading = 0
        self.held_back = HoldBack()             # slots of expired leases, pinned a while longer
        self.ttl = ttl                          # the longest lease a client gets, and the hold-back
        self.memory = memory                    # bytes clients' leases may take; 0 = unlimited
        self._warned = float("-inf")            # time.monotonic() of the last "leases full" warning

    def may_lease(self, slots: int, keys: int = 0) -> bool:
        """Whether a client's lease of `slots` slots and `keys` keys fits lease_memory."""
        return (not self.memory
                or self.table.held + self.held_back.held + footprint(slots, keys)
                <= self.memory)

    def full(self, what: str) -> str:
        """Why a lease was not given (logged once a minute): for the refusal's message."""
        why = (f"{what}: the leases clients hold take {self.table.held} bytes of the "
               f"server's memory and the slots held back after theirs expired "
               f"{self.held_back.held}, the most it allows ({self.memory}, "
               "--lease-memory); release leases, or wait for them to expire (--lease-ttl)")
        now = time.monotonic()
        if now - self._warned > 60:
            self._warned = now
            log.warning("%s (%d leases)", why, len(self.table))
        return why

    def release(self, lease_id: int, tenant: str | None = None, pages_read: int = 0) -> bool:
        """End a lease: a READ lease unpins its pages; a RESERVE lease is undone, as abort
        does. False if it was unknown, had already expired, or is another tenant's
        (tenant None: the server itself). pages_read: of a READ lease, the pages its
        holder read in each layout, counted as served (a same-host engine reads a leased
        Lookup's pages from the pool with no Acquire, which counts them otherwise). Takes
        the lock."""
        with self._s.lock:
            lease = self.table.get(lease_id)
            if lease is None or not owns(tenant, lease):
                return False
            self.table.pop(lease_id)
            if lease.kind is LeaseKind.RESERVE:
                self.undo_reservation(lease)
            else:
                if pages_read > 0:
                    self._count_read(lease.slots, pages_read)
                self.unpin(lease.slots)
            return True

    def abort(self, lease_id: int, tenant: str | None = None) -> bool:
        """Drop a reservation: its slots are freed and its keys never become visible.
        False if it was unknown or had already expired (and so was undone already), or
        is another tenant's. Takes the lock."""
        with self._s.lock:
            lease = self.table.get(lease_id)
            if (lease is None or lease.kind is not LeaseKind.RESERVE
                    or not owns(tenant, lease)):
                return False
            self.table.pop(lease_id)
            self.undo_reservation(lease)
            return True

    def undo_reservation(self, lease: Lease) -> None:
        """A reservation's keys never become visible; its slots go free now, or at their
        last unpin."""
        self._forget_reservation(lease)
        self.unpin(lease.slots)

    def _forget_reservation(self, lease: Lease) -> None:
        """A reservation's keys never become visible; its slots are DOOMED, freed at the
        unpin that ends the reservation's own pin (held back: expire)."""
        info = self._s.layouts.by_idx[lease.layout]
        for key, slot in zip(lease.keys, lease.slots.tolist(), strict=True):
            if info.writing.get(key) == slot:
                del info.writing[key]
        self._s.slots.state[lease.slots] = _DOOMED

    def _count_read(self, slots: np.ndarray, pages_read: int) -> None:
        """pages_read pages of each layout whose pages these leased slots are, at most as
        many as it has among them, served (Acquire's count and bytes)."""
        layouts, counts = np.unique(self._s.slots.layout_of[slots], return_counts=True)
        for idx, count in zip(layouts.tolist(), counts.tolist(), strict=True):
            if idx >= 0:
                info = self._s.layouts.by_idx[idx]
                info.served += min(pages_read, count)
                info.bytes_out += min(pages_read, count) * info.page_bytes

    # A few pages (up to _FEW_PINS) are the common pin of an engine's hot path. A slot
    # named once each (their list has no repeat) takes one fancy-indexed add: a scalar
    # numpy read and write a slot cost more from 2 slots on. A repeated slot is counted
    # one by one (a fancy-indexed add counts it once); many slots keep the vector form
    # (SlotTable.add_pins, which looks for repeats in numpy).
    def pin(self, slots: np.ndarray) -> None:
        """One more pin on each slot (a slot named twice, twice)."""
        table = self._s.slots
        if len(slots) > _FEW_PINS:
            table.add_pins(slots, 1)
            return
        listed = slots.tolist()
        pins = table.pins
        if len(listed) == 1:
            pins[listed[0]] += 1
        elif len(set(listed)) == len(listed):
            pins[slots] += 1
        else:
            for slot in listed:
                pins[slot] += 1

    def unpin(self, slots: np.ndarray) -> None:
        """One pin fewer on each slot; a DOOMED slot's last goes free."""
        table = self._s.slots
        if len(slots) > _FEW_PINS:
            table.add_pins(slots, -1)
            doomed = slots[(table.state[slots] == _DOOMED) & (table.pins[slots] == 0)]
            if doomed.size:
                self._eviction.free(np.unique(doomed))
            return
        listed = slots.tolist()
        pins, state = table.pins, table.state
        if len(listed) > 1 and len(set(listed)) == len(listed):
            left = pins[slots] - 1
            pins[slots] = left
            # DOOMED is rare (a page deleted or evicted while leased): one read says.
            if _DOOMED in state[slots].tolist():
                doomed = slots[(left == 0) & (state[slots] == _DOOMED)]
                if doomed.size:
                    self._eviction.free(doomed)
            return
        freed = []
        for slot in listed:
            pins[slot] -= 1
            if pins[slot] == 0 and state[slot] == _DOOMED:
                freed.append(slot)
        if freed:
            self._eviction.free(np.array(freed, dtype=np.int64))

    def take(self, lease_id: int, kind: LeaseKind, tenant: str | None = None) -> Lease:
        """End a live lease of this kind that the caller owns (EXPIRED if none such)."""
        lease = self.table.get(lease_id)
        # Another tenant's lease reads as unknown: ids are guessable, existence is not news.
        if lease is None or lease.kind is not kind or not owns(tenant, lease):
            raise StoreError(Outcome.EXPIRED, f"{kind.value} lease {lease_id} is unknown or "
                                              "has expired")
        self.table.pop(lease_id)
        return lease

    def expire(self) -> int:
        """End every lease past its expiry (a client that died holding it, or one that is
        slow) and hold its slots back for another lease_ttl; unpin the slots held back
        long enough. Returns the leases ended."""
        gone = self.table.expired()
        for lease in gone:
            if lease.kind is LeaseKind.RESERVE:
                self._forget_reservation(lease)
            self.held_back.add(lease.expires_at + self.ttl, lease.slots)
        for slots in self.held_back.due(self._s.clock()):
            self.unpin(slots)
        if gone:
            log.info("expired %d leases (%d pages) not released in time; their slots "
                     "are held back for another %.1f s, in case a client is only slow",
                     len(gone), sum(len(lease.slots) for lease in gone), self.ttl)
        return len(gone)

    def break_all(self) -> tuple[list[Lease], list[np.ndarray]]:
        """Admin --force: undo every lease and reservation a client holds now, as if it
        had expired (a client that died holding them, before --lease-ttl ends them). A
        client still copying from a page so released may read a reused slot: for an
        operator who knows its clients are gone; the slots held back after leases expired
        go too (Store.break_leases ends every session's retention). Put and Get streams
        are never broken. Returns (the leases broken, the slots let go of)."""
        gone = self.table.take_breakable()
        for lease in gone:
            if lease.kind is LeaseKind.RESERVE:
                self.undo_reservation(lease)
            else:
                self.unpin(lease.slots)
        held = self.held_back.take_all()
        for slots in held:
            self.unpin(slots)
        return gone, held

    @staticmethod
    def said_broken(gone: list[Lease], held: list[np.ndarray]) -> None:
        """Log what break_all did (outside the lock)."""
        if gone or held:
            log.warning("admin broke %d leases (%d pages) and let go of %d pages held back "
                        "after their leases expired", len(gone),
                        sum(len(lease.slots) for lease in gone),
                        sum(len(slots) for slots in held))
