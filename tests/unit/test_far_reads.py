"""Far reads in parts: the split is bounded by bytes, parts land in order, a part that
fails is a miss for its pages only."""

from __future__ import annotations

from kvstore_server.far import reads
from kvstore_server.far.reads import ParallelReader, split


def test_split_bounds_each_part_by_bytes_one_item_at_least():
    assert split([1, 1, 1, 1, 1], 2) == [(0, 2), (2, 4), (4, 5)]
    assert split([5, 1, 1], 2) == [(0, 1), (1, 3)]
    assert split([], 2) == []


def test_every_page_lands_once_in_its_place_and_a_failed_part_is_misses(monkeypatch):
    monkeypatch.setattr(reads, "PART_BYTES", 4 << 20)         # 4 pages a part
    def fetch(layout_id, keys, timeout):
        if b"k3" in keys:
            return [None] * len(keys)          # FarClient.get's answer to a failed call
        return [memoryview(k) for k in keys]

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
