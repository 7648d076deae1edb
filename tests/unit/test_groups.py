"""connector.groups without an engine: a sliding group's window and each group's share of a
step's plan (the bytes a full hit moves per group follow from it)."""

from __future__ import annotations

import numpy as np

from kvstore_connector.groups import NULL_BLOCK, CacheGroup, GroupKind, for_group
from kvstore_connector.meta import LoadSpec, PagePins, SaveSpec, StepMeta

T = 16                                            # tokens per page
FULL = CacheGroup(0, GroupKind.FULL, ("l0", "l2"), 4, 16, "float32", False)
SLIDING = CacheGroup(1, GroupKind.SLIDING, ("l1", "l3"), 4, 16, "float32", False, reach=39)
DRAFT = CacheGroup(2, GroupKind.DRAFT, ("d0",), 4, 16, "float32", False)


def test_a_sliding_group_needs_only_the_pages_its_window_reaches():
    # 144 tokens: the next token reads 105..143, pages 6, 7 and 8.
    assert SLIDING.first_page(9, T) == 6
    assert SLIDING.first_page(2, T) == 0          # the window reaches the start
    assert FULL.first_page(9, T) == 0 and DRAFT.first_page(9, T) == 0
    # Never more than ceil(reach / page_tokens) + 1 pages, wherever the prefix ends.
    assert max(n - SLIDING.first_page(n, T) for n in range(1, 200)) <= -(-39 // T) + 1


def _rows(first: int, pages: int, null_below: int = 0) -> np.ndarray:
    ids = np.arange(first, first + pages, dtype=np.int64) + 100
    ids[:max(0, null_below - first)] = NULL_BLOCK
    return ids.reshape(pages, 1)


def test_each_group_loads_its_own_blocks_and_a_sliding_one_only_its_window():
    keys = tuple(bytes([i]) * 16 for i in range(9))
    full_rows, sliding_rows = _rows(0, 9), _rows(0, 9, null_below=6) + 1000
    sliding_rows[:6] = NULL_BLOCK                 # vLLM's null block outside the window
    offsets = {b"full-layout": np.arange(9) * 10, b"sliding-layout": np.arange(9) * 20}
    load = LoadSpec("r", keys, full_rows, True, 7, PagePins(1, 0.0, offsets), 0,
                    (full_rows, sliding_rows))
    step = StepMeta(loads=(load,))

    full = for_group(step, FULL, T).loads[0]
    assert full.keys == keys and full.block_ids.tolist() == full_rows.tolist()
    assert full.group_blocks == () and full.load_id == 7

    window = for_group(step, SLIDING, T).loads[0]
    assert window.keys == keys[6:] and window.first_page == 6
    assert window.block_ids.reshape(-1).tolist() == sliding_rows[6:].reshape(-1).tolist()
    assert window.pins is not None
    assert window.pins.offsets[b"sliding-layout"].tolist() == [120, 140, 160]
    # Bytes moved for this full hit, in pages: 9 for full attention, 3 for the window.
    assert len(full.keys) + len(window.keys) == 12 < 2 * len(keys)


def test_a_load_that_begins_past_the_window_start_keeps_all_its_pages():
    keys = tuple(bytes([i]) * 16 for i in range(2))
    rows = _rows(7, 2)
    step = StepMeta(loads=(LoadSpec("r", keys, rows, True, 1, None, 7, (rows, rows + 50)),))
    sliding = for_group(step, SLIDING, T).loads[0]
    assert sliding.keys == keys and sliding.first_page == 7


def test_a_save_never_stores_a_null_block_and_a_group_with_nothing_gets_no_spec():
    keys = tuple(bytes([i]) * 16 for i in range(4))
    full_rows = _rows(0, 4)
    sliding_rows = full_rows + 1000
    sliding_rows[:2] = NULL_BLOCK                 # pages a local hit held outside the window
    save = SaveSpec("r", keys, full_rows, (), (full_rows, sliding_rows))
    assert for_group(StepMeta(saves=(save,)), FULL, T).saves[0].keys == keys
    sliding = for_group(StepMeta(saves=(save,)), SLIDING, T).saves[0]
    assert sliding.keys == keys[2:]
    all_null = SaveSpec("r", keys[:2], full_rows[:2], (),
                        (full_rows[:2], np.zeros((2, 1), dtype=np.int64)))
    assert for_group(StepMeta(saves=(all_null,)), SLIDING, T).saves == ()


MAMBA = CacheGroup(1, GroupKind.MAMBA, ("m1", "m3"), 1, 1, "uint8", False, block_size=T,
                   state_bytes=6912)


def test_a_mamba_group_loads_only_the_state_at_the_hits_end():
    # vLLM's align mode: null blocks for the skipped states, a block for the hit's state.
    keys = tuple(bytes([i]) * 16 for i in range(9))
    full_rows = _rows(0, 9)
    state_rows = np.full((9, 1), NULL_BLOCK, dtype=np.int64)
    state_rows[8] = 555
    load = LoadSpec("r", keys, full_rows, True, 3, None, 0, (full_rows, state_rows))
    state = for_group(StepMeta(loads=(load,)), MAMBA, T).loads[0]
    assert state.keys == keys[8:] and state.first_page == 8
    assert state.block_ids.tolist() == [[555]]
    assert MAMBA.first_page(9, T) == 8 and MAMBA.first_page(0, T) == 0


def test_a_mamba_save_keeps_only_the_states_its_step_wrote():
    from kvstore_connector.scheduler.mamba import StateCheckpoints, saveable_rows
    rows = np.arange(100, 110, dtype=np.int64).reshape(10, 1)
    # Pages 0..9 saved in a step that computed tokens 96..160: the state at its end (160,
    # page 9) and at vLLM's prefill checkpoint (144, page 8, in the block before).
    kept = saveable_rows(rows, 0, 96, 160, T, StateCheckpoints(T))
    assert kept.reshape(-1).tolist() == [NULL_BLOCK] * 8 + [108, 109]
    assert rows[0, 0] == 100                      # the input is left as it was
    # No checkpoints known: the chunk's end only.
    assert saveable_rows(rows, 0, 96, 160, T).reshape(-1).tolist() == [NULL_BLOCK] * 9 + [109]
    # A step that ends inside a page writes no state at a page boundary ...
    assert saveable_rows(rows[:2], 8, 150, 170, T).reshape(-1).tolist() == [NULL_BLOCK] * 2
    # ... and with hits finer than a block, its checkpoint (168) lies inside block 9.
    fine = saveable_rows(rows[:2], 8, 100, 170, T, StateCheckpoints(4))
    assert fine.reshape(-1).tolist() == [NULL_BLOCK] * 2
    # A checkpoint of an earlier step's range is not this step's to save.
    assert saveable_rows(rows[8:], 8, 150, 160, T, StateCheckpoints(T)).reshape(-1).tolist() \
        == [NULL_BLOCK, 109]
