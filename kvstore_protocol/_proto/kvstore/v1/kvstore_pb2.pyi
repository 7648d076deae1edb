from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Layout(_message.Message):
    __slots__ = ("model", "dtype", "num_layers", "page_tokens", "num_kv_heads", "head_size", "kv_factor", "tp_rank", "tp_size", "pp_rank", "salt")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_FACTOR_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    SALT_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    num_layers: int
    page_tokens: int
    num_kv_heads: int
    head_size: int
    kv_factor: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    salt: str
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., page_tokens: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_size: _Optional[int] = ..., kv_factor: _Optional[int] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., pp_rank: _Optional[int] = ..., salt: _Optional[str] = ...) -> None: ...

class PackedKeys(_message.Message):
    __slots__ = ("data", "key_size")
    DATA_FIELD_NUMBER: _ClassVar[int]
    KEY_SIZE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    key_size: int
    def __init__(self, data: _Optional[bytes] = ..., key_size: _Optional[int] = ...) -> None: ...

class RegisterLayoutRequest(_message.Message):
    __slots__ = ("layout",)
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    layout: Layout
    def __init__(self, layout: _Optional[_Union[Layout, _Mapping]] = ...) -> None: ...

class RegisterLayoutResponse(_message.Message):
    __slots__ = ("layout_id", "page_bytes", "layer_bytes")
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYER_BYTES_FIELD_NUMBER: _ClassVar[int]
    layout_id: bytes
    page_bytes: int
    layer_bytes: int
    def __init__(self, layout_id: _Optional[bytes] = ..., page_bytes: _Optional[int] = ..., layer_bytes: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("layout_ids", "keys", "lease_ms")
    LAYOUT_IDS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    layout_ids: _containers.RepeatedScalarFieldContainer[bytes]
    keys: PackedKeys
    lease_ms: int
    def __init__(self, layout_ids: _Optional[_Iterable[bytes]] = ..., keys: _Optional[_Union[PackedKeys, _Mapping]] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("count", "lease_id")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    count: int
    lease_id: int
    def __init__(self, count: _Optional[int] = ..., lease_id: _Optional[int] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    def __init__(self, lease_id: _Optional[int] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class ExistsRequest(_message.Message):
    __slots__ = ("layout_id", "keys")
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    layout_id: bytes
    keys: PackedKeys
    def __init__(self, layout_id: _Optional[bytes] = ..., keys: _Optional[_Union[PackedKeys, _Mapping]] = ...) -> None: ...

class ExistsResponse(_message.Message):
    __slots__ = ("bitmap", "count")
    BITMAP_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    bitmap: bytes
    count: int
    def __init__(self, bitmap: _Optional[bytes] = ..., count: _Optional[int] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PutHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[PutHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutHeader(_message.Message):
    __slots__ = ("layout_id", "keys")
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    layout_id: bytes
    keys: PackedKeys
    def __init__(self, layout_id: _Optional[bytes] = ..., keys: _Optional[_Union[PackedKeys, _Mapping]] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("stored", "skipped", "in_flight")
    STORED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    stored: int
    skipped: int
    in_flight: int
    def __init__(self, stored: _Optional[int] = ..., skipped: _Optional[int] = ..., in_flight: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("layout_id", "keys")
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    layout_id: bytes
    keys: PackedKeys
    def __init__(self, layout_id: _Optional[bytes] = ..., keys: _Optional[_Union[PackedKeys, _Mapping]] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("layout_id", "keys")
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    layout_id: bytes
    keys: PackedKeys
    def __init__(self, layout_id: _Optional[bytes] = ..., keys: _Optional[_Union[PackedKeys, _Mapping]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("path", "size", "token_offset", "socket_path", "uid", "gid", "pid")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SOCKET_PATH_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    GID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    token_offset: int
    socket_path: str
    uid: int
    gid: int
    pid: int
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., token_offset: _Optional[int] = ..., socket_path: _Optional[str] = ..., uid: _Optional[int] = ..., gid: _Optional[int] = ..., pid: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("layout_id", "keys", "token", "lease_ms")
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    layout_id: bytes
    keys: PackedKeys
    token: bytes
    lease_ms: int
    def __init__(self, layout_id: _Optional[bytes] = ..., keys: _Optional[_Union[PackedKeys, _Mapping]] = ..., token: _Optional[bytes] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("lease_id", "offsets", "skipped", "in_flight")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    offsets: bytes
    skipped: int
    in_flight: int
    def __init__(self, lease_id: _Optional[int] = ..., offsets: _Optional[bytes] = ..., skipped: _Optional[int] = ..., in_flight: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    def __init__(self, lease_id: _Optional[int] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("stored",)
    STORED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    def __init__(self, stored: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    def __init__(self, lease_id: _Optional[int] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("layout_id", "keys", "token", "lease_ms")
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    layout_id: bytes
    keys: PackedKeys
    token: bytes
    lease_ms: int
    def __init__(self, layout_id: _Optional[bytes] = ..., keys: _Optional[_Union[PackedKeys, _Mapping]] = ..., token: _Optional[bytes] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("lease_id", "offsets")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    offsets: bytes
    def __init__(self, lease_id: _Optional[int] = ..., offsets: _Optional[bytes] = ...) -> None: ...

class RetainRequest(_message.Message):
    __slots__ = ("layout_id", "keys", "session", "ttl_ms")
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    layout_id: bytes
    keys: PackedKeys
    session: str
    ttl_ms: int
    def __init__(self, layout_id: _Optional[bytes] = ..., keys: _Optional[_Union[PackedKeys, _Mapping]] = ..., session: _Optional[str] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class RetainResponse(_message.Message):
    __slots__ = ("pages", "refused")
    PAGES_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    pages: int
    refused: str
    def __init__(self, pages: _Optional[int] = ..., refused: _Optional[str] = ...) -> None: ...

class ReleaseRetentionRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    def __init__(self, session: _Optional[str] = ...) -> None: ...

class ReleaseRetentionResponse(_message.Message):
    __slots__ = ("pages",)
    PAGES_FIELD_NUMBER: _ClassVar[int]
    pages: int
    def __init__(self, pages: _Optional[int] = ...) -> None: ...
