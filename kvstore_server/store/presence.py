"""The presence map: counters in the shared region of which keys DRAM holds, so that a client
on this host answers a miss without a round trip (kvstore_client.presence says why;
kvstore_protocol.presence_map holds the layout and the bucket formula both ends share).

The store's KeyIndex tells every key that becomes READY or leaves (KeyIndex.watch); this
module turns those batches into buckets and counts them, under the store's lock (the
only writer). Clients read it without a lock: a byte is read whole, and a count read
just before a commit lands is the miss the client would have seen a moment earlier.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from kvstore_protocol.presence_map import (
    AREA_BYTES,
    BEAT_AT,
    BITS,
    HEADER,
    HEADER_AT,
    MAGIC,
    MIX,
    salt,
)

__all__ = ["AREA_BYTES", "Presence"]

_MIX = np.uint64(MIX)
_SHIFT = np.uint64(64 - BITS)
_STUCK = 255                         # a counter that reached it is never lowered again
_SHIFT_INT, _MASK = 64 - BITS, (1 << 64) - 1
# Up to this many keys a batch is counted in Python ints: the batch form's ~12 numpy calls
# (np.unique among them) cost more than a few keys' arithmetic in Python.
_FEW = 8

# watch(words, delta): a batch of keys as (n, words) uint64, each zero-padded, or a few
# keys' words as lists of Python ints (KeyIndex's few-key inserts: an array made for
# one key only to be read back as a list cost a one-page put ~1 us); +1 or -1.
Watch = Callable[[np.ndarray | list[list[int]], int], None]


class Presence:
    """The map in `area` (AREA_BYTES of the region) described in the region's `header`
    (its first bytes); off (heartbeat 0) until start()."""

    def __init__(self, header: np.ndarray, area: np.ndarray, area_offset: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if area.size != AREA_BYTES:
            raise ValueError(f"the presence area must be {AREA_BYTES} bytes, not {area.size}")
        self._header = header
        self._counts = area
        self._offset = area_offset
        self._clock = clock          # CLOCK_MONOTONIC: the clock clients compare with
        # The heartbeat as one aligned float64: written by one store, never read torn.
        self._beat = header[BEAT_AT:BEAT_AT + 8].view(np.float64)

    def watch(self, layout_id: bytes) -> Watch:
        """The KeyIndex watch of one layout's keys (layout_id: the id clients send)."""
        layout_salt = np.uint64(salt(layout_id))
        layout_int = int(layout_salt)

        def counted(words: np.ndarray | list[list[int]], delta: int) -> None:
            if isinstance(words, list):
                self._count_few(layout_int, words, delta)
                return
            if not len(words):
                return
            if len(words) <= _FEW:
                self._count_few(layout_int, words.tolist(), delta)
                return
            acc = np.full(len(words), layout_salt, dtype=np.uint64)
            for j in range(words.shape[1]):
                acc = (acc ^ words[:, j]) * _MIX          # wraps mod 2**64, as the client's
            self._count(acc >> _SHIFT, delta)
        return counted

    def _count(self, buckets: np.ndarray, delta: int) -> None:
        at, times = np.unique(buckets.astype(np.int64), return_counts=True)
        old = self._counts[at].astype(np.int64)
        new = np.clip(old + delta * times, 0, _STUCK)
        new[old == _STUCK] = _STUCK
        self._counts[at] = new.astype(np.uint8)

    def _count_few(self, layout_salt: int, rows: list[list[int]], delta: int) -> None:
        """counted() of a few keys in Python ints: the same buckets and counts."""
        counts = self._counts
        for row in rows:
            acc = layout_salt
            for word in row:
                acc = ((acc ^ word) * MIX) & _MASK
            at = acc >> _SHIFT_INT
            old = int(counts[at])
            if old != _STUCK:
                counts[at] = min(max(old + delta, 0), _STUCK)

    def start(self) -> None:
        """Describe the map in the header and beat: clients may use it from now on (the
        magic last, so a client that sees it reads the rest whole)."""
        self.beat()
        packed = HEADER.pack(MAGIC, self._offset, BITS, 0, 0.0)
        self._header[HEADER_AT + 8:BEAT_AT] = np.frombuffer(packed[8:BEAT_AT - HEADER_AT],
                                                            np.uint8)
        self._header[HEADER_AT:HEADER_AT + 8] = np.frombuffer(MAGIC, np.uint8)

    def beat(self) -> None:
        """Every BEAT_SECONDS: clients trust the map only while this is recent."""
        self._beat[0] = self._clock()

    def stop(self) -> None:
        """Clients stop trusting the map at once (a graceful stop; a killed server's map
        goes stale by itself)."""
        self._beat[0] = 0.0
