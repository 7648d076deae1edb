"""The lean read of a few keys (Store.pin_few, store/few_reads.py) against the generic one
(pin_read): the same pages, pins, touches and counts; None, with nothing pinned, where
pin_read must answer; and a page pinned so is neither evicted nor reused until unpinned."""

import numpy as np
import pytest

from kvstore_protocol.keys import Packed
from kvstore_protocol.layout import PageLayout
from kvstore_server.region import Region
from kvstore_server.store import Store
from kvstore_server.store.index import FEW_READS
from kvstore_server.store.slots import SlotState

MiB = 1 << 20
LAYOUT = PageLayout(model="fewreads", num_layers=4, page_tokens=16, num_kv_heads=1,
                    head_size=32)


@pytest.fixture
def store():
    region = Region(16 * MiB)
    yield Store(region, lease_ttl=30.0)
    region.close()


def _keys(prefix: str, n: int, size: int = 16) -> list[bytes]:
    return [f"{prefix}{i}".encode().ljust(size, b"_") for i in range(n)]


def _put(store: Store, info, ks: list[bytes]) -> None:
    res = store.reserve(info.layout_id, ks)
    for i, off in enumerate(res.offsets.tolist()):
        if off >= 0:
            store.mem[off:off + info.page_bytes] = i % 251
    store.commit(res.lease_id)


@pytest.mark.parametrize("key_size", [16, 24])
@pytest.mark.parametrize("pick", [
    [0], [3, 1, 2], [0, 0, 5], list(range(16)), [4, 5, 6, 7, 8],
    list(range(0, 34, 2)),                      # past FEW_KEYS, scattered: one array
    [9, 3, 1, 7, 5, 11, 13, 15, 2],             # SCATTERED_FROM and more, out of order
    [0, 2, 4, 6, 8, 10, 12, 0, 2],              # scattered, keys named twice
    list(range(40)), list(range(FEW_READS)),    # a run past FEW_KEYS, up to FEW_READS
])
def test_pin_few_agrees_with_pin_read(store, key_size, pick):
    info = store.register_layout(LAYOUT)
    ks = _keys("k", FEW_READS, key_size)
    _put(store, info, ks)
    asked = Packed(b"".join(ks[i] for i in pick), key_size)
    before = (info.served, info.bytes_out)
    generic = store.pin_read(info.layout_id, asked)
    pins = store._slots.pins.copy()
    store.unpin_read(generic)
    got = store.pin_few(info.layout_id, asked)
    assert got is not None
    layout, slots, offsets = got
    assert layout is info
    assert slots == generic.slots.tolist() and offsets == generic.offsets.tolist()
    assert np.array_equal(store._slots.pins, pins)             # the same pins, twice named twice
    assert store.stats().leases == 1                           # counted as a lease, as pin_read's
    # The first key the most recent, as pin_read's touch leaves it.
    assert (store._s.policy.stamp(np.array([slots[0]]))[0]
            == store._s.policy.stamp(np.array(sorted(set(slots)))).max())
    store.unpin_few(slots)
    assert not store._slots.pins.any()
    assert store.stats().leases == 0
    assert (info.served, info.bytes_out) == (before[0] + 2 * len(pick),
                                             before[1] + 2 * len(pick) * info.page_bytes)


def test_pin_few_answers_none_and_pins_nothing_where_pin_read_must_answer(store):
    info = store.register_layout(LAYOUT)
    ks = _keys("k", FEW_READS + 1)
    _put(store, info, ks)
    absent = _keys("absent", 1)[0]
    for asked in (Packed(ks[0] + absent, 16),           # a key missing: NOT_FOUND or read-back
                  Packed(b"".join(ks[:20]) + absent, 16),   # one past FEW_KEYS missing
                  Packed(b"".join(ks), 16),             # more than FEW_READS
                  Packed(b"", 0),                       # none
                  Packed(b"x" * 24, 24)):               # a key size the layout never saw
        assert store.pin_few(info.layout_id, asked) is None
    assert not store._slots.pins.any()
    assert store.stats().leases == 0


def test_a_page_pinned_by_pin_few_is_not_evicted_and_a_delete_frees_it_at_unpin(store):
    info = store.register_layout(LAYOUT)
    ks = _keys("k", 4)
    _put(store, info, ks)
    _, slots, offsets = store.pin_few(info.layout_id, Packed(ks[0], 16))
    page = bytes(store.mem[offsets[0]:offsets[0] + info.page_bytes])
    pages, _, leased = store.evict(everything=True)
    assert leased == 1 and pages == 3                  # the pinned page stays
    assert store.delete(info.layout_id, [ks[0]]) == 1
    assert store._slots.state[slots[0]] == int(SlotState.DOOMED)
    # Nothing reuses the slot while it is pinned: a put of as many pages as fit.
    more = _keys("m", store.pool.capacity_bytes // info.page_bytes)
    for key in more:
        try:
            _put(store, info, [key])
        except Exception:  # noqa: BLE001 - the pool full is the point
            break
    assert bytes(store.mem[offsets[0]:offsets[0] + info.page_bytes]) == page
    used = store.stats().used_bytes
    store.unpin_few(slots)
    assert store._slots.state[slots[0]] == int(SlotState.FREE)
    assert store.stats().used_bytes == used - info.page_bytes


def _unpin_frees_the_doomed(store, info, slots: list[int], doomed: list[int]) -> None:
    """Pages deleted while pinned are DOOMED, and the unpin frees them, nothing else."""
    assert store._slots.state[doomed].tolist() == [int(SlotState.DOOMED)] * len(doomed)
    used = store.stats().used_bytes
    store.unpin_few(slots)
    assert store._slots.state[doomed].tolist() == [int(SlotState.FREE)] * len(doomed)
    assert store.stats().used_bytes == used - len(doomed) * info.page_bytes
    assert not store._slots.pins.any()


def test_a_run_side_by_side_pinned_by_pin_few_frees_its_deleted_pages_at_unpin(store):
    # Slots side by side are pinned and unpinned by slices (state.side_by_side): a page
    # deleted meanwhile still goes free with its last pin, the others stay stored.
    info = store.register_layout(LAYOUT)
    ks = _keys("k", 8)
    _put(store, info, ks)
    _, slots, _ = store.pin_few(info.layout_id, Packed(b"".join(ks[2:8]), 16))
    assert slots == list(range(slots[0], slots[0] + 6))
    assert store.delete(info.layout_id, [ks[3], ks[5]]) == 2
    doomed = [slots[1], slots[3]]
    _unpin_frees_the_doomed(store, info, slots, doomed)
    assert store.exists(info.layout_id, ks).tolist() == [True] * 3 + [False] + [True] \
        + [False] + [True] * 2


def test_scattered_pages_pinned_by_pin_few_free_their_deleted_pages_at_unpin(store):
    # SCATTERED_FROM or more pages not side by side are pinned and unpinned through one
    # array: a page deleted meanwhile still goes free with its last pin, a key named twice
    # holds its page until both pins go.
    info = store.register_layout(LAYOUT)
    ks = _keys("k", 40)
    _put(store, info, ks)
    pick = [ks[i] for i in range(0, 40, 2)] + [ks[2]]          # 21 keys, k2 twice
    _, slots, _ = store.pin_few(info.layout_id, Packed(b"".join(pick), 16))
    assert len(slots) == 21 and slots[1] == slots[-1]
    assert store._slots.pins[slots[1]] == 2
    assert store.delete(info.layout_id, [ks[2], ks[4]]) == 2
    doomed = [slots[1], slots[2]]
    _unpin_frees_the_doomed(store, info, slots, doomed)
    assert store.exists(info.layout_id, ks[:6]).tolist() == [True, True, False, True,
                                                             False, True]


class _ArrayOnlyPolicy:
    """A policy with only the interface's array touch (no touch_few), as a plugin may be."""

    def __init__(self):
        from kvstore_server.store.lru import LRUPolicy
        self.inner = LRUPolicy()
        self.touched: list[list[int]] = []

    def touch(self, ids):
        assert isinstance(ids, np.ndarray)
        self.touched.append(ids.tolist())
        self.inner.touch(ids)

    def remove(self, ids):
        self.inner.remove(ids)

    def victims(self, n, eligible=None):
        return self.inner.victims(n, eligible)


def test_the_list_touches_reach_a_policy_that_only_takes_arrays():
    region = Region(16 * MiB)
    try:
        store = Store(region, policy=_ArrayOnlyPolicy)
        info = store.register_layout(LAYOUT)
        ks = _keys("k", 4)
        _put(store, info, ks)
        policy = store._s.policy
        policy.touched.clear()
        _, slots, _ = store.pin_few(info.layout_id, Packed(ks[2] + ks[0], 16))
        store.unpin_few(slots)
        assert store.lookup([info.layout_id], ks[:3]) == (3, 0)
        found = store.pin_read(info.layout_id, Packed(b"".join(ks[:3]), 16)).slots.tolist()
        assert policy.touched == [slots[::-1], found[::-1], found[::-1]]
    finally:
        region.close()


def test_pages_used_under_the_lock_are_counted_and_left_unpinned(store):
    info = store.register_layout(LAYOUT)
    ks = _keys("k", 4)
    _put(store, info, ks)
    seen = []

    def used(layout, offsets):
        seen.append((layout, offsets))
        return True

    got = store.pin_few(info.layout_id, Packed(ks[1] + ks[2], 16), used)
    assert got is not None and got[1] == [] and seen == [(info, got[2])]
    assert not store._slots.pins.any() and store.stats().leases == 0
    assert info.served == 2
    store.unpin_few(got[1])                      # nothing to unpin: a no-op
    assert not store._slots.pins.any() and store.stats().leases == 0
    # Not used whole: pinned as without it.
    _, slots, _ = store.pin_few(info.layout_id, Packed(ks[1], 16), lambda *_: False)
    assert store._slots.pins[slots[0]] == 1 and store.stats().leases == 1
    store.unpin_few(slots)

    def broken(layout, offsets):
        raise ConnectionResetError("gone")

    with pytest.raises(ConnectionResetError):
        store.pin_few(info.layout_id, Packed(ks[0], 16), broken)
    assert not store._slots.pins.any() and store.stats().leases == 0
    assert store.pin_few(info.layout_id, Packed(ks[0], 16)) is not None   # the lock is free
