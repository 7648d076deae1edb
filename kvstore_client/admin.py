"""The Admin service for callers: stats, evict, clear, list layouts, inspect, as dataclasses.

Callers and the kvstore-admin command see these frozen values, never protobuf messages:
the wire may grow fields without a caller noticing, and a value can be compared, printed
and turned into JSON (`plain`). Field names are the wire's, so `plain(x)` reads as the
Admin service's messages do; a layout is a PageLayout.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvstore_protocol._proto.kvstore.v1 import admin_pb2 as apb
from kvstore_protocol.convert import layout_from_proto
from kvstore_protocol.layout import PageLayout

from .rpc import Rpc

__all__ = ["AdminClient", "ClearResult", "EvictResult", "LayoutStats", "PageInfo", "Stats",
           "TenantStats", "TierStats", "plain"]


@dataclasses.dataclass(frozen=True, slots=True)
class TierStats:
    """One tier's counters (admin.proto's TierStats says what each counts)."""

    name: str
    capacity_bytes: int = 0
    used_bytes: int = 0
    pages: int = 0
    hits: int = 0               # lookup hits: a page looked up again counts again
    misses: int = 0
    evictions: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    reads: int = 0
    writes: int = 0
    drops: int = 0
    corrupt: int = 0
    failed: bool = False
    state: str = ""
    errors: int = 0
    served: int = 0             # pages served from the store (Acquire, Get); DRAM only


@dataclasses.dataclass(frozen=True, slots=True)
class LayoutStats:
    """One registered layout and its DRAM counters."""

    layout_id: bytes
    layout: PageLayout
    page_bytes: int = 0
    pages: int = 0
    used_bytes: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    tenant: str = ""
    served: int = 0             # pages handed out by Acquire or Get


@dataclasses.dataclass(frozen=True, slots=True)
class TenantStats:
    name: str
    used_bytes: int = 0
    quota_bytes: int = 0    # 0 = unlimited
    pages: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Stats:
    """What Stats answers: every tier, layout and tenant, leases, uptime, version."""

    tiers: tuple[TierStats, ...] = ()
    layouts: tuple[LayoutStats, ...] = ()
    leases: int = 0             # live leases
    leased_pages: int = 0       # pages pinned by a live lease (each page once)
    uptime_seconds: float = 0.0
    version: str = ""
    tenants: tuple[TenantStats, ...] = ()
    held_back_pages: int = 0    # pinned a while after their lease expired (slow clients)
    held_back_leases: int = 0   # the expired leases that hold them
    pinned_pages: int = 0       # leased or held back: what eviction cannot take
    retained_pages: int = 0     # kept in DRAM for a session's TTL (KVStoreClient.retain)
    retention_sessions: int = 0
    retention_refused: int = 0  # retains refused: a tenant's quota or session cap


@dataclasses.dataclass(frozen=True, slots=True)
class EvictResult:
    pages: int = 0
    bytes: int = 0
    skipped_leased: int = 0     # left in place because a lease holds them
    leases_broken: int = 0      # with force


@dataclasses.dataclass(frozen=True, slots=True)
class ClearResult:
    pages: int = 0
    layouts: int = 0            # layouts that held pages; they stay registered
    leases_broken: int = 0      # with force


@dataclasses.dataclass(frozen=True, slots=True)
class InvalidateResult:
    """What an invalidation removed from each tier."""

    dram_pages: int = 0
    disk_pages: int = 0
    far_pages: int = 0          # of the whole fleet
    layout_ids: tuple[bytes, ...] = ()      # the layouts of the scope


@dataclasses.dataclass(frozen=True, slots=True)
class PageInfo:
    """Where one key's page is and how it is used."""

    tier: str                   # "dram", "disk" or "far"
    state: str                  # "WRITING" or "READY"; on disk "QUEUED" (not yet written)
    size_bytes: int = 0
    age_seconds: float = 0.0    # since the page was committed
    idle_seconds: float = 0.0   # since the page was last touched
    leases: int = 0
    slot_offset: int = 0


def _fields(cls: Any, msg: Any, **override: Any) -> Any:
    """cls from the message's fields of the same names (override: the converted ones)."""
    return cls(**{f.name: override[f.name] if f.name in override else getattr(msg, f.name)
                  for f in dataclasses.fields(cls)})


def _layout_stats(msg: apb.LayoutStats) -> LayoutStats:
    return _fields(LayoutStats, msg, layout=layout_from_proto(msg.layout))


def plain(value: Any) -> Any:
    """A value of this module as JSON-ready data: ints stay ints, bytes become hex."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, bytes):
        return value.hex()
    return value


class AdminClient:
    """The Admin service over one client's channel and retries (rpc.py)."""

    def __init__(self, rpc: Rpc) -> None:
        self._rpc = rpc

    def stats(self) -> Stats:
        rpc = self._rpc
        resp = rpc.call("Stats", lambda: rpc.stats(apb.StatsRequest(), timeout=rpc.timeout))
        return _fields(Stats, resp,
                       tiers=tuple(_fields(TierStats, t) for t in resp.tiers),
                       layouts=tuple(_layout_stats(s) for s in resp.layouts),
                       tenants=tuple(_fields(TenantStats, t) for t in resp.tenants))

    def list_layouts(self) -> list[LayoutStats]:
        rpc = self._rpc
        resp = rpc.call("ListLayouts", lambda: rpc.list_layouts(
            apb.ListLayoutsRequest(), timeout=rpc.timeout))
        return [_layout_stats(s) for s in resp.layouts]

    def evict(self, *, layout_id: bytes | None = None, nbytes: int | None = None,
              everything: bool = False, tier: str = "dram", force: bool = False) -> EvictResult:
        """Evict from tier "dram" (pages move to disk, if any), "disk", "far" or "all".
        force: first end every lease and reservation clients hold (clients that died)."""
        if sum(x is not None and x is not False for x in (layout_id, nbytes, everything)) != 1:
            raise ValueError("evict needs exactly one of layout_id, nbytes, everything")
        if layout_id is not None:
            req = apb.EvictRequest(layout_id=layout_id, tier=tier, force=force)
        elif nbytes is not None:
            req = apb.EvictRequest(bytes=nbytes, tier=tier, force=force)
        else:
            req = apb.EvictRequest(all=True, tier=tier, force=force)
        rpc = self._rpc
        resp = rpc.call("Evict", lambda: rpc.evict(req, timeout=rpc.timeout), retry=False)
        return _fields(EvictResult, resp)

    def clear(self, force: bool = False) -> ClearResult:
        """Delete every page; force: end clients' leases and reservations first."""
        rpc = self._rpc
        resp = rpc.call("Clear", lambda: rpc.clear(apb.ClearRequest(force=force),
                                                   timeout=rpc.timeout), retry=False)
        return _fields(ClearResult, resp)

    def invalidate(self, *, model: str = "", revision: str = "", layout_id: bytes = b"",
                   tenant: str = "") -> InvalidateResult:
        """Delete every page of a model (of one revision, if given), a layout or a tenant
        from DRAM, disk and the far tier (the far tier's of the whole fleet), e.g. right
        after a weight sync. Every field given must match. A tenant's token invalidates
        its own layouts only (a layout_id is then its client's id). KVStoreError ABORTED
        when a tier could not be reached or did not finish: its message says what was
        removed, and the far tier finishes in the background."""
        if revision and not model:
            raise ValueError("invalidate: a revision needs its model")
        if not (model or layout_id or tenant):
            raise ValueError("invalidate needs a model, a layout_id or a tenant")
        rpc = self._rpc
        call = rpc.channel.unary_unary(
            "/kvstore.v1.Admin/Invalidate",
            request_serializer=apb.InvalidateRequest.SerializeToString,
            response_deserializer=apb.InvalidateResponse.FromString)
        req = apb.InvalidateRequest(model=model, revision=revision, layout_id=layout_id,
                                    tenant=tenant)
        resp = rpc.call("Invalidate", lambda: call(req, timeout=rpc.timeout), retry=False)
        return _fields(InvalidateResult, resp, layout_ids=tuple(resp.layout_ids))

    def inspect(self, layout_id: bytes, key: bytes) -> PageInfo:
        rpc = self._rpc
        resp = rpc.call("Inspect", lambda: rpc.inspect(
            apb.InspectRequest(layout_id=layout_id, key=key), timeout=rpc.timeout))
        return _fields(PageInfo, resp)
