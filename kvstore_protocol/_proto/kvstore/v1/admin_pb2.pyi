from kvstore_client._proto.kvstore.v1 import kvstore_pb2 as _kvstore_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TierStats(_message.Message):
    __slots__ = ("name", "capacity_bytes", "used_bytes", "pages", "hits", "misses", "evictions", "bytes_in", "bytes_out", "reads", "writes", "drops", "corrupt", "failed", "state", "errors", "served")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    READS_FIELD_NUMBER: _ClassVar[int]
    WRITES_FIELD_NUMBER: _ClassVar[int]
    DROPS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    SERVED_FIELD_NUMBER: _ClassVar[int]
    name: str
    capacity_bytes: int
    used_bytes: int
    pages: int
    hits: int
    misses: int
    evictions: int
    bytes_in: int
    bytes_out: int
    reads: int
    writes: int
    drops: int
    corrupt: int
    failed: bool
    state: str
    errors: int
    served: int
    def __init__(self, name: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., pages: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., reads: _Optional[int] = ..., writes: _Optional[int] = ..., drops: _Optional[int] = ..., corrupt: _Optional[int] = ..., failed: _Optional[bool] = ..., state: _Optional[str] = ..., errors: _Optional[int] = ..., served: _Optional[int] = ...) -> None: ...

class LayoutStats(_message.Message):
    __slots__ = ("layout_id", "layout", "page_bytes", "pages", "used_bytes", "hits", "misses", "evictions", "bytes_in", "bytes_out", "tenant", "served")
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SERVED_FIELD_NUMBER: _ClassVar[int]
    layout_id: bytes
    layout: _kvstore_pb2.Layout
    page_bytes: int
    pages: int
    used_bytes: int
    hits: int
    misses: int
    evictions: int
    bytes_in: int
    bytes_out: int
    tenant: str
    served: int
    def __init__(self, layout_id: _Optional[bytes] = ..., layout: _Optional[_Union[_kvstore_pb2.Layout, _Mapping]] = ..., page_bytes: _Optional[int] = ..., pages: _Optional[int] = ..., used_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., tenant: _Optional[str] = ..., served: _Optional[int] = ...) -> None: ...

class TenantStats(_message.Message):
    __slots__ = ("name", "used_bytes", "quota_bytes", "pages")
    NAME_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    name: str
    used_bytes: int
    quota_bytes: int
    pages: int
    def __init__(self, name: _Optional[str] = ..., used_bytes: _Optional[int] = ..., quota_bytes: _Optional[int] = ..., pages: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "layouts", "leases", "leased_pages", "uptime_seconds", "version", "tenants", "held_back_pages", "held_back_leases", "pinned_pages", "retained_pages", "retention_sessions", "retention_refused")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    LEASED_PAGES_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    HELD_BACK_PAGES_FIELD_NUMBER: _ClassVar[int]
    HELD_BACK_LEASES_FIELD_NUMBER: _ClassVar[int]
    PINNED_PAGES_FIELD_NUMBER: _ClassVar[int]
    RETAINED_PAGES_FIELD_NUMBER: _ClassVar[int]
    RETENTION_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    RETENTION_REFUSED_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    layouts: _containers.RepeatedCompositeFieldContainer[LayoutStats]
    leases: int
    leased_pages: int
    uptime_seconds: float
    version: str
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStats]
    held_back_pages: int
    held_back_leases: int
    pinned_pages: int
    retained_pages: int
    retention_sessions: int
    retention_refused: int
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., layouts: _Optional[_Iterable[_Union[LayoutStats, _Mapping]]] = ..., leases: _Optional[int] = ..., leased_pages: _Optional[int] = ..., uptime_seconds: _Optional[float] = ..., version: _Optional[str] = ..., tenants: _Optional[_Iterable[_Union[TenantStats, _Mapping]]] = ..., held_back_pages: _Optional[int] = ..., held_back_leases: _Optional[int] = ..., pinned_pages: _Optional[int] = ..., retained_pages: _Optional[int] = ..., retention_sessions: _Optional[int] = ..., retention_refused: _Optional[int] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("layout_id", "bytes", "all", "tier", "force")
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    layout_id: bytes
    bytes: int
    all: bool
    tier: str
    force: bool
    def __init__(self, layout_id: _Optional[bytes] = ..., bytes: _Optional[int] = ..., all: _Optional[bool] = ..., tier: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("pages", "bytes", "skipped_leased", "leases_broken")
    PAGES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_LEASED_FIELD_NUMBER: _ClassVar[int]
    LEASES_BROKEN_FIELD_NUMBER: _ClassVar[int]
    pages: int
    bytes: int
    skipped_leased: int
    leases_broken: int
    def __init__(self, pages: _Optional[int] = ..., bytes: _Optional[int] = ..., skipped_leased: _Optional[int] = ..., leases_broken: _Optional[int] = ...) -> None: ...

class ClearRequest(_message.Message):
    __slots__ = ("force",)
    FORCE_FIELD_NUMBER: _ClassVar[int]
    force: bool
    def __init__(self, force: _Optional[bool] = ...) -> None: ...

class ClearResponse(_message.Message):
    __slots__ = ("pages", "layouts", "leases_broken")
    PAGES_FIELD_NUMBER: _ClassVar[int]
    LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    LEASES_BROKEN_FIELD_NUMBER: _ClassVar[int]
    pages: int
    layouts: int
    leases_broken: int
    def __init__(self, pages: _Optional[int] = ..., layouts: _Optional[int] = ..., leases_broken: _Optional[int] = ...) -> None: ...

class InvalidateRequest(_message.Message):
    __slots__ = ("model", "revision", "layout_id", "tenant")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    model: str
    revision: str
    layout_id: bytes
    tenant: str
    def __init__(self, model: _Optional[str] = ..., revision: _Optional[str] = ..., layout_id: _Optional[bytes] = ..., tenant: _Optional[str] = ...) -> None: ...

class InvalidateResponse(_message.Message):
    __slots__ = ("dram_pages", "disk_pages", "far_pages", "layout_ids")
    DRAM_PAGES_FIELD_NUMBER: _ClassVar[int]
    DISK_PAGES_FIELD_NUMBER: _ClassVar[int]
    FAR_PAGES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_IDS_FIELD_NUMBER: _ClassVar[int]
    dram_pages: int
    disk_pages: int
    far_pages: int
    layout_ids: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, dram_pages: _Optional[int] = ..., disk_pages: _Optional[int] = ..., far_pages: _Optional[int] = ..., layout_ids: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ListLayoutsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListLayoutsResponse(_message.Message):
    __slots__ = ("layouts",)
    LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    layouts: _containers.RepeatedCompositeFieldContainer[LayoutStats]
    def __init__(self, layouts: _Optional[_Iterable[_Union[LayoutStats, _Mapping]]] = ...) -> None: ...

class InspectRequest(_message.Message):
    __slots__ = ("layout_id", "key")
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    layout_id: bytes
    key: bytes
    def __init__(self, layout_id: _Optional[bytes] = ..., key: _Optional[bytes] = ...) -> None: ...

class InspectResponse(_message.Message):
    __slots__ = ("tier", "state", "size_bytes", "age_seconds", "idle_seconds", "leases", "slot_offset")
    TIER_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    SLOT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    tier: str
    state: str
    size_bytes: int
    age_seconds: float
    idle_seconds: float
    leases: int
    slot_offset: int
    def __init__(self, tier: _Optional[str] = ..., state: _Optional[str] = ..., size_bytes: _Optional[int] = ..., age_seconds: _Optional[float] = ..., idle_seconds: _Optional[float] = ..., leases: _Optional[int] = ..., slot_offset: _Optional[int] = ...) -> None: ...
