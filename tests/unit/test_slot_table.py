"""The slot table's pin counts (kvstore_server/store/slots.py): add_pins counts every entry,
repeats included, as np.add.at does, on its fast path and off it."""

import numpy as np
import pytest

from kvstore_server.store.slots import SlotTable


@pytest.mark.parametrize("seed", range(20))
def test_add_pins_counts_each_entry_like_add_at(seed):
    rng = np.random.default_rng(seed)
    table = SlotTable(64)
    expected = np.zeros(64, dtype=np.int32)
    for _ in range(30):
        n = int(rng.integers(0, 40))
        # Half the rounds distinct slots (the fast path), half with repeats.
        slots = (rng.permutation(64)[:n] if rng.random() < 0.5
                 else rng.integers(0, 64, n)).astype(np.int64)
        delta = int(rng.choice([1, -1, 2]))
        table.add_pins(slots, delta)
        np.add.at(expected, slots, delta)
        assert np.array_equal(table.pins, expected)


def test_a_slot_named_twice_is_pinned_twice_whatever_the_scratch_held():
    table = SlotTable(8)
    table.mark[:] = [0, 1, 2, 3, 4, 5, 6, 7]       # stale scratch that matches positions
    table.add_pins(np.array([3, 5, 3]), 1)
    assert table.pins.tolist() == [0, 0, 0, 2, 0, 1, 0, 0]
    table.add_pins(np.array([3, 3]), -1)
    assert table.pins[3] == 0
    table.grow(100)                                 # the scratch grows with the table
    table.add_pins(np.array([99, 98, 99]), 1)
    assert table.pins[98:].tolist() == [1, 2]
