"""A unary gRPC call carried whole on the fast path: the CALL frame's body, both ways.

The hot calls have frames of their own (fastwire.Op: LOOKUP, GET, PUT, ACQUIRE, ...),
hand-packed because every microsecond shows. A cold call (retention, the removals feed,
a call added tomorrow) needs no such care, and a frame of its own cost it four more
files (both ends' encoders and decoders). So it travels as what gRPC would send:

    request body  | name_len u8 | name (ASCII, the KVStore service's method) | request |
    answer body   the response message, serialized (status 0); an error answer is any
                  other frame's (a UTF-8 message, its Reason in the flags)

The server decodes the request with the very deserializer its gRPC service uses and
hands it to the very servicer method (kvstore_server/rpc/carriage.py), which applies the
rules in kvstore_server/rpc/calls.py once for both doors. A client sends CALL only to a
server that granted fastwire.CALLS at HELLO; a method that server does not carry answers
Status.UNIMPLEMENTED, and the client sends that call over gRPC instead.
"""

from __future__ import annotations

import functools

from google.protobuf.message import Message

from ._proto.kvstore.v1 import admin_pb2 as apb, kvstore_pb2 as pb
from .fastwire import Status, WireError

__all__ = ["MAX_NAME", "admin_call", "call_body_bytes", "decode_call", "encode_call",
           "messages", "service_call"]

MAX_NAME = 64           # bytes of a method's name; the proto's longest is under 20


def call_body_bytes(message_bytes: int) -> int:
    """The largest CALL body that carries a request message of up to message_bytes."""
    return 1 + MAX_NAME + message_bytes


def encode_call(method: str, request: bytes) -> bytes:
    """The CALL body for method's serialized request."""
    name = method.encode("ascii")
    if not 0 < len(name) <= MAX_NAME:
        raise ValueError(f"a carried method's name is 1..{MAX_NAME} ASCII bytes: {method!r}")
    return bytes((len(name),)) + name + request


def decode_call(body: memoryview | bytes) -> tuple[str, bytes]:
    """(method name, serialized request) of a CALL body; WireError(INVALID) when the
    body is too short for its name or the name is not a plain identifier."""
    if not body:
        raise WireError("a CALL body starts with its method's name", Status.INVALID)
    n = body[0]
    raw = bytes(body[1:1 + n])
    if not 0 < n <= MAX_NAME or len(raw) != n:
        raise WireError(f"a CALL names its method in 1..{MAX_NAME} bytes; this one says "
                        f"{n} and holds {len(raw)}", Status.INVALID)
    if not (raw.isascii() and raw.decode().isidentifier()):
        raise WireError(f"a CALL's method name is not a name: {raw!r}", Status.INVALID)
    return raw.decode(), bytes(body[1 + n:])


@functools.cache
def messages(method: str) -> tuple[type[Message], type[Message]] | None:
    """(request, response) message types of the KVStore service's unary method of that
    name, read from the proto's service description; None where it has none such."""
    found = pb.DESCRIPTOR.services_by_name["KVStore"].methods_by_name.get(method)
    if found is None or found.client_streaming or found.server_streaming:
        return None
    return getattr(pb, found.input_type.name), getattr(pb, found.output_type.name)


def service_call(method: str) -> bool:
    """Whether the name is a method of the KVStore service (of any kind)."""
    return method in pb.DESCRIPTOR.services_by_name["KVStore"].methods_by_name


def admin_call(method: str) -> bool:
    """Whether the name is an Admin service method (gRPC only, admin callers only)."""
    return method in apb.DESCRIPTOR.services_by_name["Admin"].methods_by_name
