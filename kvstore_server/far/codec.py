"""The value format of a page in the far tier: a header that proves whose page it is.

A shared cluster holds other deployments' keys, values written by older versions, values
cut short by a failover or by `maxmemory` and, in the worst case, bytes planted by anyone
with write access. So every value carries what it claims to be, and a reader serves it
only when all of it matches what it asked for; anything else is a miss with a reason,
counted, never an exception and never served:

     0        4    5    6        8                       24              32              40
     +--------+----+----+--------+-----------------------+---------------+---------------+
     | magic  |ver |klen| 0  0   |  layout_id (16 bytes) | length u64 LE | xxh3_64 u64 LE|
     | "KVFP" | 1  |    |reserved|  the store's, scoped  | payload bytes | of key+payload|
     +--------+----+----+--------+-----------------------+---------------+---------------+
     | key (klen bytes, 1-64) | payload (length bytes): the page, layer-major            |
     +------------------------+----------------------------------------------------------+

The layout id and key are in the value as well as in the Redis key so that a value
renamed or copied under another key (an operator's mistake, a bug) cannot pass as that
key's page. The checksum covers key and payload; xxh3_64 runs at >10 GB/s, so checking a
1 MiB page costs well under a tenth of a millisecond, against ~1 ms to fetch it.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import xxhash

__all__ = ["HEADER_BYTES", "MAX_PAGE", "Decoded", "Reason", "decode", "encode", "value_bytes"]

MAGIC = b"KVFP"
VERSION = 1
_HEADER = struct.Struct("<4sBBH16sQQ")
HEADER_BYTES = _HEADER.size          # 40, then the key, then the payload

# The largest payload a read accepts when the caller names no page size: a Redis string
# is at most 512 MB (proto-max-bulk-len). The server's reads always name their page size.
MAX_PAGE = 512 << 20


class Reason(enum.Enum):
    """Why a value was or was not served."""

    OK = "ok"
    MISSING = "missing"          # no value under the key
    FOREIGN = "foreign"          # not our magic or version: someone else's value
    WRONG_KEY = "wrong_key"      # ours, but for another layout or key
    TRUNCATED = "truncated"      # shorter or longer than its header says
    CORRUPT = "corrupt"          # checksum mismatch
    OVERSIZED = "oversized"      # longer than the page asked for: refused unfetched


@dataclass(frozen=True, slots=True)
class Decoded:
    """A decoded value: `payload` is a view into the value, or None with the reason."""

    reason: Reason
    payload: memoryview | None = None


_MISSING = Decoded(Reason.MISSING)


def _checksum(key: bytes, payload) -> int:
    h = xxhash.xxh3_64(key)
    h.update(payload)
    return h.intdigest()


def value_bytes(key_bytes: int, page_bytes: int) -> int:
    """The length of the value that holds a page of `page_bytes` under a key of
    `key_bytes`: what a read may fetch for it, and no more."""
    return HEADER_BYTES + key_bytes + page_bytes


def encode(layout_id: bytes, key: bytes, payload) -> bytes:
    """The value to store for one page (payload: bytes-like, e.g. a pool slot's view)."""
    if len(layout_id) != 16:
        raise ValueError(f"layout_id must be 16 bytes, got {len(layout_id)}")
    if not 1 <= len(key) <= 64:
        raise ValueError(f"key must be 1-64 bytes, got {len(key)}")
    view = memoryview(payload).cast("B")
    header = _HEADER.pack(MAGIC, VERSION, len(key), 0, layout_id, view.nbytes,
                          _checksum(key, view))
    return b"".join((header, key, view))


def decode(value, layout_id: bytes, key: bytes) -> Decoded:
    """The payload of `value` if it is `key`'s page of `layout_id`, else a miss and why.
    Never raises: a value is data from outside."""
    if value is None:
        return _MISSING
    try:
        view = memoryview(value).cast("B")
    except TypeError:
        return Decoded(Reason.FOREIGN)
    if view.nbytes < HEADER_BYTES:
        return Decoded(Reason.FOREIGN if view[:4] != MAGIC[:view.nbytes] or not view.nbytes
                       else Reason.TRUNCATED)
    magic, version, klen, _, lid, length, checksum = _HEADER.unpack_from(view)
    if magic != MAGIC or version != VERSION:
        return Decoded(Reason.FOREIGN)
    if view.nbytes < HEADER_BYTES + klen:
        return Decoded(Reason.TRUNCATED)
    if lid != layout_id or klen != len(key) or view[HEADER_BYTES:HEADER_BYTES + klen] != key:
        return Decoded(Reason.WRONG_KEY)
    payload = view[HEADER_BYTES + klen:]
    if payload.nbytes != length:
        return Decoded(Reason.TRUNCATED)
    if _checksum(key, payload) != checksum:
        return Decoded(Reason.CORRUPT)
    return Decoded(Reason.OK, payload)
