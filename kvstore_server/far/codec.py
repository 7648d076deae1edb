"""The value format of a page in the far tier: a header that proves whose page it is and
that a holder of the fleet's secret wrote it.

A shared cluster holds other deployments' keys, values written by older versions, values
cut short by a failover or by `maxmemory` and, in the worst case, bytes planted by anyone
with write access (every server of the fleet holds the cluster's password). So every
value carries what it claims to be and a MAC keyed by the fleet's secret (secret.py),
and a reader serves it only when all of it matches what it asked for; anything else is
a miss with a reason, counted, never an exception and never served:

     0      4   5   6     8                 24            32          40              72
     +------+---+---+-----+-----------------+-------------+-----------+---------------+
     |magic |ver|kln| 0 0 | layout_id (16)  | length u64  | key id (8)| HMAC-SHA256   |
     |"KVFP"| 2 |   |rsvd | the store's,    | payload     | of the    | of bytes 0-40,|
     |      |   |   |     | tenant-scoped   | bytes, LE   | signing   | key, payload  |
     +------+---+---+-----+-----------------+-------------+-----------+---------------+
     | key (klen bytes, 1-64) | payload (length bytes): the page, layer-major          |
     +------------------------+--------------------------------------------------------+

The layout id and key are in the value as well as in the Redis key, and under the MAC,
so that a value renamed or copied under another key (an operator's mistake, a bug, an
attacker replaying one tenant's page as another's) cannot pass as that key's page.

Why HMAC-SHA256. The MAC reads every byte of every page a server fetches, so its speed
is the far tier's CPU cost. On x86 with SHA extensions (Python's hashlib on OpenSSL)
HMAC-SHA256 was the fastest MAC measured, ahead of keyed BLAKE2b, HMAC-SHA512 and keyed
BLAKE2s (the unkeyed xxh3_64 of version 1 is far faster, but anyone can compute it, so
it proves nothing about who wrote a value; xxh3 with a secret seed is no MAC either, collisions of a
non-cryptographic hash can be found). A CPU without SHA extensions runs SHA-256 at about
BLAKE2b's speed or less; both are in the standard library, so the choice needs no new
dependency. hashlib releases the GIL over large buffers, so the parallel reads
(reads.py) check pages on several cores. Checking a page costs about what fetching it
costs on loopback.

Version 1 (an unkeyed xxh3 where key id and MAC are now) is refused as UNSIGNED: after
an upgrade those values are misses until written again.
"""

from __future__ import annotations

import enum
import hmac
import struct
from dataclasses import dataclass
from typing import Protocol

from .secret import INSECURE, Keyring

__all__ = ["HEADER_BYTES", "MAX_PAGE", "Decoded", "Keys", "ValueVerdict", "decode", "encode",
           "value_bytes"]

MAGIC = b"KVFP"
VERSION = 2
_HEADER = struct.Struct("<4sBBH16sQ8s32s")
_SIGNED = 40                        # header bytes under the MAC: all but the MAC itself
HEADER_BYTES = _HEADER.size         # 72, then the key, then the payload

# The largest payload a read accepts when the caller names no page size: a Redis string
# is at most 512 MB (proto-max-bulk-len). The server's reads always name their page size.
MAX_PAGE = 512 << 20


class Keys(Protocol):
    """Where the keys come from: a Keyring, or a SecretFile that may change under it."""

    def keyring(self) -> Keyring: ...


class ValueVerdict(enum.Enum):
    """Why a value was or was not served."""

    OK = "ok"
    MISSING = "missing"          # no value under the key
    FOREIGN = "foreign"          # not our magic or version: someone else's value
    WRONG_KEY = "wrong_key"      # ours, but for another layout or key
    TRUNCATED = "truncated"      # shorter or longer than its header says
    CORRUPT = "corrupt"          # MAC mismatch: altered, forged or damaged
    OVERSIZED = "oversized"      # longer than the page asked for: refused, not fetched whole
    UNSIGNED = "unsigned"        # version 1: an unkeyed checksum proves no writer
    UNKNOWN_KEY = "unknown_key"  # signed with a secret this server does not hold


@dataclass(frozen=True, slots=True)
class Decoded:
    """A decoded value: `payload` is a view into the value, or None with the reason."""

    reason: ValueVerdict
    payload: memoryview | None = None


_MISSING = Decoded(ValueVerdict.MISSING)


def _mac(start: hmac.HMAC, signed, key: bytes, payload) -> bytes:
    h = start.copy()
    h.update(signed)
    h.update(key)
    h.update(payload)
    return h.digest()


def value_bytes(key_bytes: int, page_bytes: int) -> int:
    """The length of the value that holds a page of `page_bytes` under a key of
    `key_bytes`: what a read may fetch for it, and no more."""
    return HEADER_BYTES + key_bytes + page_bytes


def encode(layout_id: bytes, key: bytes, payload, keys: Keys = INSECURE) -> bytes:
    """The value to store for one page (payload: bytes-like, e.g. a pool slot's view),
    signed with the keyring's writing key."""
    if len(layout_id) != 16:
        raise ValueError(f"layout_id must be 16 bytes, got {len(layout_id)}")
    if not 1 <= len(key) <= 64:
        raise ValueError(f"key must be 1-64 bytes, got {len(key)}")
    view = memoryview(payload).cast("B")
    signing = keys.keyring().writing
    header = bytearray(_HEADER.pack(MAGIC, VERSION, len(key), 0, layout_id, view.nbytes,
                                    signing.key_id, bytes(32)))
    header[_SIGNED:] = _mac(signing.mac, memoryview(header)[:_SIGNED], key, view)
    return b"".join((header, key, view))


def decode(value, layout_id: bytes, key: bytes, keys: Keys = INSECURE) -> Decoded:
    """The payload of `value` if it is `key`'s page of `layout_id`, signed by a key of
    the keyring, else a miss and why. Never raises: a value is data from outside."""
    if value is None:
        return _MISSING
    try:
        view = memoryview(value).cast("B")
    except TypeError:
        return Decoded(ValueVerdict.FOREIGN)
    if view.nbytes >= 5 and view[:4] == MAGIC and view[4] == 1:
        return Decoded(ValueVerdict.UNSIGNED)
    if view.nbytes < HEADER_BYTES:
        return Decoded(ValueVerdict.FOREIGN if view[:4] != MAGIC[:view.nbytes] or not view.nbytes
                       else ValueVerdict.TRUNCATED)
    magic, version, klen, _, lid, length, key_id, mac = _HEADER.unpack_from(view)
    if magic != MAGIC or version != VERSION:
        return Decoded(ValueVerdict.FOREIGN)
    if view.nbytes < HEADER_BYTES + klen:
        return Decoded(ValueVerdict.TRUNCATED)
    if lid != layout_id or klen != len(key) or view[HEADER_BYTES:HEADER_BYTES + klen] != key:
        return Decoded(ValueVerdict.WRONG_KEY)
    payload = view[HEADER_BYTES + klen:]
    if payload.nbytes != length:
        return Decoded(ValueVerdict.TRUNCATED)
    signing = keys.keyring().key(key_id)
    if signing is None:
        return Decoded(ValueVerdict.UNKNOWN_KEY)
    if not hmac.compare_digest(_mac(signing.mac, view[:_SIGNED], key, payload), mac):
        return Decoded(ValueVerdict.CORRUPT)
    return Decoded(ValueVerdict.OK, payload)
