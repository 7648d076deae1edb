"""KeyIndex: fixed-size byte keys -> slot ids, an open-addressing hash table over numpy arrays.

A pure data structure: no locks, no I/O. Not safe for concurrent use.

Why not a dict of bytes -> int: a Lookup of 4,096 keys against 1M stored pages spent
~0.7 ms in dict probes (each a cache miss on a scattered PyObject) and ~0.15 ms splitting
the packed keys into bytes objects, and every page cost ~190 bytes of index. Here the keys
stay packed, a Lookup is a few numpy calls over the whole batch, and an entry costs its
key rounded up to 8 bytes, plus 8, per bucket, plus 8 bytes per slot id (the reverse map).

Why open addressing with linear probing: a probe that misses its home bucket reads the
next record, which is usually on the same cache line, and a table is one array that numpy
can gather from. The load is kept at or below 1/2, tombstones included, so a hit reads
1.5 buckets on average and a miss 2.5; long runs are rare but exist, so probing goes in
vectorised rounds: each round reads one window of buckets for every key still pending,
and the windows widen as the pending set shrinks, so the tail costs a few rounds, not
one per bucket.

One record per bucket, one row of a (buckets, words + 1) uint64 array:

    ┌─────────────── key, zero-padded to 8-byte words ───────────────┬──── meta ────┐
    │ word 0 │ word 1 │ ...                                           │ ref  │ hash  │
    └────────┴────────┴───────────────────────────────────────────────┴──────┴───────┘
                                                      ref = meta >> 32, hash = low 32 bits

    ref: 0 = empty, 1 = tombstone (a removed entry; probes go on past it), slot + 2 = live.
    hash: the low 32 bits of the key's 64-bit hash; its low bits pick the home bucket, and a
    rehash reads it instead of hashing every key again.

A whole record is read with one gather (`take` of rows), and the key is compared word by
word, which is ~4x faster in numpy than an equality of `V{n}` void views.
"""

from __future__ import annotations

import numpy as np

__all__ = ["KeyIndex"]

_EMPTY, _TOMB = 0, 1          # ref values below _LIVE; a live ref is slot + _LIVE
_LIVE = 2
_LOW32 = np.uint64(0xFFFFFFFF)
_SHIFT = np.uint64(32)
MAX_SLOT = (1 << 31) - 1      # slot ids must fit a 32-bit ref with room for the two codes

# A 64-bit mix over the key's words: per word, xor it in, multiply, fold the high half
# down (a bijection of the state for each word, so keys differing in one word never
# collide); then MurmurHash3's fmix64, so structured keys ("good-key00000001") spread.
_SEED = np.uint64(0x9E3779B97F4A7C15)
_K1 = np.uint64(0xFF51AFD7ED558CCD)
_K2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)


def _hash(words: np.ndarray) -> np.ndarray:
    h = np.full(len(words), _SEED, dtype=np.uint64)
    for j in range(words.shape[1]):
        h ^= words[:, j]
        h *= _K1
        h ^= h >> _SHIFT
    h ^= h >> _S33
    h *= _K2
    h ^= h >> _S33
    return h


class KeyIndex:
    """Fixed-size byte keys -> non-negative int slot ids. Not safe for concurrent use.

    key_size: bytes per key, 1..64, fixed for the index. capacity: entries expected;
    the table grows (doubling) past it and never shrinks below it. Slot ids are small
    dense integers below 2**31: the reverse map is an array indexed by slot id.
    """

    def __init__(self, key_size: int, capacity: int = 1024) -> None:
        if not 1 <= key_size <= 64:
            raise ValueError(f"key_size must be 1..64, not {key_size}")
        self.key_size = key_size
        self._nw = -(-key_size // 8)                   # key words per record
        self._min_buckets = _pow2(2 * max(capacity, 8))
        self._table = np.zeros((self._min_buckets, self._nw + 1), dtype=np.uint64)
        self._pos = np.full(max(capacity, 8), -1, dtype=np.int64)  # slot -> bucket, -1 none
        self._live = 0                                 # live entries
        self._tombs = 0                                # tombstones, which count toward load

    def __len__(self) -> int:
        return self._live

    @property
    def nbytes(self) -> int:
        """Bytes held by the table and the reverse map."""
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
        return self.keys_of(np.array([slot], dtype=np.int64))[0].tobytes()

    def keys_of(self, slots) -> np.ndarray:
        """The keys held by slots, (n, key_size) uint8; KeyError if one holds none."""
        pos = self._positions(slots)
        rows = self._table.take(pos, axis=0)[:, : self._nw]
        return rows.view(np.uint8)[:, : self.key_size]

    # -- updates --------------------------------------------------------------------
    def insert(self, keys, slots) -> None:
        """Map keys[i] -> slots[i]. Keys must be absent and distinct, slots unused and
        distinct (ValueError otherwise, and nothing is inserted)."""
        words = self._words(keys)
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        if len(slots) != len(words):
            raise ValueError(f"{len(words)} keys but {len(slots)} slots")
        if not len(words):
            return
        if slots.min() < 0 or slots.max() > MAX_SLOT:
            raise ValueError(f"slot ids must be in 0..{MAX_SLOT}")
        sorted_slots = np.sort(slots)
        if (sorted_slots[1:] == sorted_slots[:-1]).any():
            raise ValueError("repeated slot id in one insert")
        known = slots[slots < len(self._pos)]
        if (self._pos[known] >= 0).any():
            raise ValueError("slot id already holds a key")
        h = _hash(words)
        _check_distinct(words, h)
        if (self._find(words, h) >= 0).any():
            raise ValueError("key already present")
        self._reserve(len(words))
        if slots.max() >= len(self._pos):
            grown = np.full(max(slots.max() + 1, 2 * len(self._pos)), -1, dtype=np.int64)
            grown[: len(self._pos)] = self._pos
            self._pos = grown
        rows = np.empty((len(words), self._nw + 1), dtype=np.uint64)
        rows[:, : self._nw] = words
        rows[:, self._nw] = ((slots + _LIVE).astype(np.uint64) << _SHIFT) | (h & _LOW32)
        self._pos[slots] = self._place(rows)
        self._live += len(words)

    def remove_slots(self, slots) -> None:
        """Remove the entries held by slots (a slot repeated is removed once); KeyError
        if one holds none, and then nothing is removed."""
        slots = np.unique(np.asarray(slots, dtype=np.int64))
        pos = self._positions(slots)
        self._table[pos, self._nw] = np.uint64(_TOMB << 32)
        self._pos[slots] = -1
        self._live -= len(slots)
        self._tombs += len(slots)
        if self._tombs > len(self._table) // 4:    # misses probe past tombstones: clear them
            self._rehash(self._fit(0))

    def remove(self, keys) -> np.ndarray:
        """Remove keys; returns the slots they held, -1 where absent."""
        slots = self.find(keys)
        self.remove_slots(slots[slots >= 0])
        return slots

    # -- internals ------------------------------------------------------------------
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
        if self.key_size % 8 == 0 and keys.flags.c_contiguous and keys.ctypes.data % 8 == 0:
            return keys.view(np.uint64)
        words = np.zeros((len(keys), 8 * self._nw), dtype=np.uint8)
        words[:, : self.key_size] = keys
        return words.view(np.uint64)

    def _find(self, words: np.ndarray, h: np.ndarray) -> np.ndarray:
        """Round one reads every key's home bucket, which holds most keys; later rounds
        read a window of buckets for each key still pending, 8 then 64 wide."""
        mask = len(self._table) - 1
        home = (h & np.uint64(mask)).view(np.int64)
        ref, hit = self._match(home, [words[:, j] for j in range(self._nw)])
        out = np.where(hit, ref.view(np.int64) - _LIVE, -1)
        todo = np.flatnonzero(~hit & (ref != _EMPTY))
        start, width = home[todo] + 1, 8
        while todo.size:
            ref, hit = self._match((start[:, None] + np.arange(width)) & mask,
                                   [words[todo, j, None] for j in range(self._nw)])
            # A key is never stored past an empty bucket on its probe path, so a hit
            # anywhere in the window is the key, and an empty bucket ends the search.
            got = (ref * hit).max(axis=1).view(np.int64)
            out[todo] = np.where(got > 0, got - _LIVE, -1)
            going = (got == 0) & (ref != _EMPTY).all(axis=1)
            todo, start, width = todo[going], start[going] + width, 64
        return out

    def _match(self, buckets: np.ndarray, key_words: list[np.ndarray]):
        """The refs at buckets, and where they hold the key (its words broadcast
        against buckets)."""
        flat, nw = self._table.reshape(-1), self._nw
        base = buckets * (nw + 1)
        ref = flat.take(base + nw) >> _SHIFT
        hit = ref >= _LIVE
        for j, col in enumerate(key_words):
            hit &= flat.take(base + j if j else base) == col
        return ref, hit

    def _place(self, rows: np.ndarray) -> np.ndarray:
        """Write records into free buckets by linear probing, all keys at once; the keys
        that want one bucket in a round are settled by np.unique: the first one wins and
        the others probe on. Returns the bucket of each record."""
        table, nw, mask = self._table, self._nw, len(self._table) - 1
        out = np.empty(len(rows), dtype=np.int64)
        todo = np.arange(len(rows))
        pos = (rows[:, nw] & np.uint64(mask)).astype(np.int64)
        while todo.size:
            ref = table[pos, nw] >> _SHIFT
            free = np.flatnonzero(ref <= _TOMB)
            _, first = np.unique(pos[free], return_index=True)
            win = free[first]
            self._tombs -= int(np.count_nonzero(ref[win] == _TOMB))
            table[pos[win]] = rows[todo[win]]
            out[todo[win]] = pos[win]
            going = np.ones(len(todo), dtype=bool)
            going[win] = False
            todo, pos = todo[going], (pos[going] + 1) & mask
        return out

    def _positions(self, slots) -> np.ndarray:
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

    def _reserve(self, n: int) -> None:
        if 2 * (self._live + self._tombs + n) > len(self._table):
            self._rehash(max(len(self._table), self._fit(n)))

    def _rehash(self, buckets: int) -> None:
        old = self._table
        rows = old[(old[:, self._nw] >> _SHIFT) >= _LIVE]
        self._table = np.zeros((buckets, self._nw + 1), dtype=np.uint64)
        self._tombs = 0
        self._pos[((rows[:, self._nw] >> _SHIFT) - _LIVE).astype(np.int64)] = self._place(rows)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 1).bit_length()


def _check_distinct(words: np.ndarray, h: np.ndarray) -> None:
    """ValueError if two keys are equal. Distinct hashes prove it; the rare equal hashes
    are compared as bytes."""
    s = np.sort(h)
    same = s[1:][s[1:] == s[:-1]]
    if same.size:
        group = words[np.isin(h, same)]
        if len({row.tobytes() for row in group}) < len(group):
            raise ValueError("repeated key in one insert")
