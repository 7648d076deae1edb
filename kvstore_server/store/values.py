"""What the store's two-phase calls hand back: a reservation's slots, a read lease's pins."""

from __future__ import annotations

import dataclasses

import numpy as np

from .layouts import LayoutInfo

__all__ = ["Pinned", "Reservation"]


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
