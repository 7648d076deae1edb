"""Tenants' shares of the pool: bytes charged to each, and which of its pages make room.

Not thread-safe: the store calls it under its lock. A slot's page bytes are charged to
its layout's tenant from reserve until the slot is freed, whichever way it goes; a reserve
that would take the tenant past its quota first evicts the tenant's own coldest pages.

A quota caps a tenant's share of the pool, so that it cannot push the others' pages out;
it does not make a full tenant's saves fail. This is a cache: like the pool as a whole, a
tenant at its quota keeps its hot pages and drops its cold ones. Eviction for a quota
never touches another tenant's pages.

Finding a tenant's victims scans every slot, milliseconds with a large pool held; when
each reserve at the quota evicted just what it needed, every put of a full tenant paid it
and held up every other tenant's calls. It evicts up to QUOTA_BATCH of the quota more
than it needs, in whole pages (as the pool's watermarks do for the whole pool): the scan
then runs once per that much of the tenant's puts, a small share of each reserve.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvstore_protocol.units import format_size

from ..errors import Outcome, StoreError
from .eviction import EvictionPolicy, Sizes, quota_victims
from .footprint import Footprints
from .layouts import LayoutInfo
from .pool import Pool

__all__ = ["QUOTA_BATCH", "TenantLedger"]

# A tenant over its quota evicts this share of the quota beyond what it needs.
QUOTA_BATCH = 1 / 32

# Eligible slots (a mask over slot ids) of the layouts given by idx.
Eligible = Callable[[list[int]], np.ndarray]


class TenantLedger:
    """Page bytes and slab footprint of each tenant's slots (WRITING, READY, or DOOMED
    until released)."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}     # what a byte quota limits
        self.footprints = Footprints()      # its share of the slabs (footprint.py)

    def charge(self, info: LayoutInfo, n: int) -> None:
        self.footprints.add(info.tenant, info.cls, n)
        self.bytes[info.tenant] = self.bytes.get(info.tenant, 0) + n * info.page_bytes

    def refund(self, info: LayoutInfo, n: int) -> None:
        self.bytes[info.tenant] -= n * info.page_bytes
        self.footprints.remove(info.tenant, info.cls, n)

    def quota_room(self, info: LayoutInfo, n: int, quota: int, mine: list[LayoutInfo],
                   eligible: Eligible, policy: EvictionPolicy,
                   page_bytes: Sizes) -> np.ndarray:
        """The tenant's pages to evict so that n more of info's pages keep it within quota
        (bytes, 0 = unlimited); EXHAUSTED (nothing evicted) when they cannot free enough.
        mine: the tenant's layouts; page_bytes: of the pages in these slots."""
        used = self.bytes.get(info.tenant, 0)
        need = n * info.page_bytes
        over = used + need - quota
        if not quota or over <= 0:
            return np.zeros(0, dtype=np.int64)
        asked = f"{n} pages of {format_size(info.page_bytes)}"
        if need > quota:
            raise StoreError(Outcome.EXHAUSTED, (
                f"tenant {info.tenant!r} asked for {asked}, more than its whole quota of "
                f"{format_size(quota)} (it holds {format_size(used)}): store fewer at once"))
        victims = quota_victims(policy, eligible([i.idx for i in mine]), page_bytes,
                                min(i.page_bytes for i in mine), over,
                                over + int(quota * QUOTA_BATCH))
        if victims is None:
            raise StoreError(Outcome.EXHAUSTED, (
                f"tenant {info.tenant!r} is at its quota of {format_size(quota)}: it holds "
                f"{format_size(used)}, asked for {asked} more, and its other pages are "
                "leased or being written"))
        return victims

    def footprint_room(self, info: LayoutInfo, n: int, quota: int, pool: Pool,
                       mine: list[int], eligible: Eligible,
                       policy: EvictionPolicy) -> np.ndarray:
        """The tenant's pages of info's class to evict so that its share of the pool's
        slabs stays within its quota when n more of its pages need a new extent
        (footprint.py says why and how); EXHAUSTED when its own pages of the class cannot
        make room in the extents already open. mine: idx of its layouts of the class."""
        free = pool.free_slots(info.cls)
        if not quota or n <= free:
            return np.zeros(0, dtype=np.int64)     # no new slabs: the byte quota is enough
        per = pool.extent_bytes(info.cls)
        new_bytes = -(-(n - free) * pool.slot_bytes(info.cls) // per) * per
        after = self.footprints.bytes_of(info.tenant, pool.class_extent_bytes,
                                         (info.cls, n, new_bytes))
        if after <= max(quota, new_bytes):
            return np.zeros(0, dtype=np.int64)
        victims = policy.victims(n - free, eligible(mine))
        if len(victims) < n - free:
            raise StoreError(Outcome.EXHAUSTED, (
                f"tenant {info.tenant!r}: {n} pages of {format_size(info.page_bytes)} need "
                f"a new {format_size(per)} slab extent, and its pages would then take "
                f"{format_size(int(after))} of the pool's slabs, past its quota of "
                f"{format_size(quota)} (pages of many sizes each take whole slabs); its "
                "other pages of this size are leased or being written"))
        return victims
