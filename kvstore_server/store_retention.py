"""Store's session retention: a session's prefix kept in DRAM for a TTL (retention.py).

A mixin of Store (store.py), which owns the lock and the slot table; every method here
takes that lock, or runs under it. A retained page carries one pin per session that
retains it, the pin count leases use, so eviction of every kind (watermarks, allocation,
quotas, an admin's evict) passes it over; the retention table says which pins are whose.
Ends: the TTL (expire_retentions, run with the lease reaper), ReleaseRetention, an
admin's --force (end_retentions), and a delete of the page itself (_forget_retained,
from Store._drop: a retained page never blocks a delete or an invalidation).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from kvstore_protocol.keys import Packed

from .errors import Outcome, StoreError
from .layouts import LayoutInfo
from .pool import Pool
from .retention import MAX_SESSION_NAME, MAX_TTL, RetainOutcome, RetentionLimits, RetentionTable
from .slots import SlotTable
from .timed_lock import TimedLock

__all__ = ["Retained", "StoreRetention"]

log = logging.getLogger("kvstore_server.store")


@dataclasses.dataclass(frozen=True, slots=True)
class Retained:
    """What a retain did: the prefix's leading pages in DRAM (the run retained, unless
    refused), and why not where it was refused ("" when retained)."""

    pages: int
    refused: str = ""


class StoreRetention:
    """Store's retention; the attributes below are Store's (store.py)."""

    _lock: TimedLock
    pool: Pool
    clock: Callable[[], float]
    retention: RetentionLimits
    _retained: RetentionTable
    _slots: SlotTable

    if TYPE_CHECKING:               # Store's own, used here
        def info(self, layout_id: bytes) -> LayoutInfo: ...
        def _find(self, info: LayoutInfo, keys: Packed) -> np.ndarray: ...
        def _touch(self, slots: np.ndarray) -> None: ...
        def _pin(self, slots: np.ndarray) -> None: ...
        def _unpin(self, slots: np.ndarray) -> None: ...

    def retain(self, layout_id: bytes, keys: Packed, session: str, ttl: float,
               quota: int = 0) -> Retained:
        """Keep the leading run of keys in DRAM for the session (its tenant: the layout's)
        until ttl seconds from now, or until released; retaining again adds pages and
        sets the session's expiry anew. Refused (nothing changes, counted) over the
        tenant's quota or session cap, or with retention off. quota: the bytes the
        tenant may store (0 = unlimited); it retains at most half of them."""
        if not 1 <= len(session) <= MAX_SESSION_NAME:
            raise StoreError(Outcome.INVALID, f"a session is named by 1 to "
                                              f"{MAX_SESSION_NAME} characters, got {len(session)}")
        if not 0 < ttl <= MAX_TTL:
            raise StoreError(Outcome.INVALID, f"a retention's ttl is more than 0 and at most "
                                              f"{MAX_TTL:.0f} s, got {ttl} (release it with "
                                              "ReleaseRetention)")
        with self._lock:
            info = self.info(layout_id)
            found = self._find(info, keys)
            run = found[:int(np.argmin(found >= 0))] if (found < 0).any() else found
            outcome, new = self._retained.retain(
                info.tenant, session, run, self._retained_bytes, self.clock(), ttl,
                self.retention, self.pool.capacity_bytes, quota)
            if outcome is not RetainOutcome.RETAINED:
                return Retained(len(run), outcome.value)
            self._pin(new)
            self._touch(run)
            return Retained(len(run))

    def _retained_bytes(self, slots: np.ndarray) -> np.ndarray:
        return self.pool.class_bytes[self.pool.cls[slots]]

    def release_retention(self, session: str, tenant: str) -> int:
        """End a tenant's session now: pages it no longer keeps (0 if none such)."""
        with self._lock:
            slots = self._retained.release(tenant, session)
            if slots is None:
                return 0
            self._unpin(slots)
            return len(slots)

    def expire_retentions(self) -> int:
        """End the sessions whose TTL lapsed (under the lock; the lease reaper's turn).
        Nothing is held back, unlike an expired lease's slots: no client copies under a
        retention (it reads under a lease of its own)."""
        ended = self._retained.expired(self.clock())
        for slots in ended:
            self._unpin(slots)
        return len(ended)

    def end_retentions(self) -> int:
        """An admin's --force: end every session now (under the lock)."""
        ended = self._retained.take_all()
        for slots in ended:
            self._unpin(slots)
        if ended:
            log.warning("admin ended %d retention sessions (%d pages)", len(ended),
                        sum(len(s) for s in ended))
        return len(ended)

    def _forget_retained(self, slots: np.ndarray) -> None:
        """These slots' pages are deleted (under the lock): their sessions' pins go, so
        that the delete frees them now (or at their leases' release)."""
        held, counts = self._retained.forget(slots)
        if held.size:
            self._slots.pins[held] -= counts.astype(self._slots.pins.dtype)
