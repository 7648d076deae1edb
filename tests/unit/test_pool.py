import itertools

import numpy as np
import pytest

from kvstore_server.store.pool import SLOT_ALIGN, Pool

MiB = 1 << 20


def test_slots_do_not_overlap_and_are_aligned():
    pool = Pool(64 * MiB)
    a = pool.class_for(100_000)
    b = pool.class_for(3 * MiB)
    sa = pool.alloc(a, 50)
    sb = pool.alloc(b, 5)
    spans = [(int(pool.offset[s]), pool.slot_bytes(a)) for s in sa]
    spans += [(int(pool.offset[s]), pool.slot_bytes(b)) for s in sb]
    spans.sort()
    for (o1, n1), (o2, _) in itertools.pairwise(spans):
        assert o1 + n1 <= o2
    assert all(o % SLOT_ALIGN == 0 for o, _ in spans)
    assert spans[-1][0] + spans[-1][1] <= pool.capacity_bytes
    assert pool.used_bytes == 50 * pool.slot_bytes(a) + 5 * pool.slot_bytes(b)


def test_full_pool_returns_fewer_and_freed_extents_serve_other_classes():
    pool = Pool(32 * MiB)
    small = pool.class_for(1 * MiB)
    got = pool.alloc(small, 1000)
    assert 0 < len(got) <= 32 and pool.alloc(small, 1).size == 0
    big = pool.class_for(5 * MiB)
    assert pool.alloc(big, 1).size == 0          # no free slabs left
    pool.free(got)
    assert pool.used_bytes == 0
    assert pool.alloc(big, 1).size == 1          # the freed slabs went back to the region


def test_same_size_shares_a_class_and_too_big_is_refused():
    pool = Pool(32 * MiB)
    assert pool.class_for(4000) == pool.class_for(4096)
    with pytest.raises(ValueError, match="does not fit"):
        pool.class_for(64 * MiB)


def test_ids_are_recycled():
    pool = Pool(16 * MiB)
    c = pool.class_for(1 * MiB)
    first = pool.alloc(c, 16)
    pool.free(first)
    again = pool.alloc(c, 16)
    assert set(again.tolist()) == set(first.tolist())
    assert pool.id_capacity == len(np.unique(first))


def test_one_alloc_hands_out_slots_in_offset_order():
    # Readers copy a run of adjacent slots with one copy: a fresh pool gives one run,
    # and slots freed in any order come back sorted.
    pool = Pool(64 * MiB)
    cls = pool.class_for(1 * MiB)
    first = pool.alloc(cls, 40)
    offsets = pool.offset[first]
    assert (np.diff(offsets) == pool.slot_bytes(cls)).all()
    rng = np.random.default_rng(0)
    pool.free(rng.permutation(first[:20]))
    again = pool.offset[pool.alloc(cls, 20)]
    assert (np.diff(again) > 0).all()


def test_an_emptied_extent_is_parked_for_its_class_and_given_up_for_another():
    """The last slot of an extent freed: its slabs are free at once (the class counts
    no extent, another class may take them), but its class's next page takes the same
    extent back, ids and offsets as they were; another class given its slabs makes it
    give its ids up, and they are handed out again."""
    pool = Pool(32 * MiB)
    small = pool.class_for(64 * 1024)
    first = pool.alloc(small, 1)
    where = int(pool.offset[first[0]])
    capacity = pool.id_capacity
    pool.free(first)
    for _ in range(3):                         # a put into an empty class, its delete
        pool.free(pool.alloc(small, 1))
        assert pool.class_extent_bytes(small) == 0 and pool.used_bytes == 0
        assert pool.free_slots(small) == 0 and pool.can_grow(small)
    again = pool.alloc(small, 1)
    assert int(pool.offset[again[0]]) == where and pool.id_capacity == capacity
    pool.free(again)
    big = pool.class_for(8 * MiB)
    taken = pool.alloc(big, 4)                 # every slab, the parked extent's too
    assert len(taken) == 4 and pool.alloc(small, 1).size == 0
    pool.free(taken)
    assert pool.alloc(small, 1).size == 1 and pool.id_capacity <= capacity + 4


def test_a_fragmented_pool_refills_its_part_free_extents_in_the_order_they_came_free():
    # Every extent half free, the extents' free slots come back in the order the
    # extents had a slot freed, an extent at a time: alloc takes the oldest one's first.
    pool = Pool(64 * MiB, slab_bytes=4 * MiB)
    cls = pool.class_for(1 * MiB)               # 4 slots an extent
    ids = pool.alloc(cls, 64)
    extent_of = {int(s): int(pool._extent_of[s]) for s in ids}
    freed = ids.reshape(16, 4)[::-1, ::2].reshape(-1)    # the last extent's first
    pool.free(freed.tolist())
    order = list(dict.fromkeys(extent_of[int(s)] for s in freed))
    taken = []
    while len(got := pool.alloc(cls, 1)):
        taken.append(extent_of[int(got[0])])
    assert taken == [e for e in order for _ in range(2)]
