"""The storage engine in-process: states, leases, eviction order. The RPC layer is
tested against a real server process in tests/integration."""

import dataclasses

import numpy as np
import pytest

from kvstore_protocol.layout import PageLayout
from kvstore_server.errors import Outcome, StoreError
from kvstore_server.region import Region
from kvstore_server.store import Store
from kvstore_server.store.leases import footprint

MiB = 1 << 20
# 256 KiB pages: 4 layers of 64 KiB
LAYOUT = PageLayout(model="t", num_layers=4, page_tokens=16, num_kv_heads=8, head_size=128)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def store():
    region = Region(16 * MiB)
    clock = Clock()
    s = Store(region, lease_ttl=5.0, clock=clock)
    s.test_clock = clock
    yield s
    region.close()


def keys(prefix, n):
    return [f"{prefix}-{i}".encode().ljust(16, b"_") for i in range(n)]


def put(store, info, ks, fill=None):
    res = store.reserve(info.layout_id, ks)
    for i, off in enumerate(res.offsets.tolist()):
        if off >= 0:
            store.mem[off:off + info.page_bytes] = (fill if fill is not None else i) % 256
    return store.commit(res.lease_id)


def test_writing_pages_are_invisible_until_commit(store):
    info = store.register_layout(LAYOUT)
    ks = keys("a", 3)
    res = store.reserve(info.layout_id, ks)
    assert store.lookup([info.layout_id], ks) == (0, 0)
    assert not store.exists(info.layout_id, ks).any()
    store.commit(res.lease_id)
    assert store.lookup([info.layout_id], ks)[0] == 3


def test_abort_and_expiry_free_reservations(store):
    """Abort frees a reservation's slots at once; expiry ends it at once (no commit, no
    key visible) but holds its slots back for another lease_ttl."""
    info = store.register_layout(LAYOUT)
    res = store.reserve(info.layout_id, keys("a", 4))
    store.abort(res.lease_id)
    assert store.pool.used_bytes == 0
    res = store.reserve(info.layout_id, keys("b", 4))      # the store's ttl: 5 s
    store.test_clock.now += 6
    assert store.expire_leases() == 1
    assert store.lookup([info.layout_id], keys("b", 4))[0] == 0
    with pytest.raises(StoreError) as err:
        store.commit(res.lease_id)
    assert err.value.outcome is Outcome.EXPIRED
    assert store.pool.used_bytes == 4 * store.pool.slot_bytes(info.cls)
    assert store.stats().held_back_pages == 4 and store.stats().leases == 0
    store.test_clock.now += 3.9                             # 9.9 s: 10 s is its end
    store.expire_leases()
    assert store.pool.used_bytes > 0
    store.test_clock.now += 0.2
    assert store.expire_leases() == 0
    assert store.pool.used_bytes == 0 and store.stats().held_back_pages == 0
    assert store.stats().leased_pages == 0


def test_a_slow_writer_past_its_lease_never_writes_into_another_page(store):
    """A reservation that ran out while its client was only slow: the slots it named go
    to no other page until it has been held back another lease_ttl, so a late write lands
    where nobody reads. Puts of twice the pool's pages, evicting, never get them."""
    info = store.register_layout(LAYOUT)
    capacity = store.pool.capacity_bytes // store.pool.slot_bytes(info.cls)
    slow = store.reserve(info.layout_id, keys("slow", 2), ttl=2.0)
    store.test_clock.now += 2.5
    assert store.expire_leases() == 1
    given = set()
    for r in range(2 * capacity):
        res = store.reserve(info.layout_id, keys(f"other{r}", 1))
        given |= set(res.offsets.tolist())
        store.mem[res.offsets[0]:res.offsets[0] + info.page_bytes] = r % 256
        store.commit(res.lease_id)
    assert given.isdisjoint(slow.offsets.tolist()) and len(given) == capacity - 2
    for off in slow.offsets.tolist():                       # the late write lands
        store.mem[off:off + info.page_bytes] = 0xAA
    for r in range(capacity + 2, 2 * capacity):             # the newest pages, unharmed
        got = store.acquire(info.layout_id, keys(f"other{r}", 1))
        off = int(got.offsets[0])
        assert (store.mem[off:off + info.page_bytes] == r % 256).all()
        store.release(got.lease_id)
    store.test_clock.now += 4.4                             # 4.9 s after expiry: held ...
    store.expire_leases()
    assert store.stats().held_back_pages == 2
    store.test_clock.now += 0.2                             # ... and no longer
    store.expire_leases()
    assert store.pool.used_bytes == capacity * store.pool.slot_bytes(info.cls) - 2 * \
        store.pool.slot_bytes(info.cls)                     # the two slots are free again


def test_an_acquire_past_its_lease_keeps_its_pages_a_while_longer(store):
    """An expired READ lease's pages stay pinned (not evicted, and a delete waits) until
    held back another lease_ttl (the store's 5 s, not the lease's 1 s); then they go as
    after a release."""
    info = store.register_layout(LAYOUT)
    capacity = store.pool.capacity_bytes // store.pool.slot_bytes(info.cls)
    held = keys("held", 3)
    put(store, info, held, fill=3)
    late = store.acquire(info.layout_id, held, ttl=1.0)
    store.test_clock.now += 1.5
    assert store.expire_leases() == 1 and not store.release(late.lease_id)
    assert store.delete(info.layout_id, held) == 3          # invisible now, freed later
    put(store, info, keys("fill", capacity - 3), fill=4)
    for off in late.offsets.tolist():                       # the late reader's bytes
        assert (store.mem[off:off + info.page_bytes] == 3).all()
    store.test_clock.now += 3.0                             # the lease's own ttl, twice over
    store.expire_leases()
    assert store.stats().held_back_pages == 3
    store.test_clock.now += 2.1                             # 1 + 5 s after the acquire
    store.expire_leases()
    assert store.stats().held_back_pages == 0
    assert put(store, info, keys("new", 3)) == 3            # their slots, free again


def test_held_back_slots_count_in_lease_memory_and_go_with_force(store):
    """What is held back counts against --lease-memory with the live leases (so a client
    that lets leases expire cannot grow the server past it), and an admin's --force lets
    it go with them."""
    info = store.register_layout(LAYOUT)
    put(store, info, keys("k", 8))
    store.acquire(info.layout_id, keys("k", 8), ttl=1.0)
    store.test_clock.now += 1.5
    store.expire_leases()
    assert store.stats().held_back_pages == 8 and store.stats().leases == 0
    store.lease_memory = footprint(8)                       # exactly what is held back
    with pytest.raises(StoreError) as err:
        store.acquire(info.layout_id, keys("k", 1))
    assert err.value.outcome is Outcome.EXHAUSTED and "held back" in err.value.message
    assert store.break_leases() == 0                        # no live lease to break ...
    assert store.stats().held_back_pages == 0 and store.stats().leased_pages == 0
    assert store.acquire(info.layout_id, keys("k", 1)).lease_id   # ... but room again


def test_present_keys_are_skipped_not_stored_twice(store):
    info = store.register_layout(LAYOUT)
    put(store, info, keys("a", 2))
    used = store.pool.used_bytes
    res = store.reserve(info.layout_id, keys("a", 3) + keys("a", 1))
    assert res.slots.tolist()[:2] == [-1, -1] and res.slots[2] >= 0 and res.slots[3] == -1
    assert res.skipped == 3
    store.commit(res.lease_id)
    assert store.pool.used_bytes == used + store.pool.slot_bytes(info.cls)


def test_lookup_counts_leading_keys_only(store):
    info = store.register_layout(LAYOUT)
    ks = keys("p", 6)
    put(store, info, ks[:2] + ks[3:])          # a hole at 2
    assert store.lookup([info.layout_id], ks)[0] == 2
    assert store.exists(info.layout_id, ks).tolist() == [True, True, False, True, True, True]


def test_lookup_over_several_layouts_is_the_minimum(store):
    a = store.register_layout(LAYOUT)
    b = store.register_layout(PageLayout(**{**_fields(LAYOUT), "tp_rank": 1, "tp_size": 2}))
    ks = keys("k", 5)
    put(store, a, ks)
    put(store, b, ks[:3])
    assert store.lookup([a.layout_id, b.layout_id], ks)[0] == 3


def test_a_lookup_that_misses_its_first_key_counts_its_misses_and_leases_nothing(store):
    """A prefix whose first key is absent is answered from that key alone: the same
    count, misses and (no) lease as the batch path, in every layout named."""
    a = store.register_layout(LAYOUT)
    b = store.register_layout(PageLayout(**{**_fields(LAYOUT), "tp_rank": 1, "tp_size": 2}))
    ks = keys("m", 4)
    put(store, a, ks)
    put(store, b, ks[1:])                       # b lacks the first key only
    assert store.lookup_pinned([a.layout_id, b.layout_id], ks, 5.0) == (0, 0, [])
    assert store.lookup([a.layout_id], [b"?" * 16] + ks, 5.0) == (0, 0)
    assert store.lookup([a.layout_id], [k + b"+" for k in ks]) == (0, 0)   # no such index
    assert store.lookup([a.layout_id], []) == (0, 0)
    stats = store.stats()
    layouts = {x.info.layout_id: x for x in stats.layouts}
    assert (layouts[a.layout_id].misses, layouts[b.layout_id].misses) == (4 + 5 + 4, 4)
    assert stats.leases == 0 and stats.leased_pages == 0
    count, lease_id = store.lookup([a.layout_id], ks, 5.0)   # present: the batch path
    assert count == 4 and lease_id and store.stats().leased_pages == 4


def _fields(layout):
    return {f.name: getattr(layout, f.name) for f in dataclasses.fields(layout)}


def test_eviction_takes_tails_before_heads(store):
    info = store.register_layout(LAYOUT)
    capacity = store.pool.capacity_bytes // store.pool.slot_bytes(info.cls)
    prefixes = [keys(f"r{r}", 8) for r in range(capacity // 8 + 4)]
    for i, ks in enumerate(prefixes):
        put(store, info, ks)
        # re-touch older prefixes as lookups would
        for older in prefixes[: i + 1][::3]:
            store.lookup([info.layout_id], older)
    for ks in prefixes:
        present = store.exists(info.layout_id, ks).tolist()
        n = sum(present)
        assert present == [True] * n + [False] * (8 - n), f"hole in {present}"
    assert store.evictions > 0


def test_leased_pages_are_never_evicted(store):
    info = store.register_layout(LAYOUT)
    held = keys("held", 4)
    put(store, info, held)
    count, lease = store.lookup([info.layout_id], held, lease_ttl=10)
    assert count == 4 and lease
    capacity = store.pool.capacity_bytes // store.pool.slot_bytes(info.cls)
    for r in range(3):
        put(store, info, keys(f"fill{r}", capacity - 4))
    assert store.exists(info.layout_id, held).all()
    assert store.release(lease)
    put(store, info, keys("more", capacity - 4))
    assert not store.exists(info.layout_id, held).all()


def test_full_of_leased_pages_is_exhausted(store):
    info = store.register_layout(LAYOUT)
    capacity = store.pool.capacity_bytes // store.pool.slot_bytes(info.cls)
    ks = keys("x", capacity)
    put(store, info, ks)
    store.acquire(info.layout_id, ks)
    with pytest.raises(StoreError) as err:
        store.reserve(info.layout_id, keys("y", 1))
    assert err.value.outcome is Outcome.EXHAUSTED


# One page takes the store's scalar pin/unpin, two the vector one: both must free a
# deleted page at its last release, and only then.
@pytest.mark.parametrize("n", [1, 2])
def test_delete_of_a_leased_page_waits_for_release(store, n):
    info = store.register_layout(LAYOUT)
    ks = keys("d", n)
    put(store, info, ks, fill=7)
    first = store.acquire(info.layout_id, ks)
    pinned = store.acquire(info.layout_id, ks)   # pinned twice
    assert store.delete(info.layout_id, ks) == n
    assert store.release(first.lease_id)
    assert store.lookup([info.layout_id], ks)[0] == 0
    used = store.pool.used_bytes
    assert used > 0                              # still pinned: slots not reused
    off = int(pinned.offsets[0])
    assert (store.mem[off:off + info.page_bytes] == 7).all()
    put(store, info, ks, fill=9)                 # a new put of the same keys gets new slots
    assert store.release(pinned.lease_id)
    assert store.pool.used_bytes == used         # old pages freed, new ones live
    assert store.lookup([info.layout_id], ks)[0] == n


def test_acquire_missing_names_the_key(store):
    info = store.register_layout(LAYOUT)
    ks = keys("m", 3)
    put(store, info, ks[:2])
    with pytest.raises(StoreError) as err:
        store.acquire(info.layout_id, ks)
    assert err.value.outcome is Outcome.NOT_FOUND and "key 2 of 3" in err.value.message


def test_unknown_layout_and_oversized_page(store):
    with pytest.raises(StoreError) as err:
        store.lookup([b"\x01" * 16], keys("a", 1))
    assert err.value.outcome is Outcome.INVALID and "unknown layout" in err.value.message
    huge = PageLayout(model="h", num_layers=64, page_tokens=256, num_kv_heads=8, head_size=128)
    with pytest.raises(StoreError) as err:
        store.register_layout(huge)
    assert err.value.outcome is Outcome.INVALID


def test_layouts_past_max_layouts_are_refused():
    """Layouts are kept for the store's life, so their number is capped: a known one is
    still answered, a new one past the cap is EXHAUSTED, naming the setting."""
    region = Region(16 * MiB)
    try:
        store = Store(region, lease_ttl=5.0, max_layouts=3)
        salted = [dataclasses.replace(LAYOUT, salt=f"s{i}") for i in range(4)]
        infos = [store.register_layout(layout) for layout in salted[:3]]
        assert store.register_layout(salted[1]) is infos[1]
        with pytest.raises(StoreError, match="--max-layouts") as err:
            store.register_layout(salted[3])
        assert err.value.outcome is Outcome.EXHAUSTED
        with pytest.raises(StoreError, match="--max-layouts"):
            store.register_layout(salted[0], "another-tenant")     # a new one of its own
        assert store.lookup([infos[2].layout_id], keys("a", 1)) == (0, 0)
    finally:
        region.close()


def test_admin_evict_by_bytes_layout_and_all(store):
    a = store.register_layout(LAYOUT)
    b = store.register_layout(PageLayout(**{**_fields(LAYOUT), "model": "other"}))
    put(store, a, keys("a", 10))
    put(store, b, keys("b", 10))
    slot = store.pool.slot_bytes(a.cls)
    pages, freed, leased = store.evict(nbytes=3 * slot)
    assert pages == 3 and freed == 3 * slot and leased == 0
    pages, _, _ = store.evict(layout_id=b.layout_id)
    assert store.exists(b.layout_id, keys("b", 10)).sum() == 0
    store.acquire(a.layout_id, keys("a", 1))
    pages, _, leased = store.evict(everything=True)
    assert leased == 1 and store.stats().pages == 1


def test_watermark_eviction(store):
    info = store.register_layout(LAYOUT)
    capacity = store.pool.capacity_bytes // store.pool.slot_bytes(info.cls)
    put(store, info, keys("w", capacity))
    assert store.evict_to_watermark() > 0
    assert store.pool.used_bytes <= store.low_watermark * store.pool.capacity_bytes


def test_inspect_and_stats(store):
    info = store.register_layout(LAYOUT)
    put(store, info, keys("i", 2))
    store.test_clock.now += 3
    got = store.inspect(info.layout_id, keys("i", 1)[0])
    assert got.state == "READY" and got.size_bytes == info.page_bytes
    assert got.age_seconds == pytest.approx(3)
    s = store.stats()
    assert s.pages == 2 and s.layouts[0].pages == 2
    np.testing.assert_equal(s.bytes_in, 2 * info.page_bytes)
