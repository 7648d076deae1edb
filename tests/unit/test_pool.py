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
