"""KeyIndex: fixed-size byte keys -> slot ids, an open-addressing hash table over numpy arrays.

A pure data structure: no locks, no I/O. Not safe for concurrent use.

Why not a dict of bytes -> int: a Lookup of 4,096 keys against 1M stored pages spent
~0.7 ms in dict probes (each a chain of cache misses: table, entry, key object) and
~0.15 ms splitting the packed keys into bytes objects, and a page cost ~190 bytes of
index. Here the keys stay packed and a Lookup is ~60 numpy calls over the whole batch;
an entry costs two buckets of (key rounded up to 8 bytes) + 8, and 8 bytes of reverse
map. bench/index_bench.py, 1M 16-byte keys, on the GPU host's CPU: a Lookup of 4,096
present keys 0.27 ms (dict in the same run: 0.45 ms of probes, 1.13 ms with the split),
of absent keys 0.14 ms; 61 bytes per entry (dict: 123, not counting the server's own).

Why open addressing with linear probing: the table is one array that numpy gathers from
in one call, and a probe past the home bucket reads the next record, usually on the line
just read. The load stays at or below 1/2, tombstones included: ~77% of keys then sit in
their home bucket, 98% within four buckets of it.

Why two vectorised rounds, and a reach per bucket: a numpy call costs 2-5 us whatever its
size (more with cold caches, as between requests), so a Lookup costs its number of calls.
Rounds that widened until no key was pending took three rounds of ~20 calls more often
than not, and misses walked on to an empty bucket. So each bucket keeps a reach: how far
past it the entries whose home it is may lie (an upper bound, raised by inserts, reset by
a rehash). Round one reads every key's home bucket; a key neither there nor with a reach
to look further is absent. Round two reads, for the keys left, exactly the buckets their
reach covers, end to end in one gather. Rounds compare a 24-bit tag; the key is compared
once, where its tag matched. A tag that matches another key (one compare in 2**23) sends
that key to a scan of its window. No lookup walks past tombstones to an empty bucket.

One record per bucket, one row of a (buckets, words + 1) uint64 array:

    ┌───────── key, zero-padded to whole 8-byte words ─────────┬────────── meta ──────────┐
    │ word 0 │ word 1 │ ...                                     │ ref:32 │ reach:8 │ tag:24 │
    └────────┴────────┴─────────────────────────────────────────┴────────┴─────────┴────────┘

    ref: 0 = empty, 1 = tombstone (a removed entry), slot + 2 = live.
    reach: of this bucket as a home (kept when the entry here is removed); 0..255.
    tag: bits 40..63 of the key's 64-bit hash, made odd so that it never matches an empty
    bucket or a tombstone (tag 0). The low bits of the hash pick the home bucket.
"""

from __future__ import annotations

import sys

import numpy as np

__all__ = ["MAX_SLOT", "KeyIndex"]

MAX_SLOT = (1 << 31) - 1      # slot ids fit the 32-bit ref with room for the two codes
_LIVE = 2                     # ref of a live entry: slot + _LIVE
_SHIFT = np.uint64(32)        # ref = meta >> 32
_TAG = np.uint32(0xFFFFFF)    # tag bits, and the largest low half with a reach of 0
_REACH = np.uint64(0xFF << 24)
_MAX_REACH = 255              # a longer run grows the table (never seen at a load of 1/2)
_TOMB_META = np.uint64(1 << 32)
_LIVE_META = np.uint64(_LIVE << 32)  # a meta at least this is a live entry
_AHEAD = np.arange(8)          # buckets an insert reads per round
_LO = 0 if sys.byteorder == "little" else 1   # the low half of a uint64 viewed as 2 uint32

# A 64-bit mix over the key's words: per word, xor it in, multiply, fold the high half
# down (a bijection of the state for each word, so keys that differ in one word never
# collide), then finish like MurmurHash3's fmix64. Structured keys ("good-key00000001",
# a big-endian counter at the end) fill buckets and tags as random keys do.
_SEED = np.uint64(0x9E3779B97F4A7C15)
_K1 = np.uint64(0xFF51AFD7ED558CCD)
_K2 = np.uint64(0xC4CEB9FE1A85EC53)


def _hash(words: np.ndarray) -> np.ndarray:
    h = words[:, 0] ^ _SEED
    for j in range(words.shape[1]):
        if j:
            h ^= words[:, j]
        h *= _K1
        h ^= h >> _SHIFT
    h *= _K2                  # two more multiplies and folds, as in fmix64, so a few
    h ^= h >> np.uint64(29)   # differing high bits (a counter in a key's last bytes)
    h *= _K1                  # reach the bucket bits and the tag
    h ^= h >> _SHIFT
    return h


def _tags(h: np.ndarray) -> np.ndarray:
    """The tags of hashes h, as uint64."""
    return (h >> np.uint64(40)) | np.uint64(1)


def _low(meta: np.ndarray) -> np.ndarray:
    """The low halves (reach and tag) of meta words, as uint32 (a view)."""
    return meta.view(np.uint32)[..., _LO::2]


class KeyIndex:
    """Fixed-size byte keys -> non-negative int slot ids. Not safe for concurrent use.

    key_size: bytes per key, 1..64, fixed for the index. capacity: entries expected;
    the table grows past it (doubling) and never shrinks below it. Slot ids are small
    dense integers (at most MAX_SLOT): the reverse map is an array indexed by slot id.
    """

    def __init__(self, key_size: int, capacity: int = 1024) -> None:
        if not 1 <= key_size <= 64:
            raise ValueError(f"key_size must be 1..64, not {key_size}")
        self.key_size = key_size
        self._nw = -(-key_size // 8)                   # key words per record
        self._min_buckets = _pow2(2 * max(capacity, 8))
        self._new_table(self._min_buckets)
        self._pos = np.full(max(capacity, 8), -1, dtype=np.int64)  # slot -> bucket, -1 none
        self._live = 0                                 # live entries

    def __len__(self) -> int:
        return self._live

    @property
    def nbytes(self) -> int:
        """Bytes held: the table and the reverse map."""
        return self._table.nbytes + self._pos.nbytes

    # -- lookups --------------------------------------------------------------------
    def find(self, keys) -> np.ndarray:
        """The slot of each key, -1 where absent. keys: (n, key_size) uint8, or bytes."""
        words = self._words(keys)
        return self._find(words, _hash(words))

    def leading(self, keys) -> int:
        """How many leading keys are present (stops at the first absent one)."""
        absent = self.find(keys) < 0
        return int(absent.argmax()) if absent.any() else len(absent)

    def key_of(self, slot: int) -> bytes:
        """The key held by slot; KeyError if it holds none."""
        return self.keys_of([slot])[0].tobytes()

    def keys_of(self, slots) -> np.ndarray:
        """The keys held by slots, (n, key_size) uint8; KeyError if one holds none."""
        rows = self._table[self._buckets_of(slots), : self._nw]
        return rows.view(np.uint8)[:, : self.key_size]

    # -- updates --------------------------------------------------------------------
    def insert(self, keys, slots) -> None:
        """Map keys[i] -> slots[i]. Keys must be absent and distinct, slots unused and
        distinct: ValueError otherwise, and then nothing is inserted."""
        words = self._words(keys)
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        if len(slots) != len(words):
            raise ValueError(f"{len(words)} keys but {len(slots)} slots")
        if not len(words):
            return
        ordered = np.sort(slots)
        if ordered[0] < 0 or ordered[-1] > MAX_SLOT:
            raise ValueError(f"slot ids must be in 0..{MAX_SLOT}")
        if (ordered[1:] == ordered[:-1]).any():
            raise ValueError("repeated slot id in one insert")
        if (self._pos[slots[slots < len(self._pos)]] >= 0).any():
            raise ValueError("slot id already holds a key")
        h = _hash(words)
        hashes = np.sort(h)                      # distinct hashes prove distinct keys
        same = np.isin(h, hashes[1:][hashes[1:] == hashes[:-1]])
        if len({key.tobytes() for key in words[same]}) < np.count_nonzero(same):
            raise ValueError("repeated key in one insert")
        if (self._find(words, h) >= 0).any():
            raise ValueError("key already present")

        if 2 * (self._live + self._tombs + len(words)) > len(self._table):
            self._rehash(max(len(self._table), self._fit(len(words))))
        if ordered[-1] >= len(self._pos):
            more = max(ordered[-1] + 1 - len(self._pos), len(self._pos))
            self._pos = np.pad(self._pos, (0, more), constant_values=-1)
        rows = np.empty((len(words), self._nw + 1), dtype=np.uint64)
        rows[:, : self._nw] = words
        rows[:, self._nw] = ((slots + _LIVE).astype(np.uint64) << _SHIFT) | _tags(h)
        self._live += len(words)
        self._place(rows, h)

    def remove_slots(self, slots) -> None:
        """Remove the entries held by slots (a slot repeated is removed once); KeyError
        if one holds none, and then nothing is removed."""
        slots = np.unique(np.asarray(slots, dtype=np.int64))
        buckets = self._buckets_of(slots)
        metas = self._table[:, self._nw]
        metas[buckets] = (metas[buckets] & _REACH) | _TOMB_META
        self._pos[slots] = -1
        self._live -= len(slots)
        self._tombs += len(slots)
        if self._tombs > len(self._table) // 4:    # rehash (maybe smaller) to clear them
            self._rehash(self._fit(0))

    def remove(self, keys) -> np.ndarray:
        """Remove keys; returns the slots they held, -1 where absent."""
        slots = self.find(keys)
        self.remove_slots(slots[slots >= 0])
        return slots

    # -- lookup internals -----------------------------------------------------------
    def _words(self, keys) -> np.ndarray:
        """keys as an (n, words) uint64 array, each key zero-padded to whole words."""
        if isinstance(keys, (bytes, bytearray, memoryview)):
            keys = np.frombuffer(keys, dtype=np.uint8)
            if len(keys) % self.key_size:
                raise ValueError(f"{len(keys)} bytes is not a whole number of "
                                 f"{self.key_size}-byte keys")
            keys = keys.reshape(-1, self.key_size)
        keys = np.asarray(keys)
        if keys.dtype != np.uint8 or keys.ndim != 2 or keys.shape[1] != self.key_size:
            raise ValueError(f"keys must be (n, {self.key_size}) uint8, not "
                             f"{keys.shape} {keys.dtype}")
        if self.key_size % 8 == 0 and keys.flags.c_contiguous:
            return keys.view(np.uint64)
        words = np.zeros((len(keys), 8 * self._nw), dtype=np.uint8)
        words[:, : self.key_size] = keys
        return words.view(np.uint64)

    def _find(self, words: np.ndarray, h: np.ndarray) -> np.ndarray:
        table, mask = self._table, len(self._table) - 1
        metas = table[:, self._nw]   # a strided view: fancy indexing reads it in place
        home = (h & np.uint64(mask)).view(np.int64)
        tag = _low(_tags(h))
        # Round one: each key's home bucket. `bucket` is where its tag matched, or -1.
        meta = metas[home]
        low = _low(meta)
        match = (low & _TAG) == tag
        bucket = np.where(match, home, -1)
        pending = np.flatnonzero(~match & (low > _TAG))        # a reach to look further
        if pending.size:
            # Round two: the buckets home + 1 .. home + reach of every pending key, laid
            # end to end; owner says whose each is.
            length = low[pending] >> np.uint32(24)
            ends = np.cumsum(length, dtype=np.int64)
            idx = np.repeat(home[pending] + length - ends, length) + np.arange(1, ends[-1] + 1)
            idx &= mask
            owner = np.repeat(pending, length)
            m = metas[idx]
            hits = np.flatnonzero((_low(m) & _TAG) == tag[owner])
            bucket[owner[hits]], meta[owner[hits]] = idx[hits], m[hits]
        # The key itself, compared once where its tag matched.
        found = bucket >= 0
        hit = found.copy()
        for j in range(self._nw):
            hit &= table[:, j][bucket] == words[:, j]
        out = np.where(hit, (meta >> _SHIFT).view(np.int64) - _LIVE, -1)
        for i in np.flatnonzero(found & ~hit):   # the tag matched another key
            out[i] = self._scan(words[i], int(home[i]))
        return out

    def _scan(self, words: np.ndarray, home: int) -> int:
        """The slot of one key, comparing whole records across its window."""
        reach = (int(self._table[home, self._nw]) & int(_REACH)) >> 24
        rows = self._table[(home + np.arange(reach + 1)) & (len(self._table) - 1)]
        hit = (rows[:, : self._nw] == words).all(axis=1) & (rows[:, self._nw] >= _LIVE_META)
        return int(rows[hit.argmax(), self._nw] >> _SHIFT) - _LIVE if hit.any() else -1

    # -- update internals -----------------------------------------------------------
    def _place(self, rows: np.ndarray, h: np.ndarray, fresh: bool = False) -> None:
        """Write records (reach 0) into free buckets by linear probing, raise the reach
        of their homes to cover them, and point the reverse map at them.

        A fresh (empty) table is filled in one pass: sorted by home, each record takes
        max(its home, the bucket after the previous record's). Otherwise, in rounds: each
        pending record reads the 8 buckets from where it stands and claims the first
        free one; records claiming one bucket are settled by np.unique (the first wins)."""
        table, mask = self._table, len(self._table) - 1
        metas = table[:, self._nw]
        home = (h & np.uint64(mask)).view(np.int64)
        where = np.empty(len(rows), dtype=np.int64)
        todo = np.arange(len(rows))
        if fresh:
            order = np.argsort(home, kind="stable")
            at = np.maximum.accumulate(home[order] - todo) + todo
            fits = at <= mask
            table[at[fits]] = rows[order[fits]]
            where[order[fits]] = at[fits]
            todo = order[~fits]                  # past the last bucket: wrap round below
        pos = home[todo]
        while todo.size:
            idx = (pos[:, None] + _AHEAD) & mask
            free = metas[idx] < _LIVE_META
            ok = free.any(axis=1)
            claim = idx[np.arange(len(todo)), free.argmax(axis=1)]
            claimed = np.flatnonzero(ok)
            win = claimed[np.unique(claim[claimed], return_index=True)[1]]
            at, old = claim[win], metas[claim[win]]
            self._tombs -= int(np.count_nonzero((old & ~_REACH) == _TOMB_META))
            table[at] = rows[todo[win]]
            metas[at] |= old & _REACH            # a bucket keeps its reach
            where[todo[win]] = at
            going = np.ones(len(todo), dtype=bool)
            going[win] = False
            todo, pos = todo[going], np.where(ok, claim, pos + len(_AHEAD))[going]
        self._pos[(rows[:, self._nw] >> _SHIFT).view(np.int64) - _LIVE] = where

        far = (where - home) & mask
        if far.max(initial=0) > _MAX_REACH:
            self._rehash(2 * len(table))
            return
        homes, inverse = np.unique(home[far > 0], return_inverse=True)
        reach = (metas[homes] & _REACH) >> np.uint64(24)
        np.maximum.at(reach, inverse, far[far > 0].astype(np.uint64))
        metas[homes] = (metas[homes] & ~_REACH) | (reach << np.uint64(24))

    def _buckets_of(self, slots) -> np.ndarray:
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        inside = (slots >= 0) & (slots < len(self._pos))
        pos = np.where(inside, self._pos[np.where(inside, slots, 0)], -1)
        if (pos < 0).any():
            raise KeyError(f"slot {int(slots[pos.argmin()])} holds no key")
        return pos

    def _fit(self, extra: int) -> int:
        """Buckets for live + extra entries at a load of at most 3/8 (room to insert
        another 1/8 before the next rehash), never below the initial capacity."""
        return max(self._min_buckets, _pow2(-(-8 * (self._live + extra) // 3)))

    def _new_table(self, buckets: int) -> None:
        self._table = np.zeros((buckets, self._nw + 1), dtype=np.uint64)
        self._tombs = 0                                # tombstones count toward load

    def _rehash(self, buckets: int) -> None:
        old = self._table
        rows = old[old[:, self._nw] >= _LIVE_META]
        rows[:, self._nw] &= ~_REACH
        self._new_table(buckets)
        self._place(rows, _hash(rows[:, : self._nw]), fresh=True)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 1).bit_length()

