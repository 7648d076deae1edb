"""What a tenant's pages take of the pool's slabs, not just their bytes. A pure table, not
thread-safe (the store's lock guards it).

Why. The pool carves slots per size class from extents of whole 8 MiB slabs (pool.py),
and a quota counted page bytes only. So 8 leased one-page layouts of distinct page sizes
(144 KiB of one tenant's quota) took 8 extents, 64 MiB of slabs: they evicted 33 MiB of
another tenant's pages and capped it at 8 MiB of its 40 MiB quota.

The rule. A tenant's footprint is its share of the slabs of every class it uses: a class
holding E bytes of extents, of whose used slots the tenant holds a fraction f, counts
f * E. A reserve that needs a new extent may take it only while the tenant's footprint
after it stays within its quota (or within the one extent: a tenant may always hold
that much, or a quota smaller than a slab would store nothing). Otherwise the tenant's
own least recently used pages of that class make room within the extents already open
(as a quota's eviction does), and failing that the reserve is RESOURCE_EXHAUSTED. A put
within extents already open costs no slabs, so it is held only to the byte quota.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

__all__ = ["Footprints"]


class Footprints:
    """Slots held per (tenant, size class), and so each tenant's share of the slabs."""

    def __init__(self) -> None:
        self._slots: dict[str, collections.Counter[int]] = {}   # tenant -> class -> slots
        self._class_slots: collections.Counter[int] = collections.Counter()

    def add(self, tenant: str, cls: int, n: int) -> None:
        mine = self._slots.get(tenant)      # not setdefault: a Counter built every reserve
        if mine is None:
            mine = self._slots[tenant] = collections.Counter()
        mine[cls] += n
        self._class_slots[cls] += n

    def remove(self, tenant: str, cls: int, n: int) -> None:
        self._slots[tenant][cls] -= n
        self._class_slots[cls] -= n

    def bytes_of(self, tenant: str, class_bytes: Callable[[int], int],
                 more: tuple[int, int, int] = (-1, 0, 0)) -> float:
        """The tenant's footprint in bytes; more = (class, slots, extent bytes) to count as
        added to it first (a reserve about to take them)."""
        extra_cls, extra_slots, extra_bytes = more
        total = 0.0
        mine = self._slots.get(tenant, collections.Counter())
        for cls in set(mine) | ({extra_cls} if extra_slots else set()):
            held = mine[cls] + (extra_slots if cls == extra_cls else 0)
            used = self._class_slots[cls] + (extra_slots if cls == extra_cls else 0)
            if held > 0:
                extents = class_bytes(cls) + (extra_bytes if cls == extra_cls else 0)
                total += extents * held / used
        return total
