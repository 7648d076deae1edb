"""Which keys the server's DRAM holds, as counters it keeps in its shared region, so that a
client on the server's host answers a miss without a round trip.

Why: a request that finds nothing in the store still asks before its prefill, and that
question is serial time before the forward. After idle (as a new request finds the host) a
Lookup cost 0.43 ms on the H200 host, of a 0.71 ms miss, against 0.07 ms back to back
(scratch probe, 1,024-token prompt, 30 ms between requests, medians of 140); a Unix-socket
round trip alone went from 12 to 156 us the same way. Reading one counter costs a few
microseconds. The 8B 1,024-token miss that saves every page read 1.036 times a recompute
(16 rounds side by side, H200), 0.89 ms more, of which 0.54 ms was the lookup. With the
map, the same probes: the miss 0.36 ms (its lookup 0.11); a miss with no saves 1.025 ->
1.011 times a recompute, one that saves 1.036 -> 1.033 (what is left there is the saves'
own bookkeeping); the e2e record's miss breakdown, 1,024 tokens: lookup 0.39 -> 0.16 ms.

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
The server computes it for a batch in numpy (kvstore_server.presence); here it is one key.
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .unixpeer import ServerIdentity

__all__ = ["AREA_BYTES", "BEAT_AT", "BEAT_SECONDS", "BITS", "HEADER", "HEADER_AT", "LIVE_SECONDS",
           "MAGIC", "MIX", "PresenceMap", "bucket", "salt"]

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
_PAGE = 4096


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


class PresenceMap:
    """The server's counters mapped read-only; open() gives None where there are none."""

    def __init__(self, head: mmap.mmap, area: mmap.mmap, bits: int, skip: int) -> None:
        self._head = head                # the region's first page (the heartbeat)
        self._area = area
        self._counts = np.frombuffer(area, dtype=np.uint8)[skip:]
        self._bits = bits
        self._salts: dict[bytes, int] = {}

    @classmethod
    def open(cls, path: str, server: ServerIdentity | None = None) -> PresenceMap | None:
        """The map of the region at path (a file, or the server's hand-out socket), or
        None: no map there (a tier below DRAM, an older server), or it cannot be opened
        from here (OSError: another host, not allowed, or not server's: shm.open_pool)."""
        from .shm import open_pool            # the same way the pool itself is opened
        fd = open_pool(path, server, os.O_RDONLY)
        try:
            head = mmap.mmap(fd, _PAGE, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            magic, offset, bits, _, _ = HEADER.unpack_from(head, HEADER_AT)
            if magic != MAGIC or not 8 <= bits <= 32:
                head.close()
                return None
            start = offset // _PAGE * _PAGE
            area = mmap.mmap(fd, offset - start + (1 << bits), flags=mmap.MAP_SHARED,
                             prot=mmap.PROT_READ, offset=start)
        finally:
            os.close(fd)
        return cls(head, area, bits, offset - start)

    def live(self, now: float | None = None) -> bool:
        """Whether the server wrote its heartbeat within LIVE_SECONDS (False once closed,
        which another thread may do at any time: a restarted server's map)."""
        try:
            beat = struct.unpack_from("<d", self._head, BEAT_AT)[0]
        except ValueError:                # closed
            return False
        now = time.monotonic() if now is None else now
        return 0.0 < beat and now - LIVE_SECONDS < beat <= now + 1.0

    def absent(self, layout_ids: Sequence[bytes], first_key: bytes) -> bool:
        """True only if some layout surely lacks first_key in the server's DRAM (then a
        prefix starting there counts 0); False when unsure or the map is not live."""
        counts = self._counts            # kept: another thread may close() meanwhile
        if not counts.size or not self.live():
            return False
        for layout_id in layout_ids:
            s = self._salts.get(layout_id)
            if s is None:
                s = self._salts[layout_id] = salt(layout_id)
            if not counts[bucket(s, bytes(first_key), self._bits)]:
                return True
        return False

    def close(self) -> None:
        self._counts = np.zeros(0, dtype=np.uint8)
        for m in (self._area, self._head):
            try:
                m.close()
            except BufferError:
                pass                        # a view still lives; the mapping goes with it
