"""Store.put_bytes: a put whose bytes the server holds, stored in one hold of the lock, with
reserve's and commit's rules: exact, duplicates skipped, in-flight keys left to their
writer, refused whole (nothing stored, no slot kept) and offered to a through tier."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore_protocol.keys import Packed
from kvstore_protocol.layout import PageLayout
from kvstore_server.errors import Outcome, StoreError
from kvstore_server.region import HEADER_BYTES, Region
from kvstore_server.store import Store
from tests.unit.test_store_through import Recorder

LAYOUT = PageLayout(model="put-bytes", num_layers=1, page_tokens=1, num_kv_heads=1,
                    head_size=2048, dtype="int8", kv_factor=2)          # 4 KiB pages
PB = 4096


def _keys(*names: str) -> Packed:
    return Packed.of([n.encode().ljust(16, b"_") for n in names])


def _data(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, PB), dtype=np.uint8)


@pytest.fixture
def store():
    region = Region((64 << 10) + HEADER_BYTES)          # 16 pages
    s = Store(region)
    s.register_layout(LAYOUT)
    yield s
    region.close()


def _read(store: Store, names: tuple[str, ...]) -> bytes:
    pinned = store.acquire(LAYOUT.layout_id, _keys(*names))
    try:
        return b"".join(bytes(store.mem[o:o + PB]) for o in pinned.offsets.tolist())
    finally:
        store.release(pinned.lease_id)


def test_stored_exactly_and_repeats_and_stored_keys_skipped(store):
    data = _data(3)
    got = store.put_bytes(LAYOUT.layout_id, _keys("a", "a", "b"),
                          memoryview(np.stack([data[0], data[2], data[1]]).tobytes()))
    assert got == (2, 1, 0)
    got = store.put_bytes(LAYOUT.layout_id, _keys("a", "c"),
                          memoryview(np.stack([data[2], data[2]]).tobytes()))
    assert got == (1, 1, 0)
    assert _read(store, ("a", "b", "c")) == data.tobytes()
    assert store.stats().pinned_pages == 0


def test_a_key_another_put_is_writing_is_in_flight_not_stored(store):
    res = store.reserve(LAYOUT.layout_id, _keys("w"))
    assert store.put_bytes(LAYOUT.layout_id, _keys("w", "x"),
                           memoryview(_data(2).tobytes())) == (1, 0, 1)
    store.abort(res.lease_id)
    assert store.exists(LAYOUT.layout_id, _keys("w", "x")).tolist() == [False, True]


@pytest.mark.parametrize("why", ["short data", "pool full", "quota"])
def test_refused_whole_nothing_stored_and_no_slot_kept(store, why):
    used = store.pool.used_bytes
    names = ("r0", "r1")
    data, quota = memoryview(_data(2).tobytes()), 0
    if why == "short data":
        data = data[:PB]
    elif why == "pool full":
        names = tuple(f"r{i}" for i in range(17))
        data = memoryview(_data(17).tobytes())
    else:
        quota = PB
    with pytest.raises(StoreError) as info:
        store.put_bytes(LAYOUT.layout_id, _keys(*names), data, quota=quota)
    assert info.value.outcome is (Outcome.INVALID if why == "short data" else Outcome.EXHAUSTED)
    assert not store.exists(LAYOUT.layout_id, _keys(*names)).any()
    assert store.pool.used_bytes == used
    assert store.stats().pinned_pages == 0


def test_a_through_tier_is_offered_each_page_outside_the_lock_pinned():
    far = Recorder()
    region = Region((64 << 10) + HEADER_BYTES)
    try:
        store = Store(region, lower=far, through=far)
        far.store = store
        store.register_layout(LAYOUT)
        data = _data(2, seed=5)
        assert store.put_bytes(LAYOUT.layout_id, _keys("t0", "t1"),
                               memoryview(data.tobytes())) == (2, 0, 0)
        keys = _keys("t0", "t1")
        assert [far.pages[keys.key(i)] for i in range(2)] == [d.tobytes() for d in data]
        assert far.lock_held == [False, False] and far.pinned == [True, True]
        assert store.stats().pinned_pages == 0
    finally:
        region.close()
