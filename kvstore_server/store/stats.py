"""What the store reports: frozen values that admin, metrics and tests read by field."""

from __future__ import annotations

import dataclasses

from ..tier import TierStats
from .layouts import LayoutInfo
from .timed_lock import LockHolds

__all__ = ["LayoutStats", "StoreStats", "TenantStats"]


@dataclasses.dataclass(frozen=True, slots=True)
class LayoutStats:
    info: LayoutInfo
    pages: int                      # READY in DRAM
    used_bytes: int                 # of slots
    hits: int                       # lookup hits (StoreStats says why not "served")
    misses: int
    evictions: int
    bytes_in: int
    bytes_out: int
    served: int                     # pages handed out by Acquire or Get


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
    # Pages found and not found by lookups. An engine looks a waiting request up again
    # at every step, each time a lease, so the same page counts once per lookup: a vLLM
    # engine counted ~7,500-8,000 hits for ~250 pages it loaded. Not pages served.
    hits: int
    misses: int
    evictions: int
    bytes_in: int
    bytes_out: int
    # Pages served from the store: handed out by Acquire or Get (gRPC or the fast path),
    # each time one is, and pages a client read under a leased lookup's pins (fastwire.PINS:
    # no Acquire) as its release says. What an operator reads as "hits".
    served: int
    # Pins, as pages: each slot counts once however many leases pin it.
    leases: int                     # live leases
    leased_pages: int               # pinned by a live lease (0 when leases is 0)
    held_back_leases: int           # expired leases whose slots are held (holdback.py)
    held_back_pages: int            # pinned a while after their lease expired
    pinned_pages: int               # pinned either way: what eviction cannot take
    uptime_seconds: float
    promotions: int                 # pages read back from the tiers below
    layouts: tuple[LayoutStats, ...]
    tenants: tuple[TenantStats, ...]
    tiers: tuple[TierStats, ...]    # top first; () with no tier below
    lock: LockHolds | None             # how long the store's lock was held
    # Sessions' retention (retention.py): pages kept in DRAM for a session's TTL (each
    # page once; counted in pinned_pages, not in leased_pages), the sessions, and the
    # retains refused over a tenant's quota or session cap (their requests still served).
    retained_pages: int = 0
    retention_sessions: int = 0
    retention_refused: int = 0
