"""The table of slots held back after their lease expired (kvstore_server/store/holdback.py)."""

import numpy as np

from kvstore_server.store.holdback import HoldBack
from kvstore_server.store.leases import footprint


def test_slots_go_when_their_own_time_comes_whatever_the_order_held():
    table = HoldBack()
    table.add(10.0, np.array([1, 2]))
    table.add(5.0, np.array([3]))              # held later, due sooner (a shorter lease)
    table.add(7.0, np.array([], dtype=np.int64))   # nothing to hold: not kept
    assert len(table) == 2 and table.pins == 3 and table.pages() == 3
    assert table.held == footprint(2) + footprint(1)
    assert table.due(4.9) == []
    assert [s.tolist() for s in table.due(5.0)] == [[3]]
    assert table.pins == 2 and table.pages() == 2 and table.held == footprint(2)
    assert [s.tolist() for s in table.due(100.0)] == [[1, 2]]
    assert len(table) == 0 and table.pins == 0 and table.pages() == 0 and table.held == 0


def test_take_all_empties_the_table_and_ties_do_not_compare_arrays():
    table = HoldBack()
    table.add(1.0, np.array([4, 4]))           # a slot may repeat: pinned twice
    table.add(1.0, np.array([5]))
    got = table.take_all()
    assert sorted(s.tolist() for s in got) == [[4, 4], [5]]
    assert len(table) == 0 and table.pins == 0 and table.pages() == 0 and table.held == 0
    assert table.due(2.0) == []


def test_pages_counts_each_slot_once_however_many_expired_leases_hold_it():
    """20 expired lookup leases of the same 10 pages: 200 pins, 10 pages (the stats once
    said "held_back_pages 200" of a pool of 10)."""
    table = HoldBack()
    for i in range(20):
        table.add(float(i), np.arange(10))
    assert len(table) == 20 and table.pins == 200 and table.pages() == 10
    table.due(9.0)                              # 10 of the 20 leases let go
    assert table.pins == 100 and table.pages() == 10
    table.due(100.0)
    assert table.pins == 0 and table.pages() == 0
