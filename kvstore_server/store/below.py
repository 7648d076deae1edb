"""Store's questions to the tier below for pages DRAM lacks: how far a prefix reaches, read-backs.

Below owns the read-back count and the probe size, over the store's shared state
(StoreState); it reads back through the store's own reserve, commit and abort. Both run
outside the store's lock: the tier below has its
own, and its probe costs a dict lookup a key (a Lookup of 60 M keys held the store's lock
for seconds when it was asked inside). A read-back (promote) goes through the store's own
lifecycle, reserve → write → commit, so a page read back is held to its tenant's quota
and never visible half-written.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from kvstore_protocol.keys import Packed

from .layouts import LayoutInfo
from .leases import FOREVER
from .state import StoreState
from .values import Reservation

__all__ = ["Below", "Puts"]

# Keys of a lookup asked of the tier below at once: it stops at the first one missing.
PROBE_CHUNK = 1024
# How long a read-back waits for pages another read-back (or a put) is writing: two Gets
# of one prefix held only below DRAM promote it once, and the second waits for the first
# instead of missing (it used to answer NOT_FOUND while the first was still reading).
_PROMOTE_WAIT = 5.0
# A read-back asks the tier below whether it holds the pages unless the pool has this
# many times their bytes free (free bytes are not free slots of every size class).
_ROOM_MARGIN = 2


class Puts(Protocol):
    """The store's put lifecycle, which a read-back goes through."""

    def reserve(self, layout_id: bytes, keys: Packed | Sequence[bytes],
                ttl: float | None = None, quota: int = 0) -> Reservation: ...
    def commit(self, lease_id: int, tenant: str | None = None, *,
               write_through: bool = True) -> int: ...
    def abort(self, lease_id: int, tenant: str | None = None) -> bool: ...


class Below:
    """The store's reach into the tier below (StoreState.lower)."""

    def __init__(self, state: StoreState, puts: Puts) -> None:
        self._s = state
        self._puts = puts
        self.promotions = 0                    # pages read back from the tier below
        # Keys the tier below is asked about at once (see reach): a far tier pays a
        # round trip per call, so it asks for bigger chunks than the disk tier's.
        self.probe_chunk = max(PROBE_CHUNK, state.lower.probe_chunk)

    def reach(self, info: LayoutInfo, keys: Packed, slots: np.ndarray) -> int:
        """How many leading keys are stored, in DRAM (slots >= 0) or on the tier below;
        the tier is asked about the gaps a chunk at a time, up to the first one it lacks."""
        gaps = np.flatnonzero(slots < 0)
        for start in range(0, gaps.size, self.probe_chunk):
            chunk = gaps[start:start + self.probe_chunk]
            held = self._s.lower.contains(info.layout_id, keys.select(chunk))
            if not held.all():
                return int(chunk[int(np.argmin(held))])
        return len(keys)

    def promote(self, info: LayoutInfo, keys: Packed, missing: np.ndarray,
                 quota: int = 0) -> bool:
        """Read the missing pages back from the tier below into DRAM (one batched read,
        outside the lock, into slots a reservation owns, within the tenant's quota);
        False if one is not there or cannot be read intact. The reservation is aborted
        whatever goes wrong: one left behind never expired, and its keys could not be
        stored again until a restart."""
        s, lower = self._s, self._s.lower
        if not lower.holds_pages:
            return False
        wanted = keys.select(missing)
        # Asking first keeps a Get of pages the tier below lacks from reserving, and so
        # evicting, DRAM for nothing. But the far tier answers in a round trip (a few
        # percent of a large far read), so it is asked only when the reservation might
        # evict: with the room free, an absent page costs nothing but the aborted
        # reservation.
        room = s.pool.free_bytes >= _ROOM_MARGIN * len(wanted) * info.page_bytes
        if not room and not lower.contains(info.layout_id, wanted).all():
            return False
        res = self._puts.reserve(info.layout_id, wanted, ttl=FOREVER, quota=quota)
        committed = False
        try:
            todo = np.flatnonzero(res.slots >= 0)
            pb = info.page_bytes
            views = [s.mem[off:off + pb] for off in res.offsets[todo].tolist()]
            ok = lower.read_into(info.layout_id, [wanted[i] for i in todo], views)
            if not all(ok):             # a corrupt or unreadable page: never served
                return False
            promoted = self._puts.commit(res.lease_id, write_through=False)
            committed = True
        finally:
            if not committed:
                self._puts.abort(res.lease_id)
        with s.lock:
            self.promotions += promoted
        if res.in_flight:
            self._wait_written(info, [wanted[i] for i in np.flatnonzero(res.slots < 0)])
        return True

    def _wait_written(self, info: LayoutInfo, keys: list[bytes]) -> None:
        """Until none of these keys is being written (committed or aborted by whoever
        writes it), for at most _PROMOTE_WAIT s. Polls: this happens only when two
        read-backs of one page meet, and it keeps commit and abort free of signalling."""
        deadline = time.monotonic() + _PROMOTE_WAIT
        pause = 0.0005
        while time.monotonic() < deadline:
            with self._s.lock:
                if not any(k in info.writing for k in keys):
                    return
            time.sleep(pause)
            pause = min(2 * pause, 0.01)
