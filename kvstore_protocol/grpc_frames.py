"""Bulk bytes on the wire without protobuf copies.

`GetResponse` and `PutRequest.data` carry the page bytes. Building them as protobuf
objects copies each chunk twice more (into the message, then out when serialising),
which costs a good part of Python gRPC's throughput. These helpers write and read the same
wire format directly: a bytes field is a tag byte, a varint length and the payload,
so one `b"".join` makes the serialised message and reading one is a memoryview slice.
The messages stay valid protobuf, so clients in other languages see nothing unusual.

    GetResponse / PutRequest.data:  | tag | varint len | payload ... |
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["CHANNEL_OPTIONS", "GET_DATA_TAG", "PUT_DATA_TAG", "frame", "unframe"]

# gRPC channel options for bulk transfers, used by both ends. HTTP/2's default frame
# size (16 KiB) cuts every 1 MiB message into 64 frames; raising it to 8 MiB made a
# large Get markedly faster on loopback.
# Messages up to 64 MiB are accepted: a lookup of 32k 64-byte keys is 2 MiB.
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.http2.max_frame_size", (8 << 20)),
    ("grpc.http2.lookahead_bytes", 16 << 20),
    # A connection's reconnect backoff (gRPC's default: from 1 s, x1.6 per failed attempt,
    # up to 120 s). After a short outage a client still failed with "connection refused"
    # for seconds after the restarted server was healthy, and its own retries never
    # reached it. Capped at 1 s, a restart costs at most about a second of refusals.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Each channel its own connections. By default channels with the same options share
    # one connection per address across the process, and with it the backoff: a client
    # made after a restart failed its first call with "connection refused" against a
    # healthy server, in 2 of 4 runs of tests/integration/test_restart_clients.py, while an
    # older client's backoff ran out.
    ("grpc.use_local_subchannel_pool", 1),
]

GET_DATA_TAG = 0x0A   # GetResponse.data: field 1, wire type 2
PUT_DATA_TAG = 0x12   # PutRequest.data: field 2, wire type 2 (oneof part)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def frame(tag: int, parts: Sequence[bytes | memoryview]) -> bytes:
    """One serialised message whose single bytes field is the concatenation of parts."""
    total = sum(len(p) if not isinstance(p, memoryview) else p.nbytes for p in parts)
    return b"".join((bytes((tag,)), _varint(total), *parts))


def unframe(message: bytes, tag: int) -> memoryview | None:
    """The payload of a message holding only the bytes field `tag`; None if the message
    has any other shape (the caller then falls back to the protobuf parser)."""
    if not message:
        return memoryview(b"")
    if message[0] != tag:
        return None
    length, shift, pos = 0, 0, 1
    while pos < len(message):
        byte = message[pos]
        pos += 1
        length |= (byte & 0x7F) << shift
        if not byte & 0x80:
            break
        shift += 7
        if shift > 63:
            return None
    if pos + length != len(message):
        return None
    return memoryview(message)[pos:]
