"""The Admin gRPC service: stats, eviction, clearing, invalidating a model's, a layout's or a
tenant's pages, listing layouts, inspecting a key."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import grpc

from kvstore_protocol._proto.kvstore.v1 import admin_pb2 as apb
from kvstore_protocol.convert import layout_to_proto

from .. import __version__
from ..auth import ANONYMOUS, Authenticator, Role
from ..errors import Outcome, StoreError
from ..metrics import Metrics
from ..scope import Scope
from ..store import Store
from ..store.stats import LayoutStats
from ..tenants import scoped_layout_id
from ..tier import TierName
from .parsing import parser
from .service import guarded
from .status import Invalid

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

    def Stats(self, request: apb.StatsRequest,
              context: grpc.ServicerContext) -> apb.StatsResponse:
        s = self.store.stats()
        tiers = [apb.TierStats(
            name=TierName.DRAM, capacity_bytes=s.capacity_bytes, used_bytes=s.used_bytes,
            pages=s.pages, hits=s.hits, misses=s.misses, evictions=s.evictions,
            bytes_in=s.bytes_in, bytes_out=s.bytes_out, served=s.served)]
        for n, t in enumerate(s.tiers):
            # hits: pages read back into DRAM, counted for the first tier below it
            tiers.append(apb.TierStats(
                name=t.name, capacity_bytes=t.capacity_bytes, used_bytes=t.used_bytes,
                pages=t.pages, hits=s.promotions if n == 0 else 0, evictions=t.evictions,
                bytes_in=t.bytes_written, bytes_out=t.bytes_read, reads=t.reads,
                writes=t.writes, drops=t.drops, corrupt=t.corrupt_pages, failed=t.failed,
                state=(t.error or "reachable") if t.name is TierName.FAR else "",
                errors=t.read_errors if t.name is TierName.FAR else 0))
        quotas = self.auth.quotas() if self.auth is not None else {}
        tenants = [apb.TenantStats(name=t.name, used_bytes=t.used_bytes,
                                   pages=t.pages, quota_bytes=quotas.get(t.name, 0))
                   for t in s.tenants]
        return apb.StatsResponse(
            tiers=tiers, layouts=[_layout_stats(e) for e in s.layouts], tenants=tenants,
            leases=s.leases, leased_pages=s.leased_pages, held_back_pages=s.held_back_pages,
            held_back_leases=s.held_back_leases, pinned_pages=s.pinned_pages,
            retained_pages=s.retained_pages, retention_sessions=s.retention_sessions,
            retention_refused=s.retention_refused,
            uptime_seconds=s.uptime_seconds, version=__version__)

    def Evict(self, request: apb.EvictRequest,
              context: grpc.ServicerContext) -> apb.EvictResponse:
        target = request.WhichOneof("target")
        tier = request.tier or TierName.DRAM
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

    def Clear(self, request: apb.ClearRequest,
              context: grpc.ServicerContext) -> apb.ClearResponse:
        broken = self.store.break_leases() if request.force else 0
        pages, layouts = self.store.clear()
        return apb.ClearResponse(pages=pages, layouts=layouts, leases_broken=broken)

    def Invalidate(self, request: apb.InvalidateRequest,
                   context: grpc.ServicerContext) -> apb.InvalidateResponse:
        scope = Scope(request.model, request.revision, request.layout_id, request.tenant)
        if scope.problems():
            raise Invalid("; ".join(scope.problems()))
        scope = self._own_scope(scope, context)
        done = self.store.invalidate(scope)
        removed = (f"removed {done.dram_pages} pages from DRAM, {done.disk_pages} from disk "
                   f"and {done.far_pages} from the far tier, of {len(done.layout_ids)} "
                   f"layouts ({scope.describe()})")
        if done.failure:
            # No partial success that looks whole: the caller learns what did not finish.
            raise StoreError(Outcome.UNFINISHED, f"{removed}; but {done.failure}")
        return apb.InvalidateResponse(dram_pages=done.dram_pages, disk_pages=done.disk_pages,
                                      far_pages=done.far_pages, layout_ids=done.layout_ids)

    def _own_scope(self, scope: Scope, context: grpc.ServicerContext) -> Scope:
        """An admin's scope as asked; a tenant's narrowed to its own layouts, DENIED
        where it names another's (the only Admin call a tenant may make: auth.py)."""
        caller = ANONYMOUS if self.auth is None else self.auth.caller(context)
        if self.auth is None or caller.role is Role.ADMIN:
            return scope
        if scope.tenant and scope.tenant != caller.name:
            raise StoreError(Outcome.DENIED, f"tenant {caller.name!r} may invalidate only "
                                             f"its own layouts, not tenant {scope.tenant!r}'s")
        layout_id = scope.layout_id
        if layout_id:
            # A tenant names its layouts by its client's id. The store's id of another
            # tenant's layout is refused, never quietly read as one of the caller's.
            mine = scoped_layout_id(caller.name, layout_id)
            if self._tenant_of(mine) != caller.name:
                owner = self._tenant_of(layout_id)
                if owner is not None and owner != caller.name:
                    raise StoreError(Outcome.DENIED, (
                        f"tenant {caller.name!r} may invalidate only its own layouts: "
                        f"layout {layout_id.hex()} is another tenant's"))
            layout_id = mine
        return dataclasses.replace(scope, layout_id=layout_id, tenant=caller.name)

    def _tenant_of(self, layout_id: bytes) -> str | None:
        try:
            return self.store.info(layout_id).tenant
        except StoreError:
            return None

    def ListLayouts(self, request: apb.ListLayoutsRequest,
                    context: grpc.ServicerContext) -> apb.ListLayoutsResponse:
        return apb.ListLayoutsResponse(
            layouts=[_layout_stats(e) for e in self.store.stats().layouts])

    def Inspect(self, request: apb.InspectRequest,
                context: grpc.ServicerContext) -> apb.InspectResponse:
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
        "Invalidate": (apb.InvalidateRequest, apb.InvalidateResponse),
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
