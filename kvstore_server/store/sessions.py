"""Store's session retention: a session's prefix kept in DRAM for a TTL (retention.py).

Retention owns the sessions' table and limits, over the store's shared state (StoreState);
every method here takes the store's lock, or runs under it. A retained page carries one pin per session that
retains it, the pin count leases use, so eviction of every kind (watermarks, allocation,
quotas, an admin's evict) passes it over; the retention table says which pins are whose.
Ends: the TTL (expire_retentions, run with the lease reaper), ReleaseRetention, an
admin's --force (end_all), and a delete of the page itself (forget, a hook of
Eviction.drop: a retained page never blocks a delete or an invalidation).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import numpy as np

from kvstore_protocol.keys import Packed

from ..errors import Outcome, StoreError
from .layouts import LayoutInfo
from .lease_book import LeaseBook
from .retention import MAX_SESSION_NAME, MAX_TTL, RetainOutcome, RetentionLimits, RetentionTable
from .state import StoreState

__all__ = ["Retained", "Retention"]

# Sessions of one RetainMany retained per lock hold (each hold looks the keys up once).
_MANY_CHUNK = 32
_NONE = np.zeros(0, dtype=np.int64)     # the slots of no keys

log = logging.getLogger("kvstore_server.store")


@dataclasses.dataclass(frozen=True, slots=True)
class Retained:
    """What a retain did: the prefix's leading pages in DRAM (the run retained, unless
    refused), and why not where it was refused ("" when retained)."""

    pages: int
    refused: str = ""
    held: int = 0           # pages the session keeps after it (0: no such session)


def _check(session: str, ttl: float) -> None:
    """A retain's session name and ttl, refused (INVALID) out of bounds."""
    if not 1 <= len(session) <= MAX_SESSION_NAME:
        raise StoreError(Outcome.INVALID, f"a session is named by 1 to "
                                          f"{MAX_SESSION_NAME} characters, got {len(session)}")
    if not 0 < ttl <= MAX_TTL:
        raise StoreError(Outcome.INVALID, f"a retention's ttl is more than 0 and at most "
                                          f"{MAX_TTL:.0f} s, got {ttl} (release it with "
                                          "ReleaseRetention)")


class Retention:
    """Sessions' retention of their prefixes, pinned as leases pin (LeaseBook)."""

    def __init__(self, state: StoreState, book: LeaseBook,
                 limits: RetentionLimits) -> None:
        self._s = state
        self._book = book
        self.limits = limits                # each tenant's quota and session cap
        self.table = RetentionTable()       # which session pins which slots

    def retain(self, layout_id: bytes, keys: Packed, session: str, ttl: float,
               quota: int = 0) -> Retained:
        """Keep the leading run of keys in DRAM for the session (its tenant: the layout's)
        until ttl seconds from now, or until released; retaining again adds pages and
        sets the session's expiry anew; no keys: only an existing session's expiry
        moves (Retained.held: what the session keeps). Refused (nothing changes,
        counted) over the tenant's quota or session cap, or with retention off. quota:
        the bytes the tenant may store (0 = unlimited); it retains at most half of them."""
        _check(session, ttl)
        s = self._s
        with s.lock:
            info = s.layouts.info(layout_id)
            return self._retain_found(info, s.find(info, keys), session, ttl, quota)

    def retain_many(self, layout_id: bytes, keys: Packed,
                    asks: Sequence[tuple[str, float, np.ndarray]],
                    quota: int = 0) -> list[Retained]:
        """Several sessions' retains at once: (session, ttl, indexes into keys of its
        prefix) each, answered in order as retain answers each. Every ask is checked
        before any is kept. The keys are looked up once per _MANY_CHUNK sessions, in the
        same lock hold as their retains (a slot found in an earlier hold may hold another
        page by now): 64 sessions of one prefix cost a 64th of the lookups."""
        for session, ttl, _ in asks:
            _check(session, ttl)
        s = self._s
        out: list[Retained] = []
        for start in range(0, len(asks), _MANY_CHUNK):
            with s.lock:
                info = s.layouts.info(layout_id)
                found = s.find(info, keys) if len(keys) else _NONE
                out += [self._retain_found(info, found[idx], session, ttl, quota)
                        for session, ttl, idx in asks[start:start + _MANY_CHUNK]]
        return out

    def _retain_found(self, info: LayoutInfo, found: np.ndarray, session: str, ttl: float,
                      quota: int) -> Retained:
        """retain's work under the lock, its keys' slots found (-1: absent)."""
        s = self._s
        if not len(found):
            # An extension (no keys): the session's expiry moves, if it has one; nothing
            # to look up, pin or touch (a connector's every turn that added no pages).
            if not self.table.extend(info.tenant, session, s.clock() + ttl):
                return Retained(0)
            return Retained(0, held=self.table.held(info.tenant, session))
        run = found[:int(np.argmin(found >= 0))] if (found < 0).any() else found
        outcome, new = self.table.retain(
            info.tenant, session, run, self._retained_bytes, s.clock(), ttl,
            self.limits, s.pool.capacity_bytes, quota)
        held = self.table.held(info.tenant, session)
        if outcome is not RetainOutcome.RETAINED:
            return Retained(len(run), outcome.value, held)
        self._book.pin(new)
        s.touch(run)
        return Retained(len(run), held=held)

    def _retained_bytes(self, slots: np.ndarray) -> np.ndarray:
        return self._s.pool.class_bytes[self._s.pool.cls[slots]]

    def release(self, session: str, tenant: str) -> int:
        """End a tenant's session now: pages it no longer keeps (0 if none such)."""
        with self._s.lock:
            slots = self.table.release(tenant, session)
            if slots is None:
                return 0
            self._book.unpin(slots)
            return len(slots)

    def expire(self) -> int:
        """End the sessions whose TTL lapsed (under the lock; the lease reaper's turn).
        Nothing is held back, unlike an expired lease's slots: no client copies under a
        retention (it reads under a lease of its own)."""
        ended = self.table.expired(self._s.clock())
        for slots in ended:
            self._book.unpin(slots)
        return len(ended)

    def end_all(self) -> int:
        """An admin's --force: end every session now (under the lock)."""
        ended = self.table.take_all()
        for slots in ended:
            self._book.unpin(slots)
        if ended:
            log.warning("admin ended %d retention sessions (%d pages)", len(ended),
                        sum(len(s) for s in ended))
        return len(ended)

    def forget(self, slots: np.ndarray | list[int]) -> None:
        """These slots' pages are deleted (under the lock): their sessions' pins go, so
        that the delete frees them now (or at their leases' release). With no session
        open no slot is retained (a session's end lets go of its slots), so nothing is
        looked at: a delete of a few keys pays no numpy call for retention it has none of."""
        if not len(self.table):
            return
        held, counts = self.table.forget(np.asarray(slots, dtype=np.int64))
        if held.size:
            pins = self._s.slots.pins
            pins[held] -= counts.astype(pins.dtype)
