"""The tier interface below DRAM, its null object and its chain, and the page lifecycle.

A page is named by (16-byte layout id, key of 1..64 bytes); a key names its contents, so
two copies of one name hold the same bytes, and any tier may forget a page at any time.
DRAM (store.py) is the top of the chain; everything below it is a `Tier`: the disk tier
(disk/tier.py), the far tier (far/tier.py), or several of them in a `TierChain`, top first
(DRAM -> disk -> far). The store talks to "the tier below" only through this interface.

The whole life of a page, across the tiers:

      DRAM (store.py, one lock)                          tier below (Tier)
      ─────────────────────────                          ─────────────────
      reserve ──► WRITING: a RESERVE lease owns the slot, the key is invisible
         │  │        the client writes the bytes into the slot, outside the lock
         │  └─ abort ──► slot FREE, key never visible; the reservation expires ──► key
         │     never visible, the slot held back another --lease-ttl, then FREE (holdback)
         ▼
      commit ──► READY: in the layout's index; touched by lookup and get; a write-through
         │       tier (the far tier under --far-write through) is offered a copy now,
         │       outside the lock, the slots pinned while it copies
         │
         ├─ lease (Lookup with a lease, Get, Acquire): a READ lease pins the DRAM pages
         │     while a client copies them out; release unpins them (expiry another
         │     --lease-ttl later: holdback.py)
         │
         ├─ evict (watermark, a quota, an admin): unleased READY pages, in the order of
         │     the eviction policy ──── spill ──► offer(page): the tier copies it into
         │     its slot is FREE now                 staging memory and returns at once; it
         │                                          is written behind, or dropped when the
         │                                          queue is full (a cache may lose it)
         │                                           │
         ├─ delete: freed now, or DOOMED            ▼
         │     (invisible) until its last       held below: contains() says so, it is
         │     lease is released; the tier      evicted by the tier's own policy, and
         │     below forgets it too (durably)   delete() forgets it durably
         │                                           │
         └◄──────────── promote ◄──────────────────── read_into(): Acquire of a key missing
              reserve ─► read_into the reserved       from DRAM reserves slots (held to the
              slots (outside the lock) ─► commit      tenant's quota), reads the page into
                                                      them and commits: READY again. Tiers
                                                      are inclusive: the page stays below

What a lookup lease pins and what it only counts: a Lookup counts the leading run of keys
held in DRAM *or* below, but its lease pins only the run's DRAM pages. Pages below are not
leased; Acquire (Get) promotes them later, and may then miss (a tier may forget). A RESERVE
lease pins the slots of a put until commit or abort.

Rules for a tier: `offer` never waits on I/O and may be called under the store's lock;
`read_into`, `delete`, `evict`, `invalidate` and `flush` may block and are called with no
lock held. Everything the store, the chain and the admin calls need of a tier is declared
on `Tier`: its name, how it wants to be probed, the tier below it, its members; nothing
asks a tier what it is by reflection, and the null tier answers every method.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from .scope import Scope

__all__ = ["EVICTABLE", "NullTier", "Page", "PageInfo", "Tier", "TierChain", "TierInvalidation",
           "TierName", "TierStats", "evict_targets"]

Page = memoryview | np.ndarray          # one page: contiguous bytes (any dtype, viewed as uint8)


class TierName(str, enum.Enum):
    """What a tier is called: by an operator (`kvstore-admin evict --tier`), in the stats
    and in the metrics' `tier` label. A str, so it is also the name stats and Inspect show
    (str and format give the bare name on every Python: enum.StrEnum is 3.11+)."""

    DRAM = "dram"
    DISK = "disk"
    FAR = "far"
    CHAIN = "chain"                 # several tiers seen as one (TierChain)
    NONE = "none"                   # the null tier

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


# What an operator may evict from (kvstore-admin evict --tier NAME): one of these, or all.
EVICTABLE = (TierName.DRAM, TierName.DISK, TierName.FAR)


def evict_targets(tier: str) -> frozenset[TierName]:
    """The tiers an operator's `--tier` names: one of EVICTABLE, or "all" for all of them;
    ValueError for anything else. The one place a tier is read from a string."""
    if tier == "all":
        return frozenset(EVICTABLE)
    try:
        name = TierName(tier)
    except ValueError:
        name = None
    if name not in EVICTABLE:
        raise ValueError(f"tier must be dram, disk, far or all, got {tier!r}")
    return frozenset({name})


@dataclasses.dataclass(frozen=True, slots=True)
class TierInvalidation:
    """What an invalidation did in one tier: the layouts it covered (those it was given
    first, then any its own records named), the pages it removed, and why it may not be
    whole ("" if it is)."""

    layout_ids: tuple[bytes, ...]
    removed: int
    failure: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class TierStats:
    """One storage level's counters since start. drops: offers refused because the
    write queue was full; refused: because the tier failed, the page cannot fit, or its
    write failed. `failed` stays True once a write failed: nothing is taken again."""

    name: TierName                  # the level's tier (a chain shows each member's)
    capacity_bytes: int = 0
    used_bytes: int = 0
    pages: int = 0
    reads: int = 0
    bytes_read: int = 0
    writes: int = 0
    bytes_written: int = 0
    drops: int = 0
    refused: int = 0
    corrupt_pages: int = 0
    read_errors: int = 0
    evictions: int = 0
    failed: bool = False
    error: str = ""                 # why writes stopped, if they did


@dataclasses.dataclass(frozen=True, slots=True)
class PageInfo:
    """What admin Inspect tells about one page: where it is and in what state."""

    tier: TierName                  # where the page is
    state: str                      # a SlotState name, or QUEUED (offered, not written)
    size_bytes: int
    age_seconds: float = 0.0        # since commit (DRAM only; 0 below)
    idle_seconds: float = 0.0       # since last touch (DRAM only; 0 below)
    leases: int = 0                 # live leases (reads in flight, below) on its slot
    slot_offset: int = 0            # byte offset in the region, or in the tier's file


@runtime_checkable
class Tier(Protocol):
    """A tier below DRAM. It never blocks a put and may forget any page at any time: it
    is a cache, and nothing assumes it is a page's only holder."""

    @property
    def name(self) -> TierName:
        """What this tier is called (TierName)."""
    @property
    def probe_chunk(self) -> int:
        """Keys one contains() should be asked about at once; 0: no wish of its own (the
        store's default). A tier that pays a round trip per call asks for more."""
    @property
    def holds_pages(self) -> bool:
        """False only for the null tier: lets the store skip work that cannot find
        anything (a second pass of a lookup, spilling at stop)."""
    @property
    def tiers(self) -> tuple[Tier, ...]:
        """The single tiers this one is made of, top first: (self,) but for a chain."""
    def link(self, below: Tier) -> None:
        """Hand the pages this tier lets go of (evicts to make room) to `below`; a tier
        that lets nothing go of its own accord ignores it."""
    def offer(self, layout_id: bytes, key: bytes, page: Page) -> bool:
        """Spill: take a copy of the page to store; False if not taken. Never waits on I/O."""
    def contains(self, layout_id: bytes, keys: Sequence[bytes]) -> np.ndarray:
        """One bool per key: held now (a read_into after it may still miss)."""
    def read_into(self, layout_id: bytes, keys: Sequence[bytes],
                  outs: Sequence[Page]) -> list[bool]:
        """Copy each held, intact page into outs[i] (exactly its size); False where not,
        and outs[i] then holds unspecified bytes. Blocks on I/O: hold no lock around it."""
    def delete(self, layout_id: bytes, keys: Sequence[bytes]) -> int:
        """Forget these pages; returns how many were held. Durable when it returns: no
        restart brings them back."""
    def describe(self, layout_id: bytes, key: bytes) -> PageInfo | None:
        """Admin Inspect's view of a page held here, None if it is not."""
    def evict(self, *, nbytes: int | None = None, layout_id: bytes | None = None,
              everything: bool = False) -> tuple[int, int]:
        """Forget pages worth nbytes in the tier's eviction order (of one layout if
        given), or a whole layout's, or all: returns (pages, bytes)."""
    def invalidate(self, scope: Scope, known: Sequence[bytes]) -> TierInvalidation:
        """Forget every page of the scope's layouts: `known` (this server's), and those a
        shared tier's own layout records name. Never raises: `failure` says what was not
        done."""
    def flush(self, timeout: float) -> int:
        """Store what was offered, waiting at most timeout s; returns pages left pending."""
    def levels(self) -> tuple[TierStats, ...]:
        """Stats of each storage level in this tier, top first: () for the null tier."""
    def register_metrics(self, registry: CollectorRegistry) -> None:
        """Register this tier's collectors in the server's registry: its capacity, use
        and pages (tier_metrics.TierGauges) and its own families; nothing for the null tier."""
    def close(self) -> None:
        """Stop background work and release files; the tier is unusable afterwards."""


class NullTier:
    """The null tier: holds nothing, takes nothing (a server run without --disk)."""

    name = TierName.NONE
    probe_chunk = 0
    holds_pages = False

    @property
    def tiers(self) -> tuple[Tier, ...]:
        return (self,)

    def link(self, below: Tier) -> None:
        pass

    def offer(self, layout_id: bytes, key: bytes, page: Page) -> bool:
        return False

    def contains(self, layout_id: bytes, keys: Sequence[bytes]) -> np.ndarray:
        return np.zeros(len(keys), dtype=bool)

    def read_into(self, layout_id: bytes, keys: Sequence[bytes],
                  outs: Sequence[Page]) -> list[bool]:
        return [False] * len(keys)

    def delete(self, layout_id: bytes, keys: Sequence[bytes]) -> int:
        return 0

    def describe(self, layout_id: bytes, key: bytes) -> PageInfo | None:
        return None

    def evict(self, *, nbytes: int | None = None, layout_id: bytes | None = None,
              everything: bool = False) -> tuple[int, int]:
        return 0, 0

    def invalidate(self, scope: Scope, known: Sequence[bytes]) -> TierInvalidation:
        return TierInvalidation(tuple(known), 0)

    def flush(self, timeout: float) -> int:
        return 0

    def levels(self) -> tuple[TierStats, ...]:
        return ()

    def register_metrics(self, registry: CollectorRegistry) -> None:
        pass

    def close(self) -> None:
        pass


class TierChain:
    """Tiers stacked top first (disk, then far) that the store sees as one tier.

    A spill goes down one tier at a time: a page leaving DRAM is offered to the top tier,
    and reaches the next one when that tier lets it go, either at once (it refused or
    dropped the offer: failed, full queue, too big) or later, when it evicts the page to
    make room (each tier is linked to the next: the disk tier offers its victims to it). So under --far-write evict a page goes to the far tier
    when it leaves this host: when it leaves the disk tier, or DRAM where there is no
    disk tier. Reads are inclusive: a read asks the tiers in order and offers a page
    found lower down to the tiers above it, so the next read of it stops higher up."""

    name = TierName.CHAIN

    def __init__(self, tiers: Sequence[Tier]) -> None:
        self._tiers = tuple(t for t in tiers if t.holds_pages)
        for upper, lower in itertools.pairwise(self._tiers):
            upper.link(lower)
        # The largest chunk of keys any tier wants to be asked about at once (store.py).
        self.probe_chunk = max((t.probe_chunk for t in self._tiers), default=0)

    @property
    def tiers(self) -> tuple[Tier, ...]:
        return self._tiers

    @property
    def holds_pages(self) -> bool:
        return bool(self.tiers)

    def link(self, below: Tier) -> None:
        if self.tiers:
            self.tiers[-1].link(below)

    def offer(self, layout_id: bytes, key: bytes, page: Page) -> bool:
        return any(tier.offer(layout_id, key, page) for tier in self.tiers)  # first taker

    def contains(self, layout_id: bytes, keys: Sequence[bytes]) -> np.ndarray:
        held = np.zeros(len(keys), dtype=bool)
        for tier in self.tiers:
            todo = np.flatnonzero(~held)
            if not todo.size:
                break
            held[todo] = tier.contains(layout_id, [keys[i] for i in todo.tolist()])
        return held

    def read_into(self, layout_id: bytes, keys: Sequence[bytes],
                  outs: Sequence[Page]) -> list[bool]:
        got = [False] * len(keys)
        for level, tier in enumerate(self.tiers):
            todo = [i for i, ok in enumerate(got) if not ok]
            if not todo:
                break
            found = tier.read_into(layout_id, [keys[i] for i in todo], [outs[i] for i in todo])
            for i, ok in zip(todo, found, strict=True):
                if ok:
                    got[i] = True
                    for above in self.tiers[:level]:
                        above.offer(layout_id, keys[i], outs[i])
        return got

    def delete(self, layout_id: bytes, keys: Sequence[bytes]) -> int:
        # Held anywhere counts once: ask first, then every tier forgets.
        held = self.contains(layout_id, keys)
        for tier in self.tiers:
            tier.delete(layout_id, keys)
        return int(np.count_nonzero(held))

    def describe(self, layout_id: bytes, key: bytes) -> PageInfo | None:
        for tier in self.tiers:
            info = tier.describe(layout_id, key)
            if info is not None:
                return info
        return None

    def evict(self, *, nbytes: int | None = None, layout_id: bytes | None = None,
              everything: bool = False) -> tuple[int, int]:
        pages = freed = 0
        for tier in self.tiers:
            more, more_bytes = tier.evict(nbytes=nbytes, layout_id=layout_id,
                                          everything=everything)
            pages, freed = pages + more, freed + more_bytes
        return pages, freed

    def invalidate(self, scope: Scope, known: Sequence[bytes]) -> TierInvalidation:
        # Bottom first: a shared tier's records name layouts other servers registered,
        # and the tiers above forget those too.
        ids, removed, failures = list(known), 0, []
        for tier in reversed(self.tiers):
            result = tier.invalidate(scope, ids)
            ids += [i for i in result.layout_ids if i not in ids]
            removed += result.removed
            if result.failure:
                failures.append(f"{tier.name} tier: {result.failure}")
        return TierInvalidation(tuple(ids), removed, "; ".join(failures))

    def flush(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        return sum(tier.flush(max(0.0, deadline - time.monotonic())) for tier in self.tiers)

    def levels(self) -> tuple[TierStats, ...]:
        return tuple(s for tier in self.tiers for s in tier.levels())

    def register_metrics(self, registry: CollectorRegistry) -> None:
        for tier in self.tiers:
            tier.register_metrics(registry)

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
