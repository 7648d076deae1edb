"""The presence map's format: counters in the shared region of which keys the server's DRAM
holds (why a client wants them: kvstore_client.presence).

The server keeps one counter per bucket: +1 when a key of a layout becomes READY in DRAM,
-1 when it leaves. A counter of 0 proves that no key of that bucket is stored, so a prefix
whose first key's bucket reads 0 counts 0. Anything else is asked as before: the map only
ever answers "absent", and a stale or unreadable map answers nothing. A counter that
reaches 255 stays there (it may then only send lookups to the server, never skip one).

The server keeps the map only while no tier below DRAM holds pages (a disk or far tier: a
key there is a hit the map cannot see), and rewrites a heartbeat every BEAT_SECONDS; a
client trusts the map only while the heartbeat is under LIVE_SECONDS old. So a server that
stopped (or was killed, leaving its region mapped here) costs at most LIVE_SECONDS of
misses, never a wrong count.

Where it lives: the last AREA_BYTES of the region, described in the region's header:

    32        40            48          52          56              64
    | magic   | area offset | bits      | 0         | heartbeat     |
    | 8 B     | u64         | u32       | u32       | f64, CLOCK_MONOTONIC seconds (0: off)

Bucket of a key: acc = salt of the layout (its 16-byte id's first 8 bytes); for each 8-byte
word w of the key, zero-padded, acc = (acc ^ w) * MIX mod 2**64; bucket = acc >> (64 - bits).
The server computes it for a batch in numpy (kvstore_server.store.presence); bucket() here is
one key, as the client reads it (kvstore_client.presence).
"""

from __future__ import annotations

import struct
import sys

__all__ = ["AREA_BYTES", "BEAT_AT", "BEAT_SECONDS", "BITS", "HEADER", "HEADER_AT", "LIVE_SECONDS",
           "MAGIC", "MIX", "bucket", "salt"]

HEADER_AT = 32                       # in the region's 4 KiB header (after magic, token)
HEADER = struct.Struct("<8sQIId")    # magic, area offset, bits, 0, heartbeat
BEAT_AT = HEADER_AT + 24             # the heartbeat's offset
MAGIC = b"kvpres01"
# 4 Mi counters: with 100k pages stored (a 100 GiB pool of 1 MiB pages) 2.4% of misses
# still ask the server; with 1M, 21%.
BITS = 22
AREA_BYTES = 1 << BITS
BEAT_SECONDS = 0.5
LIVE_SECONDS = 2.0
MIX = 0x9E3779B97F4A7C15             # 2**64 / golden ratio, odd
_MASK = (1 << 64) - 1


def salt(layout_id: bytes) -> int:
    """A layout's salt: the first 8 bytes of the id the client sends (never scoped)."""
    return int.from_bytes(layout_id[:8], sys.byteorder)


def bucket(layout_salt: int, key: bytes, bits: int = BITS) -> int:
    """The counter of one key (the module docstring's formula)."""
    acc = layout_salt
    if len(key) % 8:
        key = key + bytes(8 - len(key) % 8)
    for i in range(0, len(key), 8):
        acc = ((acc ^ int.from_bytes(key[i:i + 8], sys.byteorder)) * MIX) & _MASK
    return acc >> (64 - bits)
