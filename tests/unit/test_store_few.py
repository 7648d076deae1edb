"""The store's few-key paths (a call of up to 16 keys walks Python ints and scalar pins;
a Get's or a lookup's of up to FEW_READS finds its keys as a list)
against a model of what the batch paths answer: counts, pins, frees, the pool's use."""

import dataclasses

import numpy as np
import pytest

from kvstore_protocol.layout import PageLayout
from kvstore_server.errors import Outcome, StoreError
from kvstore_server.region import Region
from kvstore_server.store import Store

MiB = 1 << 20
LAYOUT = PageLayout(model="few", num_layers=4, page_tokens=16, num_kv_heads=1, head_size=32)


@pytest.fixture
def store():
    region = Region(64 * MiB)
    yield Store(region, lease_ttl=30.0)
    region.close()


def _key(i: int, size: int = 16) -> bytes:
    return i.to_bytes(8, "little").ljust(size, b"k")


def _rank(layout: PageLayout, rank: int) -> PageLayout:
    fields = {f.name: getattr(layout, f.name) for f in dataclasses.fields(layout)}
    return PageLayout(**{**fields, "tp_rank": rank, "tp_size": 2})


def _put(store, info, ks):
    res = store.reserve(info.layout_id, ks)
    return store.commit(res.lease_id)


@pytest.mark.parametrize("key_size", [16, 24])
def test_few_key_lookups_pins_and_deletes_agree_with_a_model(store, key_size):
    """Random prefixes of 0-20 keys (across the few-key bound) and of 100-139 (across
    FEW_READS), repeats included, over one or two layouts with holes: the count is the shortest leading run, a leased
    lookup pins each named page once per naming, and its release after a delete frees
    exactly the deleted pages (a repeated slot unpinned as often as pinned)."""
    rng = np.random.default_rng(key_size)
    a = store.register_layout(LAYOUT)
    b = store.register_layout(_rank(LAYOUT, 1))
    stored = {a.layout_id: set(), b.layout_id: set()}
    for info in (a, b):
        held = [i for i in range(64) if rng.random() < 0.8]
        _put(store, info, [_key(i, key_size) for i in held])
        stored[info.layout_id].update(held)
    for _ in range(300):
        if rng.random() < 0.7:
            n = int(rng.integers(0, 21))
            names = [int(i) for i in rng.integers(0, 64, n)]
        else:                       # a prompt's, across FEW_READS: keys of both, a hole
            n = int(rng.integers(100, 140))
            both = sorted(stored[a.layout_id] & stored[b.layout_id])
            names = [int(i) for i in rng.choice(both, n)]
            names[int(rng.integers(0, n))] = int(rng.integers(0, 64))
        if n > 2 and rng.random() < 0.3:
            names[-1] = names[0]                       # a repeat
        layouts = [a.layout_id] if rng.random() < 0.5 else [a.layout_id, b.layout_id]
        ks = [_key(i, key_size) for i in names]
        expect = min(next((j for j, i in enumerate(names) if i not in stored[lid]), n)
                     for lid in layouts)
        assert store.lookup(layouts, ks)[0] == expect
        before = store._slots.pins.copy()
        count, lease_id = store.lookup(layouts, ks, 30.0)
        assert count == expect and bool(lease_id) == bool(expect)
        assert int(store._slots.pins.sum() - before.sum()) == expect * len(layouts)
        if not lease_id:
            continue
        gone = names[0]
        used = store.pool.used_bytes
        assert store.delete(layouts[0], [_key(gone, key_size)]) == 1
        assert store.pool.used_bytes == used               # leased: doomed, not freed
        stored[layouts[0]].discard(gone)
        assert store.release(lease_id)
        assert (store._slots.pins == before).all()
        assert store.pool.used_bytes == used - store.pool.slot_bytes(a.cls)
        _put(store, a if layouts[0] == a.layout_id else b, [_key(gone, key_size)])
        stored[layouts[0]].add(gone)
    assert int(store._slots.pins.sum()) == 0


@pytest.mark.parametrize("n", [1, 3, 16, 17, 40])
def test_deletes_of_ready_writing_absent_and_repeated_keys(store, n):
    """A delete of n keys (the few-key path to 16, the batch past it) counts each stored
    page once however often it is named, drops a page being written (its commit then
    stores nothing of it) and frees every slot once: the pool ends where it began."""
    info = store.register_layout(LAYOUT)
    empty = store.pool.used_bytes
    ready = [_key(i) for i in range(n)]
    _put(store, info, ready)
    writing = [_key(1000 + i) for i in range(max(1, n // 3))]
    res = store.reserve(info.layout_id, writing)
    absent = [_key(2000 + i) for i in range(2)]
    named = ready + ready[: n // 2 + 1] + writing + absent
    assert store.delete(info.layout_id, named) == n
    assert store.lookup([info.layout_id], ready[:1])[0] == 0
    assert store.commit(res.lease_id) == 0              # deleted while being written
    assert store.exists(info.layout_id, ready + writing).tolist() == [False] * len(
        ready + writing)
    assert store.pool.used_bytes == empty
    assert store.delete(info.layout_id, named) == 0
    _put(store, info, ready + writing)                  # slots reused, each once
    assert store.lookup([info.layout_id], ready + writing)[0] == len(ready + writing)


@pytest.mark.parametrize("n", [1, 5, 16, 17])
def test_acquires_of_a_few_keys_name_the_first_missing_and_pin_each_naming(store, n):
    """An acquire of n keys (a list to 16, the batch past it): NOT_FOUND names the first
    key stored nowhere; stored keys, one named twice, are pinned once per naming, at
    their pool offsets, and the release takes every pin back."""
    info = store.register_layout(LAYOUT)
    ks = [_key(i) for i in range(n)]
    _put(store, info, ks)
    hole = [_key(500)] if n == 1 else ks[: n // 2] + [_key(500)] + ks[n // 2 + 1:]
    with pytest.raises(StoreError) as err:
        store.acquire(info.layout_id, hole)
    at = 0 if n == 1 else n // 2
    assert err.value.outcome is Outcome.NOT_FOUND and f"key {at} of {len(hole)}" in \
        err.value.message
    named = ks + ks[:1]
    pinned = store.acquire(info.layout_id, named, ttl=30.0)
    slots = pinned.slots.tolist()
    assert slots[-1] == slots[0] and len(set(slots)) == n
    assert pinned.offsets.tolist() == store.pool.offset[pinned.slots].tolist()
    assert int(store._slots.pins[slots[0]]) == 2 and int(store._slots.pins.sum()) == n + 1
    assert store.release(pinned.lease_id)
    assert int(store._slots.pins.sum()) == 0


@pytest.mark.parametrize("n", [1, 4, 16, 17])
def test_a_delete_frees_its_slots_whole_whether_few_or_many(store, n):
    """A delete of n keys (a list freed slot by slot to 16, arrays past it) leaves no
    trace of its pages: slots FREE and owned by no layout, out of the eviction order,
    the tenant refunded, each key recorded once as DELETED in the removals ring; a
    session that retained one lets go of it and the slot goes free at once."""
    from kvstore_protocol.keys import Packed
    from kvstore_server.removals import Cause
    from kvstore_server.store.slots import SlotState

    info = store.register_layout(LAYOUT)
    ks = [_key(i) for i in range(n + 1)]
    _put(store, info, ks)
    slots = store._find(info, Packed.of(ks[:n])).tolist()
    kept = int(store._find(info, Packed.of(ks[n:])).tolist()[0])
    assert store.retain(info.layout_id, Packed.of(ks[:1]), "s", 30.0).pages == 1
    head = store.removals.head
    charged = store._s.tenants.bytes[info.tenant]
    assert store.delete(info.layout_id, ks[:n] + ks[:1]) == n
    assert all(store._slots.state[s] == SlotState.FREE for s in slots)
    assert all(store._slots.layout_of[s] == -1 for s in slots)
    assert int(store._slots.pins.sum()) == 0             # the session's pin went too
    assert store._s.policy.victims(100).tolist() == [kept]
    assert store._s.tenants.bytes[info.tenant] == charged - n * info.page_bytes
    read = store.removals.read([info.layout_id], head, store.removals.epoch)
    assert len(read) == n and set(read.causes) == {int(Cause.DELETED)}
    assert read.keys == b"".join(ks[:n])
    _put(store, info, ks[:n])                            # each slot free once: reused
    assert store.lookup([info.layout_id], ks)[0] == n + 1

