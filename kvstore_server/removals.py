"""The removal ring: pages that left this server, in order, for engines' KV-event streams.

A KV-aware router (llm-d's indexer, Dynamo's router) learns from each engine's event
stream which prefixes the store holds; the connector announces what it saved, and learns
what left from here. An entry is (seq, layout id, key, cause), written where a page
leaves the last of this server's tiers that held it:

    DRAM eviction with no tier below, or the tier below refused the page ──► EVICTED
    the disk tier evicts it for room with no tier below it, drops it unwritten
        (a write error), or an admin evicts bytes from it               ──► EVICTED
    Delete                                                               ──► DELETED
    Clear, an admin eviction of a whole layout from the tiers below     ──► DELETED / EVICTED
    Invalidate                                                           ──► INVALIDATED

    the far tier drops a page only it holds for this server: its --far-ttl
        expiry, the cluster's maxmemory eviction, a write that failed, another
        server's delete (far/watch.py: a check within far.watch.DELAY s)  ──► EVICTED

"The store holds a page" means a lookup by this server would hit it, in any tier: DRAM,
disk or the far tier. So a page that moves down (DRAM -> disk -> far) is not removed:
this server still answers for it; it is removed when the last tier that held it for
this server lets it go, the far tier included. A whole layout's removal is one entry
with an empty key ("every page of this layout"), so an invalidation of a million pages
takes one slot, not the ring. The rule where unsure: report. A removal reported for a
page still held makes a router under-estimate (a cheap miss of its score); one not
reported makes it send requests for a prefix that is gone. Hence a DRAM or disk
eviction that the far tier does not take is reported even where the cluster may hold a
copy of the page that another server wrote (--far-write off): asking the cluster would
put a round trip on the eviction's path.

Readers poll with a cursor (after_seq) and the ring's epoch (a random id per server
start). The ring is bounded (`capacity` entries, ~70 bytes each); when it has overwritten
entries a cursor had not read, or the cursor is of another epoch (a restart), the read
says `gap`: the reader must assume every page of its layouts may be gone.

Concurrency: one lock of its own, taken inside the store's (eviction records under it);
readers take only this one, and a read scans at most `capacity` entries.
"""

from __future__ import annotations

import dataclasses
import enum
import secrets
import threading
from collections.abc import Sequence

import numpy as np

from kvstore_protocol.keys import MAX_KEY_BYTES

__all__ = ["DEFAULT_CAPACITY", "MAX_READ", "Cause", "RemovalRead", "RemovalRing"]

# 131,072 entries of ~70 bytes: 9 MiB. At 0.5 s polls it holds the removals of a server
# evicting 260k pages a second between two polls.
DEFAULT_CAPACITY = 1 << 17
# Entries one read returns at most: a reader with more to read asks again at once.
MAX_READ = 16384
# Ring positions one read scans at a time (one numpy pass each).
_SCAN = 1 << 16
# Up to this many keys a record writes entry by entry: the batch form's half-dozen numpy
# calls (frombuffer, arange, four fancy stores) cost ~5 us whatever the count, an entry
# by scalar stores ~1 us (in process: 1.8 us for one key against 5.2, even at 4 keys,
# 8.4 against 5.7 at 8).
_FEW = 4


class Cause(enum.IntEnum):
    """Why a page left (the wire value of RemovalsResponse.causes)."""

    EVICTED = 1
    DELETED = 2
    INVALIDATED = 3


@dataclasses.dataclass(frozen=True, slots=True)
class RemovalRead:
    """One read: the entries of the asked layouts after the cursor, columnar.
    layout_pos[i] indexes the layout ids asked; key_sizes[i] == 0: the whole layout."""

    epoch: int
    next_seq: int           # the cursor for the next read
    gap: bool               # entries may be lost since the cursor: assume all removed
    more: bool              # stopped at the limit: read again at once
    seqs: np.ndarray        # uint64
    layout_pos: np.ndarray  # uint32
    causes: bytes           # one Cause a byte
    key_sizes: bytes        # one size a byte; 0 = every page of the layout
    keys: bytes             # the keys, concatenated

    def __len__(self) -> int:
        return len(self.seqs)


class RemovalRing:
    """The last `capacity` removals of this server, each with its sequence number."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("the removal ring needs at least one entry")
        self.capacity = capacity
        self.epoch = secrets.randbits(63) | 1       # never 0: 0 asks "from now"
        self._lock = threading.Lock()               # guards everything below
        self._head = 0                              # seq of the last entry (0: none yet)
        self._layout = np.zeros(capacity, dtype=np.int32)    # index into _ids
        self._cause = np.zeros(capacity, dtype=np.uint8)
        self._size = np.zeros(capacity, dtype=np.uint8)
        self._keys = np.zeros((capacity, MAX_KEY_BYTES), dtype=np.uint8)
        self._ids: list[bytes] = []                 # layout ids seen, by index
        self._idx: dict[bytes, int] = {}

    @property
    def head(self) -> int:
        """The seq of the newest entry (0 before the first)."""
        return self._head

    def _layout_idx(self, layout_id: bytes) -> int:
        idx = self._idx.get(layout_id)
        if idx is None:
            idx = self._idx[layout_id] = len(self._ids)
            self._ids.append(layout_id)
        return idx

    def record(self, layout_id: bytes, keys: np.ndarray | Sequence[bytes],
               cause: Cause) -> None:
        """Pages of one layout that left: keys as bytes, or rows of one key size."""
        if isinstance(keys, np.ndarray):
            rows = keys.reshape(len(keys), -1) if keys.size else keys.reshape(0, 1)
        else:
            if not keys:
                return
            if len(keys) <= _FEW:
                self._record_few(layout_id, keys, cause)
                return
            size = len(keys[0])
            if all(len(k) == size for k in keys):
                rows = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), size)
            else:
                for key in keys:
                    self.record(layout_id, [key], cause)
                return
        n, size = rows.shape
        if not n:
            return
        with self._lock:
            if n > self.capacity:           # only the last lap survives
                self._head += n - self.capacity
                rows, n = rows[-self.capacity:], self.capacity
            pos = (self._head + np.arange(n)) % self.capacity   # seq s lies at (s-1) % cap
            self._layout[pos] = self._layout_idx(layout_id)
            self._cause[pos] = int(cause)
            self._size[pos] = size
            self._keys[pos, :size] = rows
            self._head += n

    def _record_few(self, layout_id: bytes, keys: Sequence[bytes], cause: Cause) -> None:
        """record() of a few keys (a one-key delete): an entry at a time, scalar stores."""
        code = int(cause)
        with self._lock:
            idx = self._layout_idx(layout_id)
            cap = self.capacity
            for key in keys:
                pos = self._head % cap           # seq head + 1 lies at head % cap
                self._layout[pos] = idx
                self._cause[pos] = code
                self._size[pos] = len(key)
                self._keys[pos, :len(key)] = np.frombuffer(key, dtype=np.uint8)
                self._head += 1

    def record_layout(self, layout_id: bytes, cause: Cause) -> None:
        """Every page of a layout left (an invalidation, a clear)."""
        with self._lock:
            pos = self._head % self.capacity     # seq head + 1
            self._layout[pos] = self._layout_idx(layout_id)
            self._cause[pos] = int(cause)
            self._size[pos] = 0
            self._head += 1

    def read(self, layout_ids: Sequence[bytes], after_seq: int, epoch: int,
             limit: int = MAX_READ) -> RemovalRead:
        """Entries of these layouts with seq > after_seq, at most limit (capped at
        MAX_READ). epoch 0: no entries, a cursor at the newest entry (start from now)."""
        limit = max(1, min(limit, MAX_READ))
        with self._lock:
            head = self._head
            if epoch == 0:
                return _empty(self.epoch, head, gap=False)
            oldest = max(1, head - self.capacity + 1)
            gap = epoch != self.epoch or after_seq > head or after_seq + 1 < oldest
            start = oldest if gap else after_seq + 1
            wanted = np.array([self._idx[i] for i in layout_ids if i in self._idx],
                              dtype=np.int32)
            order = {self._idx[i]: n for n, i in reversed(list(enumerate(layout_ids)))
                     if i in self._idx}
            taken: list[np.ndarray] = []
            got = 0
            seq = start
            more = False
            while seq <= head and wanted.size:
                end = min(head, seq + _SCAN - 1)
                seqs = np.arange(seq, end + 1, dtype=np.int64)
                hit = seqs[np.isin(self._layout[(seqs - 1) % self.capacity], wanted)]
                if got + len(hit) >= limit:
                    hit = hit[:limit - got]
                    taken.append(hit)
                    got = limit
                    seq = int(hit[-1]) + 1
                    more = seq <= head
                    break
                taken.append(hit)
                got += len(hit)
                seq = end + 1
            next_seq = seq - 1 if wanted.size else head
            if not got:
                return _empty(self.epoch, next_seq, gap)
            seqs = np.concatenate(taken)
            pos = (seqs - 1) % self.capacity
            sizes = self._size[pos]
            keys = b"".join(self._keys[p, :s].tobytes() for p, s in zip(pos.tolist(),
                                                                      sizes.tolist(),
                                                                      strict=True))
            lay = np.array([order[i] for i in self._layout[pos].tolist()], dtype=np.uint32)
            return RemovalRead(self.epoch, next_seq, gap, more, seqs.astype(np.uint64), lay,
                               self._cause[pos].tobytes(), sizes.tobytes(), keys)


def _empty(epoch: int, next_seq: int, gap: bool) -> RemovalRead:
    return RemovalRead(epoch, next_seq, gap, False, np.empty(0, np.uint64),
                       np.empty(0, np.uint32), b"", b"", b"")
