"""KeyIndex: fixed-size byte keys -> slot ids, an open-addressing hash table over numpy arrays.

A pure data structure: no locks, no I/O. Not safe for concurrent use.

Why not a dict of bytes -> int: a large Lookup spent most of its time in dict probes
(each a chain of cache misses: table, entry, key object) and in splitting the packed keys
into bytes objects, and a page cost about as much index as this one's
(docs/perf/store-0e63aae249.json: 172 bytes a page). Here the keys stay packed and a lookup is about 20 numpy calls over the batch,
and about 20 more when some keys lie past their home bucket.

Why so few calls: a numpy call costs several times more with the caches cold, as they
are when a request arrives, than warm; a lookup of the previous design, with more than
twice the calls (a 14-step hash, a tag compare, then a second round), spent far longer in
`find`. So:
- the hash is four calls per key word (multiplicative hashing: the home bucket is the
  top bits of a product), seeded at random per index so that keys cannot be chosen to
  collide;
- each bucket is one record, padded to 16 or 32 bytes when it fits: numpy's `take` has
  a fast path for those item sizes (a gather of 32-byte rows beat one of 24-byte rows
  from the same table);
- a lookup gathers every key's home record in one `take` and compares the key words
  there: at a load of 1/2 or less most keys sit in their home bucket;
- each bucket keeps a reach: how far past it the entries whose home it is may lie (an
  upper bound, raised by inserts, reset by a rehash). Only keys not at home whose home
  has a reach go on, in one gather of the buckets their homes' reaches cover, laid end
  to end (up to _FEW_FAR of them, each probed alone in Python ints instead: the
  gather's calls cost more). No lookup walks past tombstones to an empty bucket.

Why linear probing: a probe past the home bucket reads the next record, usually on the
line just read, and the table stays one array. The load stays at or below 1/2,
tombstones included.

One record per bucket, one row of a (buckets, row words) uint64 array:

    ┌──────── key, zero-padded to whole 8-byte words ────────┬──────── meta ─────────┬─────┐
    │ word 0 │ word 1 │ ...                                   │ ref:32 │ 0:24 │ reach:8│ pad │
    └────────┴────────┴───────────────────────────────────────┴────────┴──────┴────────┴─────┘

    ref: 0 = empty, 1 = tombstone (a removed entry), slot + 2 = live.
    reach: of this bucket as a home (kept when the entry here is removed); 0..255.
    pad: zero words up to 2 or 4 words a row (none past 4: no fast path to gain).

Over 400 lines because find and insert are each written twice over the same records, a
batch form in numpy calls and a few-key form in Python ints (FEW_KEYS says why), and the
two must agree on the hash, the record and the reach word for word: in two modules, a
change to the record would have to be made in both.
"""

from __future__ import annotations

import itertools
import secrets
import sys
from collections.abc import Callable, Iterator

import numpy as np

__all__ = ["FEW_KEYS", "FEW_READS", "MAX_SLOT", "KeyIndex"]

MAX_SLOT = (1 << 31) - 1      # slot ids fit the 32-bit ref with room for the two codes
_LIVE = 2                     # ref of a live entry: slot + _LIVE
_SHIFT = np.uint64(32)        # ref = meta >> 32
_REACH = np.uint64(0xFF)
_MAX_REACH = 255              # a longer run grows the table (never seen at a load of 1/2)
_TOMB_META = np.uint64(1 << 32)
_LIVE_META = np.uint64(_LIVE << 32)  # a meta at least this is a live entry
_LIVE_INT = _LIVE << 32
_AHEAD = np.arange(8)          # buckets an insert reads per round
_STEPS = np.arange(1, 1 << 14)  # 1, 2, ...: offsets past the homes in one probe
_REACH_BYTE = 0 if sys.byteorder == "little" else 7   # the reach's byte in a meta word
# Up to this many keys, find and insert walk Python ints, key by key (_find_rows,
# _insert_few). Why: the batch forms cost dozens of numpy calls whatever the count, and
# an engine's remote calls name a layer's or a block's few pages. A find hashes in Python
# and gathers the home records in one `take`, no dearer than the batch up to FEW_KEYS and
# cheaper on a loaded machine, where the batch's many calls find the caches cold
# (`kvstore-bench store --calls` compares them). An insert walks key by key as far: the
# batch insert's calls cost more than the walk at every count up to it (that bench's
# "reserve 16 + commit").
FEW_KEYS = 16
# A Get or a lookup of up to this many keys is found as a list too (find_few,
# find_leading; store/few_reads.py, store/lookups.py): an engine names the same block of
# pages once a layer and the same prompt once a scheduler step, so their slots are
# remembered (_FOUND) and found again with no hashing at all. Past FEW_KEYS a miss is
# hashed in numpy's batch form, whose cost grows far slower with the keys than the walk's
# (in one process, an index of 4,096 keys, six seeds: 14-20 us at 32 keys and 21-31 at
# 128, where the Python walk took 19-21 and 75-81). A remembered answer holds at most
# this many keys: _FOUND stays a few MiB.
FEW_READS = 128

# The slots of a few 16-byte keys all found, by (the index's generation, the packed keys):
# an engine asks the same prefix again at every scheduler step (a waiting request's
# lookup, its per-layer gets), and hashing its keys in Python ints was about half of a
# 16-key lookup (`kvstore-bench store --calls`: lookup 16 36 -> 15 µs). Only a removal
# can make an entry wrong (an insert takes absent keys only, a rehash keeps every slot),
# and every removal gives its index a new generation, never reused, so its entries are
# never read again; a partial answer is not kept (an insert could complete it). One table
# for every index, bounded (cleared when full): 4,096 layouts each with its own would
# hold far more memory than the hashing costs.
_FOUND: dict[tuple[int, bytes], list[int]] = {}
_FOUND_MAX = 1024
_GENERATIONS = itertools.count()
_FEW = FEW_KEYS
# A batch find's keys not in their home bucket are probed one by one in Python ints
# (_probe_one) up to this many, past it in one gather (_probe). Why: _probe's dozen numpy
# calls cost about 15 us however few keys they probe, a key probed alone about 1 (in one
# process: 3 keys 4.9 us against 15.2, 12 keys 13.2 against 15.6, 32 keys 32 against
# 16.5), and a find of 17 to 128 keys mostly has a few such keys: over six seeds its
# median went from 30-31 us to 17-23, a find of 512 keys unchanged at 37.
_FEW_FAR = 8
# An insert walks its keys in Python ints (_insert_few) up to this many: the batch form's
# checks and placing cost about 90 us whatever the count, the walk about 2 us a key (in
# one process: 17 keys 92 us by the batch and 38 walked, 32 keys 104 and 67, 64 keys 116
# and 127). A Put of 17 to 48 pages (a request's save) commits so.
_FEW_INSERT = 48

# Odd 64-bit constants (from MurmurHash3's fmix64): multiplying by one is a bijection.
_K1 = np.uint64(0xFF51AFD7ED558CCD)
_K2 = np.uint64(0xC4CEB9FE1A85EC53)
_K1_INT, _K2_INT = int(_K1), int(_K2)          # the same, for _find_one's Python ints
_MASK = (1 << 64) - 1


def _hash(words: np.ndarray, seed: np.uint64) -> np.ndarray:
    """64-bit hashes of keys given as (n, words) uint64; homes are their top bits.

    Per word: xor it in, fold the high half down, multiply. Bit i of a product depends on
    bits 0..i of what was multiplied, so the top bits depend on all of it, and the fold
    lets a word's high bits reach the low ones before the multiply. Without the fold, a
    counter in a key's last bytes (a word's high bits) took 0.43 of 2**16 buckets for
    2**16 keys where a random function takes 0.63; with it 0.57-0.69 for every key
    shape in tests/unit/test_index.py."""
    h = words[:, 0] ^ seed
    h ^= h >> _SHIFT
    h *= _K1
    for j in range(1, words.shape[1]):
        h ^= words[:, j]
        h ^= h >> _SHIFT
        h *= _K2
    return h


class KeyIndex:
    """Fixed-size byte keys -> non-negative int slot ids. Not safe for concurrent use.

    key_size: bytes per key, 1..64, fixed for the index. capacity: entries expected;
    the table grows past it (doubling) and never shrinks below it. Slot ids are small
    dense integers (at most MAX_SLOT): the reverse map is an array indexed by slot id.
    seed: of the hash; random unless given (tests give one to repeat a layout).
    """

    def __init__(self, key_size: int, capacity: int = 1024, seed: int | None = None) -> None:
        if not 1 <= key_size <= 64:
            raise ValueError(f"key_size must be 1..64, not {key_size}")
        self.key_size = key_size
        self._nw = -(-key_size // 8)                   # key words per record
        self._rw = _pow2(self._nw + 1) if self._nw < 4 else self._nw + 1   # row words
        self._seed = np.uint64(secrets.randbits(64) if seed is None else seed)
        self._seed_int = int(self._seed)
        self._min_buckets = _pow2(2 * max(capacity, 8))
        self._new_table(self._min_buckets)
        self._pos = np.full(max(capacity, 8), -1, dtype=np.int64)  # slot -> bucket, -1 none
        self._live = 0                                 # live entries
        # Told of every key that comes or goes, as (words, +1 or -1): the presence map
        # (kvstore_server.store.presence). None: nobody is told.
        self.watch: Callable[[np.ndarray | list[list[int]], int], None] | None = None
        self._gen = next(_GENERATIONS)                 # _FOUND's key: see find_few

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
        if len(words) <= FEW_KEYS:
            return np.array(self._find_rows(words.tolist()), dtype=np.int64)
        return self._find(words, self._home(_hash(words, self._seed)))

    # A lookup counts a prefix's leading keys, and a prompt asked for the first time mostly
    # has only its head stored: the keys past its first absent one need no probe past
    # their home bucket, which in find() costs the most of the batch (_FEW_FAR).
    def find_run(self, keys) -> np.ndarray:
        """The slots of the keys' leading run: find() up to the first absent key, left
        out with every key after it. keys: as find() takes them."""
        words = self._words(keys)
        if len(words) <= FEW_KEYS:
            found = self._find_rows(words.tolist())
            return np.array(found[:found.index(-1)] if -1 in found else found,
                            dtype=np.int64)
        home = self._home(_hash(words, self._seed))
        slot, ok, reach = self._at_home(words, home)
        away = (~ok).nonzero()[0]
        if not away.size:
            return slot
        # The first key away from home whose home has no reach is absent: the run ends
        # there at the latest, and only the keys away before it are probed.
        absent = away[reach[away] == 0]
        end = int(absent[0]) if absent.size else len(words)
        far = away[away < end]
        if far.size > _FEW_FAR:
            slot[far] = -1
            self._probe(slot, far, words[far], home[far], reach[far])
            missed = (slot[:end] < 0).nonzero()[0]
            return slot[:int(missed[0]) if missed.size else end]
        for i, past in self._probed(far, words, home, reach):
            if past < 0:
                return slot[:i]
            slot[i] = past
        return slot[:end]

    def find_few(self, data: bytes) -> list[int]:
        """find() of a few keys (a Get's or a lookup's, up to FEW_READS) given packed
        (n * key_size bytes), as a list: up to FEW_KEYS with no numpy call on the way in
        (_find_rows), and 16-byte keys all found are remembered (_FOUND)."""
        if self.key_size == 16 and data:
            if len(data) == 16:                 # one row read costs less than a take
                return [self.find_one(data)]
            if len(data) % 16:
                raise ValueError(f"{len(data)} bytes is not a whole number of 16-byte keys")
            if type(data) is bytes:
                hit = _FOUND.get((self._gen, data))
                if hit is not None:
                    return list(hit)
                found = self._find_packed(data)
                if -1 not in found and len(data) <= 16 * FEW_READS:
                    self._remember(data, found)
                return found
            return self._find_packed(data)
        if len(data) > FEW_KEYS * self.key_size:
            return self.find(data).tolist()
        return self._find_rows(self._word_rows(data))

    def _find_packed(self, data: bytes) -> list[int]:
        """find() of packed 16-byte keys as a list: walked in Python ints up to FEW_KEYS
        (_find_pairs), in numpy's batch form past it (FEW_READS says why)."""
        if len(data) <= 16 * FEW_KEYS:
            return self._find_pairs(memoryview(data).cast("Q").tolist())
        return self.find(data).tolist()

    def find_leading(self, data: bytes) -> list[int]:
        """The slots of a few packed keys' leading run, up to the first absent key: the
        first found alone (one absent costs no more hashing), the rest by find_few. A
        run of 16-byte keys found whole is remembered whole (_FOUND), so asked again it
        costs no hashing at all, the first key's neither."""
        size = self.key_size
        whole = size == 16 and type(data) is bytes and size < len(data) <= 16 * FEW_READS
        if whole:
            hit = _FOUND.get((self._gen, data))
            if hit is not None:
                return list(hit)
        first = self.find_one(data[:size])
        if first < 0:
            return []
        slots = [first]
        if len(data) > (FEW_KEYS + 1) * size:
            slots += self.find_run(data[size:]).tolist()
            if whole and len(slots) * size == len(data):
                self._remember(data, slots)
        elif len(data) > size:
            slots += self.find_few(data[size:])
            if -1 in slots:
                del slots[slots.index(-1):]
            elif whole:
                self._remember(data, slots)
        return slots

    def _remember(self, data: bytes, found: list[int]) -> None:
        """Keep a few keys' slots, every one found just now (_FOUND); the caller keeps
        its own list, a copy is kept."""
        if len(_FOUND) >= _FOUND_MAX:
            _FOUND.clear()
        _FOUND[self._gen, data] = list(found)

    # 16-byte keys (two words: the clients' own key size) are hashed straight from the
    # flat list of words, two at a time: the generic loop's per-key list, its slice and
    # inner loop cost about a third of the hash (kvstore-bench store --calls).
    def _find_pairs(self, words: list[int]) -> list[int]:
        """_find_rows of 16-byte keys given as their words end to end."""
        seed, bits, table = self._seed_int, self._bits_int, self._table
        homes = []
        pairs = iter(words)
        for first, second in zip(pairs, pairs, strict=True):
            h = first ^ seed
            h = (((h ^ (h >> 32)) * _K1_INT) & _MASK) ^ second
            homes.append((((h ^ (h >> 32)) * _K2_INT) & _MASK) >> bits)
        out = []
        pairs = iter(words)
        records = table.take(homes, axis=0).tolist()
        for record, first, second in zip(records, pairs, pairs, strict=True):
            if record[0] == first and record[1] == second and record[2] >= _LIVE_INT:
                out.append((record[2] >> 32) - _LIVE)
            elif record[2] & 0xFF:
                home = homes[len(out)]
                out.append(self._probe_one([first, second], home, record[2] & 0xFF))
            else:
                out.append(-1)
        return out

    def _find_rows(self, rows: list[list[int]]) -> list[int]:
        """The slot of each key given as its words, -1 where absent: hashed in Python
        ints, their home records gathered with one `take` (one numpy call however many
        keys: a row read a key cost more than the hash), then compared and probed as
        _find_one does."""
        if not rows:
            return []
        if len(rows) == 1:
            return [self._find_one(rows[0])]
        nw = self._nw
        table = self._table
        # _hash_one inlined: a call a key cost as much as its arithmetic.
        seed, bits = self._seed_int, self._bits_int
        homes = []
        for words in rows:
            h = words[0] ^ seed                         # both below 2**64
            h = ((h ^ (h >> 32)) * _K1_INT) & _MASK
            for word in words[1:]:
                h ^= word
                h = ((h ^ (h >> 32)) * _K2_INT) & _MASK
            homes.append(h >> bits)
        out = []
        for words, home, record in zip(rows, homes, table.take(homes, axis=0).tolist(),
                                       strict=True):
            meta = record[nw]
            if meta >> 32 >= _LIVE and record[:nw] == words:
                out.append((meta >> 32) - _LIVE)
            elif meta & 0xFF:
                out.append(self._probe_one(words, home, meta & 0xFF))
            else:
                out.append(-1)
        return out

    def _word_rows(self, data: bytes) -> list[list[int]]:
        """Packed keys as each key's words, Python ints (ValueError if not whole keys)."""
        ks, nw = self.key_size, self._nw
        if len(data) % ks:
            raise ValueError(f"{len(data)} bytes is not a whole number of {ks}-byte keys")
        if ks % 8 == 0:
            words = memoryview(data).cast("B").cast("Q").tolist()
            return [words[i:i + nw] for i in range(0, len(words), nw)]
        order = sys.byteorder
        out = []
        for at in range(0, len(data), ks):
            padded = bytes(data[at:at + ks]).ljust(8 * nw, b"\0")
            out.append([int.from_bytes(padded[i:i + 8], order) for i in range(0, 8 * nw, 8)])
        return out

    def find_one(self, key: bytes) -> int:
        """One key's slot, -1 if absent, with no numpy call on the way in (see
        _find_one): Store's lookup asks it for a prefix's first key."""
        if len(key) != self.key_size:
            raise ValueError(f"key of {len(key)} bytes, expected {self.key_size}")
        if self.key_size == 16:                 # its two words, read as _find_pairs does
            words = memoryview(key).cast("Q").tolist()
            return self._find_at(words, self._hash_one(words))
        padded = bytes(key).ljust(8 * self._nw, b"\0")
        return self._find_one([int.from_bytes(padded[i:i + 8], sys.byteorder)
                               for i in range(0, len(padded), 8)])

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
        if isinstance(keys, bytes) and len(keys) <= _FEW_INSERT * self.key_size:
            # A few keys packed (a commit's): their words read from the bytes, no numpy.
            few_rows = self._word_rows(keys)
            slot_list = (slots.tolist() if isinstance(slots, np.ndarray)
                         else [int(slot) for slot in slots])
            if len(slot_list) != len(few_rows):
                raise ValueError(f"{len(few_rows)} keys but {len(slot_list)} slots")
            if few_rows:
                self._insert_few(few_rows, slot_list)
            return
        words = self._words(keys)
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        if len(slots) != len(words):
            raise ValueError(f"{len(words)} keys but {len(slots)} slots")
        if not len(words):
            return
        if len(words) <= _FEW_INSERT:
            self._insert_few(words.tolist(), slots.tolist())
            return
        ordered = np.sort(slots)
        if ordered[0] < 0 or ordered[-1] > MAX_SLOT:
            raise ValueError(f"slot ids must be in 0..{MAX_SLOT}")
        if (ordered[1:] == ordered[:-1]).any():
            raise ValueError("repeated slot id in one insert")
        if (self._pos[slots[slots < len(self._pos)]] >= 0).any():
            raise ValueError("slot id already holds a key")
        h = _hash(words, self._seed)
        hashes = np.sort(h)                      # distinct hashes prove distinct keys
        same = np.isin(h, hashes[1:][hashes[1:] == hashes[:-1]])
        if len({key.tobytes() for key in words[same]}) < np.count_nonzero(same):
            raise ValueError("repeated key in one insert")
        if (self._find(words, self._home(h)) >= 0).any():
            raise ValueError("key already present")

        if 2 * (self._live + self._tombs + len(words)) > len(self._table):
            self._rehash(max(len(self._table), self._fit(len(words))))
        if ordered[-1] >= len(self._pos):
            more = max(ordered[-1] + 1 - len(self._pos), len(self._pos))
            self._pos = np.pad(self._pos, (0, more), constant_values=-1)
        rows = np.zeros((len(words), self._rw), dtype=np.uint64)
        rows[:, : self._nw] = words
        rows[:, self._nw] = (slots + _LIVE).astype(np.uint64) << _SHIFT
        self._live += len(words)
        self._place(rows, h)
        if self.watch is not None:
            self.watch(words, 1)

    def _insert_few(self, rows: list[list[int]], slots: list[int]) -> None:
        """insert() of a few keys (_FEW_INSERT), each its words in Python ints: the same checks,
        then each record into the first free bucket from its home, as _place does."""
        if len(rows) == 1:
            self._insert_one(rows[0], slots[0])
            return
        if min(slots) < 0 or max(slots) > MAX_SLOT:
            raise ValueError(f"slot ids must be in 0..{MAX_SLOT}")
        if len(set(slots)) < len(slots):
            raise ValueError("repeated slot id in one insert")
        pos = self._pos
        inside = [slot for slot in slots if slot < len(pos)]
        if inside and max(pos.take(inside).tolist()) >= 0:     # one read, not one a slot
            raise ValueError("slot id already holds a key")
        if len(set(map(tuple, rows))) < len(rows):
            raise ValueError("repeated key in one insert")
        homes = [self._hash_one(row) for row in rows]     # hashed once, found and placed
        bits = self._bits_int
        if self._any_present(rows, homes):
            raise ValueError("key already present")

        if 2 * (self._live + self._tombs + len(rows)) > len(self._table):
            self._rehash(max(len(self._table), self._fit(len(rows))))
        top = max(slots)
        if top >= len(self._pos):
            more = max(top + 1 - len(self._pos), len(self._pos))
            self._pos = np.pad(self._pos, (0, more), constant_values=-1)
        self._live += len(rows)
        for row, slot, home in zip(rows, slots, homes, strict=True):
            if self._bits_int != bits:      # the table grew: every home moved
                home = self._hash_one(row)
            self._place_one(row, slot, home)
        if self.watch is not None:
            self.watch(rows, 1)

    def _insert_one(self, row: list[int], slot: int) -> None:
        """_insert_few of one key (a one-page put's commit): the same checks, with no
        set or list made for them."""
        if not 0 <= slot <= MAX_SLOT:
            raise ValueError(f"slot ids must be in 0..{MAX_SLOT}")
        if slot < len(self._pos) and self._pos[slot] >= 0:
            raise ValueError("slot id already holds a key")
        home = self._hash_one(row)
        if self._find_at(row, home) >= 0:
            raise ValueError("key already present")
        if 2 * (self._live + self._tombs + 1) > len(self._table):
            self._rehash(max(len(self._table), self._fit(1)))
            home = self._hash_one(row)
        if slot >= len(self._pos):
            self._pos = np.pad(self._pos, (0, max(slot + 1 - len(self._pos), len(self._pos))),
                               constant_values=-1)
        self._live += 1
        self._place_one(row, slot, home)
        if self.watch is not None:
            self.watch([row], 1)

    def _any_present(self, rows: list[list[int]], homes: list[int]) -> bool:
        """Whether some key (its words, its home) is in the table: their home records
        read in one `take`, probed past home only where the home has a reach."""
        nw = self._nw
        for row, home, record in zip(rows, homes, self._table.take(homes, axis=0).tolist(),
                                     strict=True):
            meta = record[nw]
            if meta >> 32 >= _LIVE and record[:nw] == row:
                return True
            if meta & 0xFF and self._probe_one(row, home, meta & 0xFF) >= 0:
                return True
        return False

    def _place_one(self, row: list[int], slot: int, home: int) -> None:
        """One record into the first free bucket from its home (an empty one or a
        tombstone: the bucket keeps its reach), its home's reach raised to cover it."""
        table = self._table
        nw, mask = self._nw, len(table) - 1
        at = home
        while True:
            meta = int(table[at, nw])
            if meta >> 32 < _LIVE:
                break
            at = (at + 1) & mask
        if meta >> 32 == 1:                      # a tombstone
            self._tombs -= 1
        if nw <= 2:                              # scalar stores: a slice store costs more
            for j, word in enumerate(row):
                table[at, j] = word
        else:
            table[at, :nw] = row
        table[at, nw] = ((slot + _LIVE) << 32) | (meta & 0xFF)
        self._pos[slot] = at
        far = (at - home) & mask
        if far > _MAX_REACH:                     # as _place: never seen at a load of 1/2
            self._rehash(2 * len(table))
            return
        home_meta = int(table[home, nw])
        if far > home_meta & 0xFF:
            table[home, nw] = (home_meta & ~0xFF) | far

    def remove_slots(self, slots) -> None:
        """Remove the entries held by slots (a slot repeated is removed once); KeyError
        if one holds none, and then nothing is removed."""
        self._gen = next(_GENERATIONS)             # what _FOUND holds of it is stale
        if isinstance(slots, list) and len(slots) <= _FEW:
            self._remove_few(list(dict.fromkeys(slots)))
            return
        slots = np.unique(np.asarray(slots, dtype=np.int64))
        buckets = self._buckets_of(slots)
        if self.watch is not None:
            self.watch(self._table[buckets, : self._nw], -1)
        metas = self._table[:, self._nw]
        metas[buckets] = (metas[buckets] & _REACH) | _TOMB_META
        self._pos[slots] = -1
        self._live -= len(slots)
        self._tombs += len(slots)
        if self._tombs > len(self._table) // 4:    # rehash (maybe smaller) to clear them
            self._rehash(self._fit(0))

    def _remove_few(self, slots: list[int]) -> None:
        """remove_slots() of a few distinct slots, by scalar reads and stores: its
        vector form is about 15 numpy calls whatever the count."""
        pos, table, nw = self._pos, self._table, self._nw
        buckets = []
        for slot in slots:
            bucket = int(pos[slot]) if 0 <= slot < len(pos) else -1
            if bucket < 0:
                raise KeyError(f"slot {slot} holds no key")
            buckets.append(bucket)
        if not buckets:
            return
        if self.watch is not None:          # the words as lists (presence.Watch)
            self.watch([table[bucket, :nw].tolist() for bucket in buckets], -1)
        for bucket, slot in zip(buckets, slots, strict=True):
            table[bucket, nw] = (int(table[bucket, nw]) & 0xFF) | (1 << 32)
            pos[slot] = -1
        self._live -= len(slots)
        self._tombs += len(slots)
        if self._tombs > len(table) // 4:          # as remove_slots
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

    def _home(self, h: np.ndarray) -> np.ndarray:
        """The home buckets of hashes h: their top bits, as int64."""
        return (h >> self._bits).view(np.int64)

    def _find(self, words: np.ndarray, home: np.ndarray) -> np.ndarray:
        slot, ok, reach = self._at_home(words, home)
        elsewhere = ~ok
        np.putmask(slot, elsewhere, -1)
        far = (elsewhere & (reach != 0)).nonzero()[0]    # not flatnonzero: fewer calls
        if far.size > _FEW_FAR:
            self._probe(slot, far, words[far], home[far], reach[far])
        elif far.size:
            for i, found in self._probed(far, words, home, reach):
                slot[i] = found
        return slot

    def _at_home(self, words: np.ndarray, home: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What each key's home bucket holds, in one gather: (the slot there, -2 empty
        and -1 a tombstone; whether it is the key's; the home's reach)."""
        nw = self._nw
        rows = self._table.take(home, axis=0)
        slot = (rows[:, nw] >> _SHIFT).view(np.int64)
        slot -= _LIVE
        ok = slot >= 0
        for j in range(nw):
            ok &= rows[:, j] == words[:, j]
        return slot, ok, rows.view(np.uint8)[:, 8 * nw + _REACH_BYTE]

    def _probed(self, far: np.ndarray, words: np.ndarray, home: np.ndarray,
                reach: np.ndarray) -> Iterator[tuple[int, int]]:
        """(index, slot or -1) of each key far[i] past its home, in order, probed one by
        one in Python ints (_FEW_FAR says when)."""
        for i, key, at, most in zip(far.tolist(), words[far].tolist(), home[far].tolist(),
                                    reach[far].tolist(), strict=True):
            yield i, self._probe_one(key, at, most)

    def _hash_one(self, words: list[int]) -> int:
        """One key's home bucket: _hash and _home in Python ints."""
        h = (words[0] ^ self._seed_int) & _MASK
        h = ((h ^ (h >> 32)) * _K1_INT) & _MASK
        for word in words[1:]:
            h ^= word
            h = ((h ^ (h >> 32)) * _K2_INT) & _MASK
        return h >> self._bits_int

    def _find_one(self, words: list[int]) -> int:
        """One key's slot, -1 if absent: the same hash and probe as _find, in Python
        ints. Why: a same-host acquire or a one-page get names one key, and _find's ~20
        numpy calls on arrays of one cost several times this."""
        return self._find_at(words, self._hash_one(words))

    def _find_at(self, words: list[int], home: int) -> int:
        """_find_one of a key whose home bucket is known."""
        nw = self._nw
        table = self._table
        row = table[home].tolist()
        meta = row[nw]
        if meta >> 32 >= _LIVE and row[:nw] == words:
            return (meta >> 32) - _LIVE
        return self._probe_one(words, home, meta & 0xFF) if meta & 0xFF else -1

    def _probe_one(self, words: list[int], home: int, reach: int) -> int:
        """One key's slot among the `reach` buckets past its home, -1 if none holds it:
        read as one slice (a row read each cost more than the compares)."""
        nw, table = self._nw, self._table
        mask = len(table) - 1
        first = home + 1
        if first + reach <= len(table):
            records = table[first:first + reach].tolist()
        else:                                           # wraps round the table's end
            records = table.take([(first + i) & mask for i in range(reach)], axis=0).tolist()
        for record in records:
            if record[nw] >> 32 >= _LIVE and record[:nw] == words:
                return (record[nw] >> 32) - _LIVE
        return -1

    def _probe(self, slot: np.ndarray, far: np.ndarray, words: np.ndarray,
               home: np.ndarray, reach: np.ndarray) -> None:
        """Set slot[far[i]] for the keys (words, home, reach) found past their home
        bucket (the rest stay -1): one gather of the buckets home + 1 .. home + reach
        of every key, laid end to end. Written for few numpy calls (see above)."""
        nw = self._nw
        ends = np.cumsum(reach, dtype=np.int64)
        idx = np.repeat(home + reach - ends, reach)
        idx += _STEPS[: ends[-1]] if ends[-1] <= len(_STEPS) else np.arange(1, ends[-1] + 1)
        idx &= len(self._table) - 1
        rows = self._table.take(idx, axis=0)
        found = (rows[:, nw] >> _SHIFT).view(np.int64)
        ok = found >= _LIVE
        words = np.repeat(words, reach, axis=0)          # each key beside its buckets
        for j in range(nw):
            ok &= rows[:, j] == words[:, j]
        hit = ok.nonzero()[0]                            # a key is live in one bucket at most
        slot[far[np.searchsorted(ends, hit, side="right")]] = found[hit] - _LIVE

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
        home = self._home(h)
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
        reach = metas[homes] & _REACH
        np.maximum.at(reach, inverse, far[far > 0].astype(np.uint64))
        metas[homes] = (metas[homes] & ~_REACH) | reach

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
        self._table = np.zeros((buckets, self._rw), dtype=np.uint64)
        self._bits = np.uint64(64 - (buckets.bit_length() - 1))   # h >> this = home
        self._bits_int = int(self._bits)
        self._tombs = 0                                # tombstones count toward load

    def _rehash(self, buckets: int) -> None:
        old = self._table
        rows = old[old[:, self._nw] >= _LIVE_META]
        rows[:, self._nw] &= ~_REACH
        self._new_table(buckets)
        self._place(rows, _hash(rows[:, : self._nw], self._seed), fresh=True)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 1).bit_length()
