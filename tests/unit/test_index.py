import numpy as np
import pytest

from kvstore_server.store import index as index_module
from kvstore_server.store.index import MAX_SLOT, KeyIndex


def packed(keys: list[bytes]) -> bytes:
    return b"".join(keys)


def key_pool(key_size: int, n: int, rng: np.random.Generator) -> list[bytes]:
    """Distinct keys that are hard on a hash: long common prefixes, trailing zero bytes,
    counters, and some random ones."""
    if key_size == 1:
        return [bytes([i]) for i in rng.permutation(256)[:n]]
    pool: set[bytes] = set()
    prefix = b"good-key" * 8
    i = 0
    while len(pool) < n:
        i += 1
        kind = i % 4
        if kind == 0:                                     # common prefix, counter last
            pool.add((prefix + i.to_bytes(8, "big"))[-key_size:])
        elif kind == 1:                                   # counter first, trailing zeros
            pool.add((i.to_bytes(4, "little") + bytes(64))[:key_size])
        elif kind == 2:                                   # one varying byte in zeros
            raw = bytearray(key_size)
            raw[int(rng.integers(key_size))] = int(rng.integers(1, 256))
            pool.add(bytes(raw))
        else:
            pool.add(rng.integers(0, 256, key_size, dtype=np.uint8).tobytes())
    return list(pool)


def check_load(ix: KeyIndex) -> None:
    buckets = len(ix._table)
    assert buckets & (buckets - 1) == 0
    assert 2 * (len(ix) + ix._tombs) <= buckets


@pytest.mark.parametrize("key_size", [1, 5, 16, 64])
def test_differential_against_dict(key_size):
    rng = np.random.default_rng(key_size)
    pool = key_pool(key_size, 200 if key_size == 1 else 3000, rng)
    ix, model = KeyIndex(key_size, capacity=8), {}
    free = list(range(len(pool)))[::-1]                   # slots, reused last-in first-out
    for _ in range(120):
        absent = [k for k in pool if k not in model]
        if absent and free:
            n = int(rng.integers(0, min(len(absent), len(free), 300) + 1))
            new = [absent[i] for i in rng.choice(len(absent), n, replace=False)]
            slots = [free.pop() for _ in new]
            ix.insert(packed(new), slots)
            model.update(zip(new, slots))
        if model and rng.random() < 0.6:                  # evict by slot
            held = list(model.items())
            picks = rng.choice(len(held), int(rng.integers(0, len(held) // 2 + 1)),
                               replace=False)
            gone = [held[i] for i in picks]
            ix.remove_slots([slot for _, slot in gone])
            for key, slot in gone:
                del model[key]
                free.append(slot)
        if rng.random() < 0.3:                            # delete by key, some absent
            keys = [pool[i] for i in rng.choice(len(pool), 20, replace=False)]
            expected = [model.pop(k, -1) for k in keys]
            assert ix.remove(packed(keys)).tolist() == expected
            free.extend(s for s in expected if s >= 0)
        query = [pool[i] for i in rng.choice(len(pool), 400)]
        assert ix.find(packed(query)).tolist() == [model.get(k, -1) for k in query]
        assert len(ix) == len(model)
        check_load(ix)
        for key, slot in list(model.items())[:5]:
            assert ix.key_of(slot) == key
    everything = packed(pool)
    assert ix.find(everything).tolist() == [model.get(k, -1) for k in pool]


def test_find_on_an_empty_index():
    ix = KeyIndex(16)
    assert ix.find(b"").dtype == np.int64 and ix.find(b"").size == 0
    assert ix.find(bytes(32)).tolist() == [-1, -1]
    assert ix.find(np.zeros((0, 16), dtype=np.uint8)).size == 0
    assert ix.leading(bytes(16)) == 0 and len(ix) == 0


def test_keys_as_bytes_or_arrays():
    ix = KeyIndex(16)
    keys = np.arange(16 * 8, dtype=np.uint8).reshape(8, 16)
    ix.insert(keys, np.arange(8))
    assert ix.find(keys.tobytes()).tolist() == list(range(8))
    assert ix.find(bytearray(keys.tobytes())).tolist() == list(range(8))
    assert ix.find(memoryview(keys.tobytes())).tolist() == list(range(8))
    assert ix.find(keys[::2]).tolist() == [0, 2, 4, 6]   # not contiguous
    assert ix.keys_of([3, 1]).tolist() == keys[[3, 1]].tolist()
    with pytest.raises(ValueError):
        ix.find(bytes(17))
    with pytest.raises(ValueError):
        ix.find(np.zeros((2, 15), dtype=np.uint8))
    with pytest.raises(ValueError):
        ix.find(np.zeros((2, 16), dtype=np.int64))
    with pytest.raises(ValueError):
        KeyIndex(65)


def test_insert_errors_leave_the_index_unchanged():
    ix = KeyIndex(4)
    ix.insert(b"aaaabbbb", [0, 1])
    bad = [
        (b"cccccccc", [2, 3]),             # repeated key in one insert
        (b"ccccaaaa", [2, 3]),             # key already present
        (b"ccccdddd", [2, 2]),             # repeated slot
        (b"ccccdddd", [2, 1]),             # slot already holds a key
        (b"cccc", [-1]),
        (b"cccc", [MAX_SLOT + 1]),
        (b"ccccdddd", [2]),                # one slot for two keys
        (b"aaaa", [5]),                    # one key (its own path), already present
        (b"cccc", [1]),                    # one key into a slot that holds one
    ]
    for keys, slots in bad:
        with pytest.raises(ValueError):
            ix.insert(keys, slots)
    assert len(ix) == 2
    assert ix.find(b"aaaabbbbccccdddd").tolist() == [0, 1, -1, -1]


def test_remove_slots_and_key_of():
    ix = KeyIndex(8)
    keys = [b"key%05d" % i for i in range(100)]
    ix.insert(packed(keys), np.arange(100) * 3)
    ix.remove_slots([0, 3, 3, 297])                        # a repeated slot, once
    assert len(ix) == 97
    assert ix.find(packed(keys[:2] + keys[-1:])).tolist() == [-1, -1, -1]
    assert ix.key_of(6) == keys[2]
    for missing in (0, 1, -1, 10**6):
        with pytest.raises(KeyError):
            ix.key_of(missing)
    with pytest.raises(KeyError):
        ix.remove_slots([6, 1])                            # 1 holds no key: nothing goes
    assert ix.key_of(6) == keys[2] and len(ix) == 97
    with pytest.raises(KeyError):
        ix.keys_of([6, 0])


def test_slots_reused_after_removal():
    ix = KeyIndex(16)
    ix.insert(b"first-key-000001", [5])
    ix.remove_slots([5])
    ix.insert(b"other-key-000002", [5])
    assert ix.find(b"first-key-000001other-key-000002").tolist() == [-1, 5]
    assert ix.key_of(5) == b"other-key-000002"
    assert ix.remove(b"other-key-000002").tolist() == [5]
    ix.insert(b"first-key-000001", [5])                    # and the key itself comes back
    assert ix.key_of(5) == b"first-key-000001"


def test_leading_stops_at_the_first_hole():
    ix = KeyIndex(2)
    ix.insert(b"aabbdd", [0, 1, 2])
    assert ix.leading(b"aabbccdd") == 2
    assert ix.leading(b"aabbdd") == 3
    assert ix.leading(b"ccaabb") == 0
    assert ix.leading(b"") == 0


def test_growth_tombstones_and_shrink():
    ix = KeyIndex(16, capacity=16)
    keys = np.random.default_rng(0).integers(0, 256, (20_000, 16), dtype=np.uint8)
    for lo in range(0, len(keys), 1000):
        ix.insert(keys[lo:lo + 1000], np.arange(lo, lo + 1000))
        check_load(ix)
    big = ix.nbytes
    ix.remove_slots(np.arange(19_900))                     # tombstones, then a rehash
    check_load(ix)
    assert ix.nbytes < big and len(ix) == 100
    assert (ix.find(keys[:19_900]) == -1).all()
    assert ix.find(keys[19_900:]).tolist() == list(range(19_900, 20_000))


def few_hashes(monkeypatch) -> tuple[KeyIndex, list[bytes]]:
    """An index of 8-byte keys whose hashes take one of 16 homes, holding keys[:300] of
    the 500 returned (slot i for keys[i]): almost every key lies past its home."""
    monkeypatch.setattr(index_module, "_hash",
                        lambda words, seed: (words[:, 0] >> np.uint64(56)) << np.uint64(60))
    # The walk's own hash (a few keys' insert and find) the same, so both forms agree.
    monkeypatch.setattr(KeyIndex, "_hash_one",
                        lambda self, words: (((words[0] >> 56) << 60) & index_module._MASK)
                        >> self._bits_int)
    ix = KeyIndex(8, capacity=8)
    keys = [b"k%07d" % i for i in range(500)]
    ix.insert(packed(keys[:300]), np.arange(300))
    return ix, keys


def test_keys_that_share_a_few_hashes_are_found_exactly(monkeypatch):
    # Every key hashes to one of 16 homes: almost every key lies past its home, among
    # tombstones of removed keys, so lookups go through the window the reach covers.
    ix, keys = few_hashes(monkeypatch)
    ix.remove_slots(np.arange(0, 300, 7))
    ix.insert(packed(keys[0:300:14]), np.arange(300, 300 + len(keys[0:300:14])))
    expected = [-1 if i >= 300 or i % 7 == 0 else i for i in range(500)]
    for n, i in enumerate(range(0, 300, 14)):
        expected[i] = 300 + n
    assert ix.find(packed(keys)).tolist() == expected


def test_a_run_past_the_reach_limit_grows_the_table(monkeypatch):
    monkeypatch.setattr(index_module, "_MAX_REACH", 1)
    ix = KeyIndex(16, capacity=64)
    keys = np.random.default_rng(1).integers(0, 256, (100, 16), dtype=np.uint8)
    ix.insert(keys, np.arange(100))
    assert len(ix._table) > 256
    assert ix.find(keys).tolist() == list(range(100))


def test_hash_spreads_structured_keys():
    n = 1 << 16
    for keys in (b"".join(b"good-key%08d" % i for i in range(n)),
                 b"".join(bytes(14) + i.to_bytes(2, "big") for i in range(n)),
                 b"".join(i.to_bytes(2, "little") + bytes(14) for i in range(n))):
        words = np.frombuffer(keys, dtype=np.uint64).reshape(n, 2)
        for seed in (0, 12345):
            h = index_module._hash(words, np.uint64(seed))
            # Homes are the top bits. n keys into n buckets: a random function takes
            # 1 - 1/e = 0.63 of them (a hash without the fold took 0.43); into 16n, the keys
            # land in 0.97n distinct buckets.
            for bits, least in ((16, 0.55), (20, 0.95)):
                taken = len(np.unique(h >> np.uint64(64 - bits))) / min(n, 1 << bits)
                assert taken > least


def test_a_lookup_whose_probe_spans_more_buckets_than_the_step_table():
    # 300k keys: tens of thousands lie past their homes, so one probe gathers more
    # buckets than the precomputed offsets cover and takes the other branch.
    keys = np.random.default_rng(2).integers(0, 256, (300_000, 16), dtype=np.uint8)
    ix = KeyIndex(16, capacity=8)
    ix.insert(keys, np.arange(300_000))
    assert (ix.find(keys) == np.arange(300_000)).all()
    absent = np.random.default_rng(3).integers(0, 256, (1000, 16), dtype=np.uint8)
    assert (ix.find(absent) == -1).all()


@pytest.mark.parametrize("key_size", [5, 16, 64])
def test_a_batchs_keys_past_their_home_are_found_alike_one_by_one_or_gathered(
        key_size, monkeypatch):
    """A batch find probes its keys not at home one by one (_probe_one) up to _FEW_FAR,
    past it in one gather (_probe): batches of 17 to 100 keys, present, removed and never
    stored, answer the model either way, and some of them did probe one by one."""
    rng = np.random.default_rng(40 + key_size)
    pool = key_pool(key_size, 3000, rng)
    ix, model = KeyIndex(key_size, capacity=8), {}
    ix.insert(packed(pool[:2000]), np.arange(2000))
    model.update(zip(pool[:2000], range(2000)))
    gone = np.arange(0, 2000, 5)                          # tombstones among the runs
    ix.remove_slots(gone)
    for slot in gone.tolist():
        del model[pool[slot]]
    probed = []
    one_by_one = KeyIndex._probe_one
    monkeypatch.setattr(KeyIndex, "_probe_one",
                        lambda self, *a: probed.append(1) or one_by_one(self, *a))
    for _ in range(60):
        query = [pool[i] for i in rng.choice(len(pool), int(rng.integers(17, 101)))]
        expected = [model.get(k, -1) for k in query]
        for few in (0, 1 << 20):                          # always gathered, never
            monkeypatch.setattr(index_module, "_FEW_FAR", few)
            assert ix.find(packed(query)).tolist() == expected
    assert probed


@pytest.mark.parametrize("key_size", [5, 16, 64])
def test_a_run_is_found_up_to_its_first_absent_key(key_size, monkeypatch):
    """find_run answers find() cut at its first -1, for runs that end at once, part way
    or never, past keys present, removed (tombstones) and never stored, with the keys
    away from their home probed one by one or gathered."""
    rng = np.random.default_rng(60 + key_size)
    pool = key_pool(key_size, 3000, rng)
    ix = KeyIndex(key_size, capacity=8)
    ix.insert(packed(pool[:2000]), np.arange(2000))
    ix.remove_slots(np.arange(0, 2000, 5))
    stored = [k for i, k in enumerate(pool[:2000]) if i % 5]
    for _ in range(80):
        head = [stored[i] for i in rng.choice(len(stored), int(rng.integers(0, 200)))]
        tail = [pool[i] for i in rng.choice(len(pool), int(rng.integers(0, 200)))]
        query = head + tail
        whole = ix.find(packed(query)).tolist() if query else []
        expected = whole[:whole.index(-1)] if -1 in whole else whole
        for few in (0, 1 << 20):
            monkeypatch.setattr(index_module, "_FEW_FAR", few)
            assert ix.find_run(packed(query)).tolist() == expected


def test_a_run_among_keys_that_share_a_few_hashes(monkeypatch):
    # Nearly every key lies past its home, among tombstones: the run's probes cover
    # reaches of many buckets, one by one and gathered.
    ix, keys = few_hashes(monkeypatch)
    ix.remove_slots(np.arange(150, 300, 7))
    for few in (0, 1 << 20):
        monkeypatch.setattr(index_module, "_FEW_FAR", few)
        assert ix.find_run(packed(keys[:140])).tolist() == list(range(140))
        assert ix.find_run(packed(keys[100:400])).tolist() == list(range(100, 150))
        assert ix.find_run(packed(keys[300:] + keys[:10])).tolist() == []


@pytest.mark.parametrize("key_size", [3, 16, 20, 64])
def test_one_key_finds_what_a_batch_finds(key_size):
    """find() of one key takes a path of its own (Python ints, no numpy batch): it must
    answer what the batch path answers, for keys at home, past it, and absent."""
    rng = np.random.default_rng(key_size)
    index = KeyIndex(key_size, capacity=64, seed=key_size)
    stored = rng.integers(0, 256, (3000, key_size), dtype=np.uint8)
    stored = np.unique(stored, axis=0)
    index.insert(stored, np.arange(len(stored)))
    index.remove_slots(np.arange(0, len(stored), 7))        # tombstones on the way
    absent = rng.integers(0, 256, (500, key_size), dtype=np.uint8)
    everything = np.concatenate([stored, absent])
    batch = index.find(everything)
    assert (batch >= 0).sum() > 1000 and (batch < 0).sum() > 400
    one = [int(index.find(everything[i:i + 1])[0]) for i in range(len(everything))]
    assert one == batch.tolist()
    assert index.find(stored[1].tobytes()).tolist() == [1]
    # find_one takes bytes and makes its words without numpy: the same answers.
    assert [index.find_one(row.tobytes()) for row in everything] == batch.tolist()
    with pytest.raises(ValueError, match="expected"):
        index.find_one(bytes(key_size + 1))


@pytest.mark.parametrize("key_size", [2, 16, 20, 64])
def test_few_keys_take_python_ints_and_agree_with_the_batch(key_size):
    """insert() of up to _FEW_INSERT keys and find() of up to _FEW walk Python ints
    (_insert_few, _find_one): keys put a few at a time, among tombstones, through growth
    and rehashes, must be found as a dict finds them, by both paths."""
    rng = np.random.default_rng(100 + key_size)
    pool = key_pool(key_size, 16000, rng)       # 400 inserts of up to 64 keys
    ix, model = KeyIndex(key_size, capacity=8), {}
    free = list(range(len(pool)))[::-1]
    for step in range(400):
        absent = [k for k in pool if k not in model]
        n = int(rng.integers(1, index_module._FEW_INSERT + 17))   # past it too
        new = [absent[i] for i in rng.choice(len(absent), n, replace=False)]
        slots = [free.pop() for _ in new]
        ix.insert(packed(new), slots)
        model.update(zip(new, slots))
        if step % 3 == 0:                                  # leave tombstones behind
            key, slot = next(iter(model.items()))
            ix.remove_slots([slot])
            del model[key]
            free.append(slot)
        query = [pool[i] for i in rng.choice(len(pool), index_module._FEW)]
        assert ix.find(packed(query)).tolist() == [model.get(k, -1) for k in query]
        check_load(ix)
    assert ix.find(packed(pool)).tolist() == [model.get(k, -1) for k in pool]
    for key, slot in list(model.items())[:50]:
        assert ix.key_of(slot) == key
    with pytest.raises(ValueError, match="already present"):
        ix.insert(packed([next(iter(model))]), [free.pop()])


@pytest.mark.parametrize("key_size", [3, 8, 16, 20, 64])
def test_find_few_reads_packed_bytes_as_find_does(key_size):
    """find_few reads a few keys' words from their packed bytes (no numpy): the same
    answers as a dict, and as find (batch or few) gives, for keys at home, past it
    (round the table's end too) and absent; a ragged length is refused."""
    rng = np.random.default_rng(key_size)
    index = KeyIndex(key_size, capacity=64, seed=key_size)
    stored = np.unique(rng.integers(0, 256, (2000, key_size), dtype=np.uint8), axis=0)
    index.insert(stored, np.arange(len(stored)))
    index.remove_slots(np.arange(0, len(stored), 5))
    absent = rng.integers(0, 256, (200, key_size), dtype=np.uint8)
    everything = np.concatenate([stored, absent])
    model = {row.tobytes(): i for i, row in enumerate(stored) if i % 5}
    # A block of a Get's size too (up to FEW_READS): past FEW_KEYS found by the batch.
    for step in (index_module.FEW_KEYS, index_module.FEW_KEYS + 1, index_module.FEW_READS):
        for lo in range(0, len(everything), step):
            chunk = everything[lo:lo + step]
            expected = [model.get(row.tobytes(), -1) for row in chunk]
            assert index.find_few(chunk.tobytes()) == expected
            assert index.find(chunk).tolist() == expected
    assert index.find(everything).tolist() == [model.get(row.tobytes(), -1)
                                               for row in everything]     # the batch
    with pytest.raises(ValueError, match="whole number"):
        index.find_few(bytes(key_size + 1))


def test_few_keys_found_past_the_tables_end():
    """Keys whose home is the last bucket lie past it, round the table's start: a few
    keys' probe (read as one slice where it can be) wraps as the batch's does."""
    index = KeyIndex(16, capacity=8, seed=7)
    last = len(index._table) - 1
    homed = [key for key in (i.to_bytes(16, "little") for i in range(20000))
             if index._hash_one(list(np.frombuffer(key, dtype=np.uint64).tolist())) == last]
    keys = homed[:3]
    assert len(keys) == 3
    index.insert(packed(keys), [5, 6, 7])          # one at the end, two round the start
    assert index.find_few(packed(keys)) == [5, 6, 7]
    assert index.find_few(packed(keys[1:] + homed[3:4])) == [6, 7, -1]
    assert index.find(packed(keys * 6)).tolist() == [5, 6, 7] * 6      # the batch


def test_few_keys_found_again_are_never_answered_from_before_a_removal():
    """find_few remembers a few 16-byte keys all found (index._FOUND): asked again, the
    same slots; after any removal (by slot, by key, few or many), the keys' new slots or
    -1, never the slots they held before; a partial answer is not remembered, so keys
    inserted since are found; another index with the same keys has its own answers."""
    keys = [i.to_bytes(16, "little") for i in range(100, 116)]
    data = packed(keys)
    index = KeyIndex(16, seed=3)
    index.insert(data, list(range(16)))
    assert index.find_few(data) == list(range(16))
    assert index.find_few(data) == list(range(16))             # remembered
    other = KeyIndex(16, seed=3)
    other.insert(data, list(range(50, 66)))
    assert other.find_few(data) == list(range(50, 66))
    index.remove_slots([3])                                     # few, by slot
    assert index.find_few(data) == [*range(3), -1, *range(4, 16)]
    index.insert(keys[3], [40])                                  # completes the answer
    assert index.find_few(data) == [*range(3), 40, *range(4, 16)]
    index.remove(packed(keys[:1]))                              # by key
    index.insert(keys[0], [41])
    assert index.find_few(data) == [41, 1, 2, 40, *range(4, 16)]
    index.remove_slots(np.arange(4, 16))                        # many, by slot
    index.insert(packed(keys[4:]), list(range(70, 82)))
    assert index.find_few(data) == [41, 1, 2, 40, *range(70, 82)]
    assert other.find_few(data) == list(range(50, 66))


def test_a_gets_block_found_again_is_never_answered_from_before_a_removal():
    """A block of up to FEW_READS 16-byte keys, all found, is remembered as a few keys
    are: found again, and after a removal of one of them never its old slot; a longer
    one is not remembered, so _FOUND holds at most FEW_READS keys an entry."""
    n = index_module.FEW_READS
    keys = [i.to_bytes(16, "little") for i in range(1000, 1000 + n + 1)]
    data = packed(keys[:n])
    index = KeyIndex(16, seed=5)
    index.insert(packed(keys), list(range(n + 1)))
    assert index.find_few(data) == list(range(n))
    assert (index._gen, data) in index_module._FOUND
    assert index.find_few(data) == list(range(n))                 # remembered
    index.remove_slots([n // 2])
    assert index.find_few(data) == [*range(n // 2), -1, *range(n // 2 + 1, n)]
    index.insert(keys[n // 2], [5000])
    assert index.find_few(data) == [*range(n // 2), 5000, *range(n // 2 + 1, n)]
    longer = packed(keys)
    assert index.find_few(longer) == [*range(n // 2), 5000, *range(n // 2 + 1, n + 1)]
    assert (index._gen, longer) not in index_module._FOUND


@pytest.mark.parametrize("key_size", [16, 20])
def test_find_leading_stops_at_the_first_absent_key_and_never_answers_from_before_a_removal(
        key_size):
    """find_leading: the slots of the leading keys present, [] when the first is absent;
    a whole run found is remembered (16-byte keys), and a removal of any of its keys,
    or an insert that lengthens a partial run, shows in the next answer."""
    keys = [i.to_bytes(key_size, "little") for i in range(200, 216)]
    data = packed(keys)
    index = KeyIndex(key_size, seed=5)
    assert index.find_leading(data) == []
    index.insert(packed(keys[:5] + keys[6:]), [*range(5), *range(6, 16)])
    assert index.find_leading(data) == list(range(5))           # stops at keys[5]
    index.insert(keys[5], [5])
    assert index.find_leading(data) == list(range(16))
    assert index.find_leading(data) == list(range(16))          # remembered (16 bytes)
    assert index.find_leading(packed(keys[:3])) == [0, 1, 2]
    index.remove_slots([9])
    assert index.find_leading(data) == list(range(9))
    index.remove(packed(keys[:1]))
    assert index.find_leading(data) == []
    assert index.find_leading(packed(keys[1:4])) == [1, 2, 3]
