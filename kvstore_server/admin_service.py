"""The Admin gRPC service: stats, eviction, clearing, listing layouts, inspecting a key."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import grpc

from kvstore_client._proto.kvstore.v1 import admin_pb2 as apb
from kvstore_client.convert import layout_to_proto

from . import __version__
from .auth import Authenticator
from .parsing import parser
from .service import guarded
from .status import Invalid
from .stats import LayoutStats
from .store import Store
from .metrics import Metrics

__all__ = ["AdminService", "add_admin_service"]


def _layout_stats(entry: LayoutStats) -> apb.LayoutStats:
    info = entry.info
    return apb.LayoutStats(
        layout_id=info.layout_id, layout=layout_to_proto(info.layout),
        page_bytes=info.page_bytes, pages=entry.pages, used_bytes=entry.used_bytes,
        hits=entry.hits, misses=entry.misses, evictions=entry.evictions,
        bytes_in=entry.bytes_in, bytes_out=entry.bytes_out, tenant=info.tenant,
        served=entry.served)


class AdminService:
    """Operators' view: every tenant's layouts and pages (callers need an admin token)."""

    def __init__(self, store: Store, metrics: Metrics, auth: Authenticator | None = None) -> None:
        self.store = store
        self.metrics = metrics
        self.auth = auth          # for the tenants' quotas; None = no auth file

    def Stats(self, request, context):
        s = self.store.stats()
        tiers = [apb.TierStats(
            name="dram", capacity_bytes=s.capacity_bytes, used_bytes=s.used_bytes,
            pages=s.pages, hits=s.hits, misses=s.misses, evictions=s.evictions,
            bytes_in=s.bytes_in, bytes_out=s.bytes_out, served=s.served)]
        for n, t in enumerate(s.tiers):
            # hits: pages read back into DRAM, counted for the first tier below it
            tiers.append(apb.TierStats(
                name=t.name, capacity_bytes=t.capacity_bytes, used_bytes=t.used_bytes,
                pages=t.pages, hits=s.promotions if n == 0 else 0, evictions=t.evictions,
                bytes_in=t.bytes_written, bytes_out=t.bytes_read, reads=t.reads,
                writes=t.writes, drops=t.drops, corrupt=t.corrupt_pages, failed=t.failed,
                state=(t.error or "reachable") if t.name == "far" else "",
                errors=t.read_errors if t.name == "far" else 0))
        quotas = self.auth.quotas() if self.auth is not None else {}
        tenants = [apb.TenantStats(name=t.name, used_bytes=t.used_bytes,
                                   pages=t.pages, quota_bytes=quotas.get(t.name, 0))
                   for t in s.tenants]
        return apb.StatsResponse(
            tiers=tiers, layouts=[_layout_stats(e) for e in s.layouts], tenants=tenants,
            leases=s.leases, leased_pages=s.leased_pages, held_back_pages=s.held_back_pages,
            held_back_leases=s.held_back_leases, pinned_pages=s.pinned_pages,
            uptime_seconds=s.uptime_seconds, version=__version__)

    def Evict(self, request, context):
        target = request.WhichOneof("target")
        tier = request.tier or "dram"
        if target is None or (target == "all" and not request.all):
            raise Invalid("Evict needs a target: layout_id, bytes or all=true")
        broken = self.store.break_leases() if request.force else 0
        if target == "layout_id":
            pages, nbytes, leased = self.store.evict(layout_id=request.layout_id, tier=tier)
        elif target == "bytes":
            pages, nbytes, leased = self.store.evict(nbytes=request.bytes, tier=tier)
        elif target == "all" and request.all:
            pages, nbytes, leased = self.store.evict(everything=True, tier=tier)
        else:
            raise Invalid("Evict needs a target: layout_id, bytes or all=true")
        return apb.EvictResponse(pages=pages, bytes=nbytes, skipped_leased=leased,
                                 leases_broken=broken)

    def Clear(self, request, context):
        broken = self.store.break_leases() if request.force else 0
        pages, layouts = self.store.clear()
        return apb.ClearResponse(pages=pages, layouts=layouts, leases_broken=broken)

    def ListLayouts(self, request, context):
        return apb.ListLayoutsResponse(
            layouts=[_layout_stats(e) for e in self.store.stats().layouts])

    def Inspect(self, request, context):
        if not request.key:
            raise Invalid("Inspect needs a key")
        return apb.InspectResponse(**dataclasses.asdict(
            self.store.inspect(request.layout_id, request.key)))


def add_admin_service(server: grpc.Server, service: AdminService) -> None:
    names: dict[str, tuple[Any, Any]] = {
        "Stats": (apb.StatsRequest, apb.StatsResponse),
        "Evict": (apb.EvictRequest, apb.EvictResponse),
        "Clear": (apb.ClearRequest, apb.ClearResponse),
        "ListLayouts": (apb.ListLayoutsRequest, apb.ListLayoutsResponse),
        "Inspect": (apb.InspectRequest, apb.InspectResponse),
    }
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            functools.partial(guarded("Admin." + name, service.metrics)(getattr(AdminService, name)),
                              service),
            request_deserializer=parser(req), response_serializer=resp.SerializeToString)
        for name, (req, resp) in names.items()
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("kvstore.v1.Admin", handlers),))
