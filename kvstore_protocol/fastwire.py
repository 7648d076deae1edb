"""The fast path's wire format: frames of the lean binary protocol beside gRPC.

Both ends import this module (the server package imports the client's, never the other
way round), and it imports no protobuf. It holds the one table from a frame's status to
the gRPC status the same outcome has on the gRPC path (GRPC_CODES), which the client
raises and the server counts in its metrics. The layout is drawn in docs/fastpath.md;
in short, every request and every response is one frame:

     0      2     3     4        6        8                16               24
     +------+-----+-----+--------+--------+----------------+----------------+
     | "KF" | ver | op  | status | flags  |   body_len     |   data_len     |
     |      | u8  | u8  |  u16   |  u16   |     u64        |     u64        |
     +------+-----+-----+--------+--------+----------------+----------------+
     | body: body_len bytes, the op's fields (little-endian, packed keys last)   |
     | data: data_len bytes of page bytes (Put requests, Get responses only)     |

One frame answers one frame, in order, on one connection (no request ids: a client
that wants calls in parallel opens more connections). A response's `status` is 0 for
success; anything else is an error whose body is a UTF-8 message for people and whose
flags name a Reason (REASON_FLAGS) where the client must react. Page bytes travel
after the body and are never copied into a Python object on either end: the server
sends them from the pool and receives them into reserved pool slots, the client
receives into the caller's buffer.

Every length is checked against the bounds below before a byte is allocated; a frame
that breaks them gets a PROTOCOL error frame and the connection is closed.
"""

from __future__ import annotations

import enum
import struct
import typing

import grpc
import numpy as np

from .keys import MAX_KEY_BYTES
from .layout import MAX_LOOKUP_LAYOUTS
from .reasons import Reason

__all__ = ["ALIGNED", "ALIGN_PAD", "CALLS", "COUNT", "COUNT_LEASE", "GRPC_CODES", "HEADER", "LAYER_MAJOR", "LAYOUT_HEAD",
           "LAYOUT_ID_BYTES", "LAYOUT_KEYS_HEAD", "LEASE", "LEASED_HEAD", "LOOKUP_HEAD", "MAGIC", "MAX_ANSWER_BODY",
           "MAX_BODY", "MAX_DATA", "MAX_LAYOUTS", "MISSED", "ONE_LAYOUT_LOOKUP", "PAGE_MAJOR", "PINS", "PINS_HEAD",
           "PUT_DONE", "QUIET", "READ", "REASON_FLAGS", "REGION_TOKEN_BYTES", "RESERVED", "VERSION",
           "Header", "KeysBlock", "Op", "Status", "WireError", "decode_header", "decode_keys",
           "decode_layout_keys",
           "encode_header", "encode_keys", "reason_flags", "reason_of_flags", "request_body_bytes",
           "u64", "unpack_u64"]

MAGIC = b"KF"
VERSION = 3
HEADER = struct.Struct("<2sBBHHQQ")          # 24 bytes, see the diagram above
assert HEADER.size == 24

# Bounds of one request. How many keys one request may name is the server's
# RequestLimits (kvstore_server/rpc/limits.py, --max-keys-per-request), the same object the
# gRPC path asks, so both paths refuse the same requests with the same INVALID_ARGUMENT.
# The wire only bounds the body that holds them, before a byte of it is read: the keys
# at their longest plus one id per layout of a Lookup. MAX_BODY is that bound at the
# default of 16,384 keys (about 1 MiB); a server with another limit passes its own.
MAX_LAYOUTS = MAX_LOOKUP_LAYOUTS             # one per rank (layout.MAX_LOOKUP_LAYOUTS)
LAYOUT_ID_BYTES = 16
REGION_TOKEN_BYTES = 16


def request_body_bytes(max_keys: int) -> int:
    """The largest request body a server with this keys-per-request limit reads."""
    return max_keys * MAX_KEY_BYTES + MAX_LAYOUTS * LAYOUT_ID_BYTES + 64


MAX_BODY = request_body_bytes(16_384)
# What a client reads of one answer's body before it calls the answer out of step: an
# Acquire's answer is 8 bytes a key, so 64 MiB is 8 M keys, past any sane server limit.
MAX_ANSWER_BODY = 64 << 20
# Page bytes of one Put or Get: they land in pool slots or the caller's buffer, never
# in a buffer of the connection, so the bound only stops nonsense lengths.
MAX_DATA = 1 << 40

# GET flags: the order of the page bytes in the response's data.
PAGE_MAJOR = 0          # page 0 whole, then page 1, ...: what get_into wants
LAYER_MAJOR = 1         # every page's layer 0, then layer 1, ...: what get_layers wants

# HELLO and RELEASE flag: a RELEASE that asks for no answer. A client offers it in its
# HELLO's flags, a server that knows it grants it in the HELLO answer's flags (a server
# that does not answers 0, and the client keeps waiting for answers). Why: a client that
# releases without waiting read the release's answer before its next call, and that
# answer woke it once more for nothing, a cost on every same-host acquire + release. A quiet
# RELEASE that fails (the lease had expired) is counted in the server's metrics and
# logged; the lease is gone either way.
QUIET = 1

# HELLO flag: the client reads GET answers whose page bytes begin ALIGN_PAD bytes after
# the header, not right after it: their body is ALIGN_PAD zero bytes. Offered and granted
# as QUIET is; a server that does not grant it answers as before. Why: the kernel copies a
# send into its buffers from where the last send left off (at 0 when the peer has read
# everything, as it has when it waits for an answer), and on some CPUs a copy whose
# destination lies 1-31 bytes past its source modulo 4 KiB runs several times slower.
# Pool pages are 4 KiB-aligned, so 24 header bytes put a Get's pages just there.
ALIGNED = 2
ALIGN_PAD = 8

# HELLO flag: the client may send CALL frames, a unary gRPC call carried whole (its
# method's name and its protobuf request; kvstore_protocol.carriage). Offered and granted
# as QUIET is: a server that does not grant it never sees a CALL (it would close the
# connection on an op it does not know), and the client sends those calls over gRPC.
CALLS = 4

# LOOKUP flag: a leased lookup that also answers where its pages lie in the shared pool,
# so a worker on the server's host can copy them under the lookup's own lease instead of
# pinning them again with an ACQUIRE (a round trip on a hit's critical path). The server answers the pins only to a caller that may
# map the pool; a lease so answered is not released when the connection closes (the
# pages may be read by another process), only by RELEASE or its ttl.
PINS = 1

# LOOKUP flag: the client already answered this lookup 0 from the server's presence map
# (kvstore_client.presence) and does not wait for this answer: the server only counts the
# keys as misses of each of the caller's layouts it knows, and answers 0. The lookup is
# sent at all so that the server's hit and miss counts stay whole; looked up instead, a
# page stored meanwhile would have been counted as a hit the client never had.
MISSED = 2


# An error answer's flags: why it failed where the client must react (reasons.Reason): it
# branches on these, never on the message, which is for people and may be reworded. 0 = no
# reason; a number this end does not know reads as none. Version 3 added them: a version 2
# server answered errors with flags 0, so its client matched message text instead.
REASON_FLAGS = {Reason.LAYOUT_UNKNOWN: 1, Reason.SHM_TOKEN_STALE: 2, Reason.PAGES_MISSING: 3}
_REASON_OF_FLAGS = {flags: reason for reason, flags in REASON_FLAGS.items()}


def reason_flags(reason: Reason | None) -> int:
    """The flags of an error answer that has this reason."""
    return 0 if reason is None else REASON_FLAGS[reason]


def reason_of_flags(flags: int) -> Reason | None:
    """The reason an error answer's flags name, or None."""
    return _REASON_OF_FLAGS.get(flags)


class Op(enum.IntEnum):
    HELLO = 1        # token -> tenant name; must come first (flags: QUIET, ALIGNED
    #                  offered/granted)
    LOOKUP = 2       # layouts, keys, lease_ms -> leading keys present, lease id
    EXISTS = 3       # layout, keys -> one bit per key
    GET = 4          # layout, keys -> page bytes (pinned while sent)
    PUT = 5          # layout, keys + page bytes -> stored, skipped, in flight
    DELETE = 6       # layout, keys -> deleted
    ACQUIRE = 7      # same host: layout, keys, lease_ms, region token -> lease, offsets
    RESERVE = 8      # same host: as ACQUIRE -> lease, skipped, in flight, offsets
    COMMIT = 9       # lease -> stored
    ABORT = 10       # lease -> aborted
    RELEASE = 11     # lease -> released (flags QUIET: no answer)
    CALL = 12        # method name, protobuf request -> protobuf response (HELLO's CALLS
    #                  granted; kvstore_protocol.carriage)


class Status(enum.IntEnum):
    """A response's outcome. 1-6 are the store's outcomes (kvstore_server.errors), each
    mapped to the same gRPC status the gRPC path answers with."""

    OK = 0
    INVALID = 1          # INVALID_ARGUMENT
    NOT_FOUND = 2
    EXHAUSTED = 3        # RESOURCE_EXHAUSTED
    EXPIRED = 4          # FAILED_PRECONDITION
    UNAUTHENTICATED = 5
    DENIED = 6           # PERMISSION_DENIED
    INTERNAL = 7         # a server defect; the server log says more
    PROTOCOL = 8         # a malformed frame: the server closes the connection after it
    BUSY = 9             # too many connections (UNAVAILABLE): try again, or use gRPC
    UNIMPLEMENTED = 10   # a CALL of a method the server does not carry: use gRPC


# The gRPC status each outcome has: what the client raises, what the server's metrics
# count. PROTOCOL counts as INVALID_ARGUMENT (the peer sent a frame that breaks the
# format); a client never raises it, as the connection is closed after it and the
# client calls the connection broken instead.
GRPC_CODES = {
    Status.OK: grpc.StatusCode.OK,
    Status.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    Status.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Status.EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Status.EXPIRED: grpc.StatusCode.FAILED_PRECONDITION,
    Status.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    Status.DENIED: grpc.StatusCode.PERMISSION_DENIED,
    Status.INTERNAL: grpc.StatusCode.INTERNAL,
    Status.PROTOCOL: grpc.StatusCode.INVALID_ARGUMENT,
    Status.BUSY: grpc.StatusCode.UNAVAILABLE,
    Status.UNIMPLEMENTED: grpc.StatusCode.UNIMPLEMENTED,
}
assert set(GRPC_CODES) == set(Status)


class WireError(ValueError):
    """A frame that breaks the format or its bounds; `status` says how to answer it."""

    def __init__(self, message: str, status: Status = Status.PROTOCOL) -> None:
        super().__init__(message)
        self.status = status


class Header(typing.NamedTuple):
    """A decoded frame header. A NamedTuple, not a frozen dataclass: every frame on both
    ends makes one, and a frozen dataclass is several times dearer to build (its
    __init__ sets each field through object.__setattr__)."""

    op: int
    status: int
    flags: int
    body_len: int
    data_len: int


def encode_header(op: int, body_len: int, data_len: int = 0, status: int = 0,
                  flags: int = 0) -> bytes:
    return HEADER.pack(MAGIC, VERSION, op, status, flags, body_len, data_len)


def decode_header(raw: bytes | bytearray | memoryview, *, request: bool,
                  max_body: int = MAX_BODY) -> Header:
    """The header of a frame; WireError if it is not one this version can read, or if a
    request's lengths break the bounds (checked here, before anything is allocated).
    max_body: the server's request_body_bytes(its keys-per-request limit)."""
    magic, version, op, status, flags, body_len, data_len = HEADER.unpack(raw)
    if magic != MAGIC:
        raise WireError(f"not a kvstore fast-path frame (magic {bytes(magic)!r}, "
                        f"expected {MAGIC!r}): is this the gRPC port?")
    if version != VERSION:
        raise WireError(f"fast-path version {version} is not supported (this end speaks "
                        f"{VERSION})")
    if request:
        if op not in Op._value2member_map_:
            raise WireError(f"unknown op {op}")
        if body_len > max_body:
            raise WireError(f"body of {body_len} bytes is over the limit of {max_body}")
        if data_len > MAX_DATA or (data_len and op != Op.PUT):
            raise WireError(f"data of {data_len} bytes is not allowed on op {Op(op).name} "
                            f"(only PUT carries data, at most {MAX_DATA} bytes)")
    return Header(op, status, flags, body_len, data_len)


class KeysBlock(typing.NamedTuple):
    """Keys of one request: `n` keys of `key_size` bytes, packed back to back. A
    NamedTuple, as Header is: every request with keys makes one."""

    key_size: int
    data: bytes

    @property
    def n(self) -> int:
        return len(self.data) // self.key_size if self.key_size else 0


def encode_keys(key_size: int, packed: bytes) -> bytes:
    """| key_size u8 | n u32 | n * key_size bytes |"""
    n = len(packed) // key_size if key_size else 0
    return struct.pack("<BI", key_size, n) + packed


def decode_keys(body: memoryview, pos: int) -> tuple[KeysBlock, int]:
    """(keys, position after them); WireError(INVALID) on a bad count or size. How many
    keys may come is the server's RequestLimits' to say, after this."""
    if len(body) < pos + 5:
        raise WireError("body ends before its keys", Status.INVALID)
    key_size, n = struct.unpack_from("<BI", body, pos)
    pos += 5
    if n and not 1 <= key_size <= MAX_KEY_BYTES:
        raise WireError(f"key_size must be 1..{MAX_KEY_BYTES} bytes, got {key_size}",
                        Status.INVALID)
    end = pos + n * key_size
    if end > len(body):
        raise WireError(f"body holds {len(body) - pos} bytes of keys, {n} keys of "
                        f"{key_size} need {n * key_size}", Status.INVALID)
    return KeysBlock(key_size, bytes(body[pos:end])), end


def decode_layout_keys(body: memoryview) -> tuple[bytes, int, bytes]:
    """(layout id, one key's size, packed keys) of a body that is a layout id and its keys
    (EXISTS, GET, PUT, DELETE): one unpack, no KeysBlock, for the calls every engine makes
    per layer. The size is 0 when no key comes (an unset size, as the calls take it).
    WireError(INVALID) as decode_keys, with its messages (a short body goes its way)."""
    if len(body) >= LAYOUT_KEYS_HEAD.size:
        layout_id, key_size, n = LAYOUT_KEYS_HEAD.unpack_from(body)
        end = LAYOUT_KEYS_HEAD.size + n * key_size
        if 1 <= key_size <= MAX_KEY_BYTES and end <= len(body):
            return layout_id, key_size if n else 0, bytes(body[LAYOUT_KEYS_HEAD.size:end])
    if len(body) < LAYOUT_HEAD.size:
        raise WireError(f"body of {len(body)} bytes is too short for this op "
                        f"(needs {LAYOUT_HEAD.size})", Status.INVALID)
    block, _ = decode_keys(body, LAYOUT_HEAD.size)
    return bytes(body[:LAYOUT_HEAD.size]), block.key_size if block.n else 0, block.data


def u64(values: np.ndarray) -> bytes:
    """An int64 array as little-endian bytes (offsets in responses)."""
    return np.ascontiguousarray(values, dtype="<i8").tobytes()


def unpack_u64(raw: bytes | memoryview) -> np.ndarray:
    return np.frombuffer(raw, dtype="<i8")


# Fixed parts of the bodies, before any packed keys (docs/fastpath.md lists each op).
LOOKUP_HEAD = struct.Struct("<IH")        # lease_ms, number of layout ids (16 B each)
LAYOUT_HEAD = struct.Struct("<16s")       # EXISTS, GET, PUT, DELETE: layout id
LAYOUT_KEYS_HEAD = struct.Struct("<16sBI")  # ... and then their keys' key_size, n
ONE_LAYOUT_LOOKUP = struct.Struct("<IH16sBI")  # LOOKUP_HEAD, one layout id, its keys'
#                                          key_size, n: an engine's lookup, one pack
LEASED_HEAD = struct.Struct("<16s16sI")   # ACQUIRE, RESERVE: layout, region token, lease_ms
LEASE = struct.Struct("<Q")               # COMMIT, ABORT, RELEASE: lease id; their answers
READ = struct.Struct("<I")                # RELEASE, optionally after the lease id: pages read
COUNT_LEASE = struct.Struct("<QQ")        # LOOKUP answer: count, lease id
PINS_HEAD = struct.Struct("<QII")         # then, with PINS: region id, lease ttl ms, layouts;
#                                          offsets follow (layouts x count, -1: not pinned)
PUT_DONE = struct.Struct("<III")          # PUT answer: stored, skipped, in flight
RESERVED = struct.Struct("<QII")          # RESERVE answer: lease id, skipped, in flight;
#                                          offsets follow
COUNT = struct.Struct("<I")               # EXISTS answer (then the bitmap), DELETE answer
