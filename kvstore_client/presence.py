"""Which keys the server's DRAM holds, as counters it keeps in its shared region, so that a
client on the server's host answers a miss without a round trip.

Why: a request that finds nothing in the store still asks before its prefill, and that
question is serial time before the forward. After idle (as a new request finds the host)
a Lookup's round trip costs several times what it does back to back, as the wake-ups on
both ends grow; reading one counter costs a few microseconds. The map took a 1,024-token
miss's lookup to 0.16 ms in the H200 record's miss breakdown
(docs/perf/e2e-ec25c98d81.json).

The map's format (where it lives, what a counter means, the bucket formula) is both ends'
contract: kvstore_protocol.presence_map. This module is the client's reader.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvstore_protocol.presence_map import (
    AREA_BYTES,
    BEAT_AT,
    BEAT_SECONDS,
    BITS,
    HEADER,
    HEADER_AT,
    LIVE_SECONDS,
    MAGIC,
    MIX,
    bucket,
    salt,
)

if TYPE_CHECKING:
    from .unixpeer import ServerIdentity

__all__ = ["AREA_BYTES", "BEAT_AT", "BEAT_SECONDS", "BITS", "HEADER", "HEADER_AT", "LIVE_SECONDS",
           "MAGIC", "MIX", "PresenceMap", "bucket", "salt"]

_PAGE = 4096


class PresenceMap:
    """The server's counters mapped read-only; open() gives None where there are none."""

    def __init__(self, head: mmap.mmap, area: mmap.mmap, bits: int, skip: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._head = head                # the region's first page (the heartbeat)
        self._clock = clock              # CLOCK_MONOTONIC, as the server's heartbeat is
        self._area = area
        self._counts = np.frombuffer(area, dtype=np.uint8)[skip:]
        self._bits = bits
        self._salts: dict[bytes, int] = {}

    @classmethod
    def open(cls, path: str, server: ServerIdentity | None = None,
             clock: Callable[[], float] = time.monotonic) -> PresenceMap | None:
        """The map of the region at path (a file, or the server's hand-out socket), or
        None: no map there (a tier below DRAM, an older server), or it cannot be opened
        from here (OSError: another host, not allowed, or not server's: shm.open_pool)."""
        from .shm import open_pool  # the same way the pool itself is opened
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
        return cls(head, area, bits, offset - start, clock)

    def live(self, now: float | None = None) -> bool:
        """Whether the server wrote its heartbeat within LIVE_SECONDS (False once closed,
        which another thread may do at any time: a restarted server's map)."""
        try:
            beat = struct.unpack_from("<d", self._head, BEAT_AT)[0]
        except ValueError:                # closed
            return False
        now = self._clock() if now is None else now
        return beat > 0.0 and now - LIVE_SECONDS < beat <= now + 1.0

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
            with contextlib.suppress(BufferError):  # a view still lives; the mapping goes with it
                m.close()
