"""Values a KVStoreClient hands its callers for page calls: a layout handle, a put's result,
a lookup's lease; and what either transport's acquire and reserve answer (FastLease)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from kvstore_protocol.layout import PageLayout

__all__ = ["FastLease", "LayoutHandle", "Lease", "Pins", "PutResult"]


@dataclasses.dataclass(frozen=True, slots=True)
class LayoutHandle:
    """A registered layout: what every page call names."""

    layout: PageLayout
    layout_id: bytes
    page_bytes: int
    layer_bytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class PutResult:
    stored: int     # pages newly stored
    skipped: int    # keys that were already present
    # Keys another put was still writing: not stored by this call, and stored at all only
    # if that writer commits (look them up again later to know).
    in_flight: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Pins:
    """Where a leased lookup's pages lie in the server's shared pool (fastwire.PINS)."""

    region_id: int                       # the pool's public name (shm.region_id)
    ttl_s: float                         # the lease's life, as the server granted it
    offsets: Mapping[bytes, np.ndarray]  # layout id -> byte offset of each counted page,
    #                                      -1 for one not in the pool (on the tier below)


@dataclasses.dataclass(frozen=True, slots=True)
class Lease:
    """Pages pinned by a lookup: they cannot be evicted until released or expired."""

    lease_id: int
    count: int
    pins: Pins | None = None      # asked for and answered: where the pages lie


class FastLease:
    """What acquire and reserve answer: a lease id, the pages' pool offsets, and for a
    reserve the keys already stored (skipped) and those another put is writing."""

    __slots__ = ("in_flight", "lease_id", "offsets", "skipped")

    def __init__(self, lease_id: int, offsets: np.ndarray, skipped: int = 0,
                 in_flight: int = 0) -> None:
        self.lease_id = lease_id
        self.offsets = offsets
        self.skipped = skipped
        self.in_flight = in_flight
