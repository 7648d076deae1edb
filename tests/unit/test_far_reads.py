"""Far reads in parts: the split is bounded by bytes, every page lands once in its place,
a part that fails is a miss for its pages only, and a read that stops leaves no part
running behind it (its pages land in buffers the caller is about to give up)."""

from __future__ import annotations

import threading
import time

import pytest

from kvstore_server.far import reads
from kvstore_server.far.reads import ParallelReader, split


def test_split_bounds_each_part_by_bytes_one_item_at_least():
    assert split([1, 1, 1, 1, 1], 2) == [(0, 2), (2, 4), (4, 5)]
    assert split([5, 1, 1], 2) == [(0, 1), (1, 3)]
    assert split([], 2) == []


def test_every_page_lands_once_in_its_place_and_a_failed_part_is_misses(monkeypatch):
    monkeypatch.setattr(reads, "PART_BYTES", 4 << 20)         # 4 pages a part
    def fetch(layout_id, keys, timeout, land, max_page):
        for i, k in enumerate(keys):           # a failed call: every page a miss
            land(i, None if b"k3" in keys else memoryview(k))

    keys = [b"k%d" % i for i in range(9)]
    reader = ParallelReader(fetch, 0.05, workers=4)
    landed = {}
    try:
        reader.read(b"L" * 16, keys, [1 << 20] * 9, lambda i, p: landed.setdefault(i, p))
    finally:
        reader.close()
    assert sorted(landed) == list(range(9))
    part = [i for i in range(9) if landed[i] is None]
    assert 3 in part and len(part) == 4 and part == list(range(part[0], part[0] + 4))
    assert all(bytes(landed[i]) == keys[i] for i in range(9) if i not in part)


def test_a_read_that_raises_has_no_part_running_when_it_returns(monkeypatch):
    monkeypatch.setattr(reads, "PART_BYTES", 1 << 20)         # a page a part
    monkeypatch.setattr(reads, "PARALLEL", 4)
    running, lock = [0], threading.Lock()

    def fetch(layout_id, keys, timeout, land, max_page):
        with lock:
            running[0] += 1
        try:
            time.sleep(0.05 if keys != [b"k0"] else 0)    # k0 lands first, the rest later
            for i, k in enumerate(keys):
                land(i, memoryview(k))
        finally:
            with lock:
                running[0] -= 1

    def land(i, page):
        if i == 0:
            raise RuntimeError("copy failed")

    reader = ParallelReader(fetch, 0.05, workers=4)
    try:
        with pytest.raises(RuntimeError):
            reader.read(b"L" * 16, [b"k%d" % i for i in range(8)], [1 << 20] * 8, land)
        assert running[0] == 0
    finally:
        reader.close()
