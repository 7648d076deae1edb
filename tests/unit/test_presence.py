"""The presence map's two ends agree on every bucket, and its counters follow the index."""

import numpy as np
import pytest

from kvstore_client import presence as client_side
from kvstore_server.store.index import KeyIndex
from kvstore_server.store.presence import AREA_BYTES, Presence

LAYOUT = bytes(range(16))


def _map():
    header = np.zeros(4096, dtype=np.uint8)
    area = np.zeros(AREA_BYTES, dtype=np.uint8)
    return Presence(header, area, 1 << 30, clock=lambda: 123.5), header, area


@pytest.mark.parametrize("key_size", [1, 7, 8, 9, 16, 31, 64])
def test_the_server_counts_each_key_in_the_bucket_the_client_reads(key_size):
    rng = np.random.default_rng(key_size)
    keys = np.unique(rng.integers(0, 256, (200, key_size), dtype=np.uint8), axis=0)
    presence, _, area = _map()
    index = KeyIndex(key_size, seed=1)
    index.watch = presence.watch(LAYOUT)
    index.insert(keys, np.arange(len(keys)))
    salt = client_side.salt(LAYOUT)
    buckets = [client_side.bucket(salt, k.tobytes()) for k in keys]
    expected = np.bincount(buckets, minlength=AREA_BYTES)
    assert np.array_equal(area, expected.astype(np.uint8))
    # Another layout's salt puts the same keys elsewhere.
    other = {client_side.bucket(client_side.salt(b"\xff" * 16), k.tobytes()) for k in keys}
    assert other != set(buckets)


def test_removals_count_down_by_key_and_by_slot():
    presence, _, area = _map()
    index = KeyIndex(16, seed=2)
    index.watch = presence.watch(LAYOUT)
    keys = np.arange(16 * 10, dtype=np.uint8).reshape(10, 16)
    index.insert(keys, np.arange(10))
    assert area.sum() == 10
    index.remove(keys[:3])
    assert area.sum() == 7
    index.remove(keys[:3])                      # absent now: nothing counted twice
    assert area.sum() == 7
    index.remove_slots(np.array([5, 6, 6]))     # a repeated slot is removed once
    assert area.sum() == 5
    salt = client_side.salt(LAYOUT)
    for i in (0, 1, 2, 5, 6):
        assert area[client_side.bucket(salt, keys[i].tobytes())] == 0


def test_a_counter_that_reaches_255_never_comes_down():
    presence, _, area = _map()
    watch = presence.watch(LAYOUT)
    same = np.zeros((300, 2), dtype=np.uint64)           # 300 keys of one bucket
    watch(same, 1)
    bucket = client_side.bucket(client_side.salt(LAYOUT), bytes(16))
    assert area[bucket] == 255
    watch(same[:299], -1)
    assert area[bucket] == 255                          # may only cost a call, never a miss
    assert area.sum() == 255


def test_the_header_names_the_area_and_beats_until_stopped():
    presence, header, _ = _map()
    presence.start()
    magic, offset, bits, _, beat = client_side.HEADER.unpack_from(header.tobytes(),
                                                                client_side.HEADER_AT)
    assert (magic, offset, bits, beat) == (client_side.MAGIC, 1 << 30, client_side.BITS, 123.5)
    presence.stop()
    assert client_side.HEADER.unpack_from(header.tobytes(), client_side.HEADER_AT)[4] == 0.0


def test_the_area_must_be_its_size():
    with pytest.raises(ValueError, match="presence area"):
        Presence(np.zeros(4096, np.uint8), np.zeros(1024, np.uint8), 0)


@pytest.mark.parametrize("key_size", [7, 16, 64])
def test_a_few_keys_at_a_time_count_as_one_batch_does(key_size):
    """A batch of up to _FEW keys is counted in Python ints: the map must come out as
    when the same keys come in one batch, up and down, the stuck counter included."""
    from kvstore_server.store import presence as server_side
    rng = np.random.default_rng(key_size)
    keys = np.unique(rng.integers(0, 256, (300, key_size), dtype=np.uint8), axis=0)
    words = np.zeros((len(keys), -(-key_size // 8) * 8), np.uint8)
    words[:, :key_size] = keys
    words = words.view(np.uint64)
    batch, _, batch_area = _map()
    few, _, few_area = _map()
    for _p, area in ((batch, batch_area), (few, few_area)):
        area[client_side.bucket(client_side.salt(LAYOUT), keys[0].tobytes())] = 254
    by_batch, by_few = batch.watch(LAYOUT), few.watch(LAYOUT)
    by_batch(np.concatenate([words, words[:1], words[:1]]), 1)
    for lo in range(0, len(words), server_side._FEW):
        by_few(words[lo:lo + server_side._FEW], 1)
    by_few(words[:1], 1)
    by_few(words[:1], 1)
    assert np.array_equal(batch_area, few_area) and few_area.max() == 255
    by_batch(words[::2], -1)
    for row in words[::2]:
        by_few(row[None, :], -1)
    assert np.array_equal(batch_area, few_area)


@pytest.mark.parametrize("key_size", [7, 16, 24])
def test_a_few_keys_inserted_one_call_at_a_time_count_where_the_client_reads(key_size):
    """The few-key inserts (one key, a few) tell the map their words as lists: each key
    lands in the bucket the client computes, and a delete of them takes it back."""
    rng = np.random.default_rng(key_size)
    keys = [bytes(rng.integers(0, 256, key_size, dtype=np.uint8)) for _ in range(7)]
    presence, _, area = _map()
    index = KeyIndex(key_size, seed=3)
    index.watch = presence.watch(LAYOUT)
    index.insert(keys[0], [0])                                  # one key
    index.insert(b"".join(keys[1:4]), [1, 2, 3])                # a few
    index.insert(np.frombuffer(b"".join(keys[4:]), np.uint8).reshape(3, key_size),
                 np.arange(4, 7))
    salt = client_side.salt(LAYOUT)
    buckets = [client_side.bucket(salt, k) for k in keys]
    assert np.array_equal(area, np.bincount(buckets, minlength=AREA_BYTES).astype(np.uint8))
    index.remove_slots([0, 2])
    assert area.sum() == 5 and area[buckets[0]] == buckets.count(buckets[0]) - 1
