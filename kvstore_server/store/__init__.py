"""The page store: DRAM pages of every layout in the shared region, behind one lock.

A page's life across the tiers is drawn in ../tier.py; its DRAM half is in store.py:
reserve -> WRITING -> commit -> READY -> lease / release -> evict (spilled to the tier
below) -> promote (read back by acquire), and delete.

Modules, one idea each. The Store and its parts: store (the per-request lifecycle and the
front of the parts), state (what the parts share, declared once), lookups (Lookups: how
long a prefix is stored, counted, leased if asked), evict (Eviction: allocation that
evicts, quotas, watermarks), lease_book (LeaseBook: leases, their pins and endings),
sessions (Retention: sessions' retention of their prefixes), below (Below: the tier below,
a lookup's reach and read-backs), admin (Admin: evict, clear, invalidate, spill, inspect,
stats), values (what reserve and acquire hand back). The pure pieces under them: pool
(slots in the region, by size class), slots (the slot table), layouts (the layout
registry), index (a layout's key index), eviction (the policy protocol) and lru (the
default policy), leases (the lease table), holdback (slots of expired leases), quota and
footprint (tenants' bytes), retention (the sessions' table), presence (the map same-host
clients read misses from), timed_lock (the lock that times its holds), stats (the frozen
stats records), metrics (DRAM's Prometheus families, made from those stats when scraped).

The names callers use are re-exported here: `from kvstore_server.store import Store`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .store import FOREVER, LayoutInfo, Pinned, Reservation, Retained, Store

__all__ = ["FOREVER", "LayoutInfo", "Pinned", "Reservation", "Retained", "Store"]


# Looked up when first asked for, not imported here: the store's front imports region.py,
# which imports presence from this package, so importing region first would meet a
# half-made store.
def __getattr__(name: str) -> object:
    if name in __all__:
        from . import store
        return getattr(store, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
