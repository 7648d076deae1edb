"""The store over a real disk tier: quotas hold for pages read back, a bad read-back leaks
nothing, deletes and Inspect see disk-only pages, in-flight keys are not "skipped", the
lock is not held while the tier below is asked, and an admin can break leases."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvstore_protocol.layout import PageLayout
from kvstore_server.disk.tier import DiskTier
from kvstore_server.errors import Outcome, StoreError
from kvstore_server.region import Region
from kvstore_server.store import Store
from kvstore_server.tier import NullTier

MiB = 1 << 20
# 256 KiB pages: 4 layers of 64 KiB
LAYOUT = PageLayout(model="t", num_layers=4, page_tokens=16, num_kv_heads=8, head_size=128)


@pytest.fixture
def stores(tmp_path):
    made = []

    def make(lower=None, dram=16 * MiB) -> Store:
        region = Region(dram)
        if lower == "disk":
            lower = DiskTier(str(tmp_path / f"disk{len(made)}"), 256 * MiB)
        store = Store(region, lease_ttl=5.0, lower=lower)
        made.append((store, region))
        return store

    yield make
    for store, region in made:
        if isinstance(store.lower, DiskTier):
            store.lower.close()
        region.close()


def keys(prefix, n):
    return [f"{prefix}-{i}".encode().ljust(16, b"_") for i in range(n)]


def put(store, info, ks, quota=0):
    res = store.reserve(info.layout_id, ks, quota=quota)
    for i, off in enumerate(res.offsets.tolist()):
        if off >= 0:
            store.mem[off:off + info.page_bytes] = i % 256
    return store.commit(res.lease_id)


def spill(store):
    store.evict(everything=True)
    assert store.lower.flush(10) == 0


def dram_pages(store, info, ks) -> int:
    return int(np.count_nonzero(store._find(info, store_keys(ks)) >= 0))


def store_keys(ks):
    from kvstore_protocol.keys import Packed
    return Packed.of(ks)


def test_pages_read_back_from_disk_are_held_to_the_quota(stores):
    store = stores("disk")
    a = store.register_layout(LAYOUT, "a")
    b = store.register_layout(LAYOUT, "b")
    quota = 8 * a.page_bytes
    old = keys("a-old", 8)
    put(store, a, old, quota)
    spill(store)                                    # a's 8 pages are on disk only
    new = keys("a-new", 8)
    put(store, a, new, quota)                       # a is at its quota in DRAM
    room = store.pool.free_bytes // b.page_bytes
    theirs = keys("b", room)
    put(store, b, theirs)                           # b takes the rest of the pool
    pinned = store.acquire(a.layout_id, old, quota=quota)   # read back: over a's quota
    store.release(pinned.lease_id)
    assert store.stats().tenants[0].used_bytes <= quota
    assert dram_pages(store, b, theirs) == room     # b lost nothing to a
    assert dram_pages(store, a, old) == 8


def test_a_read_back_of_the_wrong_length_leaks_no_reservation(stores):
    store = stores("disk")
    info = store.register_layout(LAYOUT)
    key = keys("k", 1)
    # A slot whose header checks out, with a page of another length under this key.
    assert store.lower.offer(info.layout_id, key[0], np.zeros(1000, np.uint8))
    assert store.lower.flush(10) == 0
    with pytest.raises(StoreError) as err:
        store.acquire(info.layout_id, key)
    assert err.value.outcome is Outcome.NOT_FOUND
    assert store.lower.stats().corrupt_pages == 1
    assert store.stats().leases == 0 and store.pool.used_bytes == 0
    assert put(store, info, key) == 1               # the key can be stored again


def test_delete_counts_and_inspect_finds_disk_only_pages(stores):
    store = stores("disk")
    info = store.register_layout(LAYOUT)
    ks = keys("d", 6)
    put(store, info, ks)
    spill(store)
    found = store.inspect(info.layout_id, ks[0])
    assert found.tier == "disk" and found.state == "READY"
    assert found.size_bytes == info.page_bytes
    pinned = store.acquire(info.layout_id, ks[:2])   # two back in DRAM, on disk too
    store.release(pinned.lease_id)
    assert store.delete(info.layout_id, ks[:4] + ks[:1]) == 4    # a repeat counts once
    assert store.exists(info.layout_id, ks).tolist() == [False] * 4 + [True] * 2
    with pytest.raises(StoreError) as err:
        store.inspect(info.layout_id, ks[0])
    assert err.value.outcome is Outcome.NOT_FOUND


def test_keys_being_written_by_another_are_in_flight_not_skipped(stores):
    store = stores()
    info = store.register_layout(LAYOUT)
    ks = keys("w", 4)
    put(store, info, ks[:1])
    first = store.reserve(info.layout_id, ks[1:3])
    second = store.reserve(info.layout_id, ks + ks[3:])
    assert second.in_flight == 2            # ks[1], ks[2]: stored only if `first` commits
    assert second.skipped == 2              # ks[0] is stored; ks[3] named twice
    store.abort(first.lease_id)
    store.commit(second.lease_id)
    assert store.exists(info.layout_id, ks).tolist() == [True, False, False, True]


class SlowTier:
    """A tier below whose probe takes a while, and which holds every page."""

    holds_pages = True

    def __getattr__(self, name):             # the rest of the Tier interface: NullTier's
        return getattr(NullTier(), name)

    def contains(self, layout_id, keys) -> np.ndarray:
        time.sleep(0.3)
        return np.ones(len(keys), dtype=bool)


def test_the_lock_is_not_held_while_the_tier_below_is_asked(stores):
    store = stores(SlowTier())
    info = store.register_layout(LAYOUT)
    ks = keys("s", 100)
    put(store, info, ks[:10])
    assert store.lookup([info.layout_id], ks)[0] == 100
    assert store.exists(info.layout_id, ks).all()
    assert store.stats().lock.max_seconds < 0.1


def test_an_admin_can_break_abandoned_leases(stores):
    store = stores()
    info = store.register_layout(LAYOUT)
    put(store, info, keys("r", 2))
    store.reserve(info.layout_id, keys("x", 4), ttl=1e9)     # a client that died
    store.acquire(info.layout_id, keys("r", 2), ttl=1e9)
    assert store.break_leases() == 2
    assert store.stats().leases == 0 and store.stats().leased_pages == 0
    assert store.pool.used_bytes == 2 * store.pool.slot_bytes(info.cls)
    assert store.clear()[0] == 2 and store.pool.used_bytes == 0


def test_pages_of_many_sizes_cannot_take_another_tenants_slabs(stores):
    """Each page size takes whole 8 MiB slab extents: one tenant's leased pages of many
    sizes may not take more of the pool's slabs than its quota, so the other tenant can
    still fill its own quota."""
    store = stores(dram=72 * MiB)
    quota_a, quota_b = 8 * MiB, 40 * MiB
    held, refused = [], 0
    for i in range(8):                  # 4 KiB .. 32 KiB pages: 8 size classes
        small = PageLayout(model="a", num_layers=i + 1, page_tokens=16, num_kv_heads=1,
                           head_size=64)
        info = store.register_layout(small, "a")
        try:
            put(store, info, keys(f"a{i}", 1), quota_a)
        except StoreError as err:
            assert err.outcome is Outcome.EXHAUSTED and "slab" in err.message
            refused += 1
            continue
        held.append(store.acquire(info.layout_id, keys(f"a{i}", 1), ttl=1e9))
    assert refused >= 6                 # one extent within a's quota, the rest refused
    b = store.register_layout(LAYOUT, "b")
    theirs = keys("b", quota_b // b.page_bytes)
    for start in range(0, len(theirs), 16):
        put(store, b, theirs[start:start + 16], quota_b)
    assert dram_pages(store, b, theirs) == len(theirs)     # b holds its whole quota
