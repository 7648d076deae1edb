"""What the store reports: frozen values that admin, metrics and tests read by field."""

from __future__ import annotations

import dataclasses

from .layouts import LayoutInfo
from .tier import TierStats
from .timed_lock import LockHolds

__all__ = ["LayoutStats", "StoreStats", "TenantStats"]


@dataclasses.dataclass(frozen=True, slots=True)
class LayoutStats:
    info: LayoutInfo
    pages: int                      # READY in DRAM
    used_bytes: int                 # of slots
    hits: int
    misses: int
    evictions: int
    bytes_in: int
    bytes_out: int


@dataclasses.dataclass(frozen=True, slots=True)
class TenantStats:
    name: str
    pages: int                      # READY in DRAM
    used_bytes: int                 # page bytes charged to it: what its quota limits


@dataclasses.dataclass(frozen=True, slots=True)
class StoreStats:
    """DRAM's counters since start, and those of each level below it (`tiers`)."""

    capacity_bytes: int
    used_bytes: int
    pages: int
    hits: int
    misses: int
    evictions: int
    bytes_in: int
    bytes_out: int
    leases: int
    leased_pages: int
    held_back_pages: int            # pinned a while after their lease expired (holdback.py)
    uptime_seconds: float
    promotions: int                 # pages read back from the tiers below
    layouts: tuple[LayoutStats, ...]
    tenants: tuple[TenantStats, ...]
    tiers: tuple[TierStats, ...]    # top first; () with no tier below
    lock: LockHolds | None             # how long the store's lock was held
