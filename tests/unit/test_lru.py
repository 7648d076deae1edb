import numpy as np

from kvstore_server.store.lru import LRUPolicy


def test_victims_are_least_recent_first():
    lru = LRUPolicy(capacity=4)
    lru.touch(np.array([1, 2, 3]))
    lru.touch(np.array([1]))
    assert lru.victims(2).tolist() == [2, 3]
    assert lru.victims(10).tolist() == [2, 3, 1]


def test_touch_order_makes_last_id_most_recent():
    lru = LRUPolicy()
    # The store passes a prefix reversed: the head (0) last, so it stays hottest.
    prefix = np.array([10, 11, 12, 13])
    lru.touch(prefix[::-1])
    assert lru.victims(4).tolist() == [13, 12, 11, 10]


def test_remove_and_eligible_mask():
    lru = LRUPolicy()
    lru.touch(np.arange(6))
    lru.remove(np.array([0, 1]))
    eligible = np.ones(6, dtype=bool)
    eligible[2] = False
    assert lru.victims(3, eligible).tolist() == [3, 4, 5]
    assert lru.victims(0).size == 0


def test_grows_past_initial_capacity():
    lru = LRUPolicy(capacity=2)
    lru.touch(np.array([5000, 3]))
    assert lru.victims(5).tolist() == [5000, 3]
    assert lru.stamp(np.array([3, 99999])).tolist()[1] == 0


def test_remove_of_ids_never_touched():
    # A slot reserved and then aborted was never touched; its id may lie past the stamps.
    lru = LRUPolicy(capacity=4)
    lru.touch(np.array([1]))
    lru.remove(np.array([1, 2, 4000]))
    assert lru.victims(10).size == 0


def test_touch_span_orders_as_the_reversed_touch_and_grows():
    # touch_span(first, n) is touch() of first + n - 1 down to first: a run of slots
    # side by side, touched tail first, so first ends the most recent.
    by_span, by_ids = LRUPolicy(capacity=4), LRUPolicy(capacity=4)
    for lru in (by_span, by_ids):
        lru.touch(np.array([2, 3]))
    by_span.touch_span(5, 20)                 # past the initial capacity: grows
    by_ids.touch(np.arange(24, 4, -1))
    assert by_span.victims(30).tolist() == by_ids.victims(30).tolist()
    assert by_span.victims(30).tolist()[:3] == [2, 3, 24]
    by_span.touch(np.array([24]))             # stamps go on from where the span ended
    assert by_span.victims(30).tolist()[-2:] == [5, 24]
