"""Two Gets of one prefix held only below DRAM (the far tier, most often: a fleet's
shared system prompt) promote it once; the second waits for the first's read-back to
land instead of missing."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvstore_protocol.layout import PageLayout
from kvstore_server.errors import Outcome, StoreError
from kvstore_server.region import Region
from kvstore_server.store import Store
from kvstore_server.tier import NullTier

LAYOUT = PageLayout(model="t", num_layers=4, page_tokens=16, num_kv_heads=8, head_size=128)


class SlowBelow(NullTier):
    """Holds pages; a read of any takes `delay` (a far tier's fetch). Counts reads."""

    holds_pages = True

    def __init__(self, pages: dict[bytes, bytes], delay: float) -> None:
        self.pages, self.delay, self.read = pages, delay, 0
        self.reading = threading.Event()         # set when a read has begun

    def contains(self, layout_id, keys):
        return np.array([k in self.pages for k in keys], dtype=bool)

    def read_into(self, layout_id, keys, outs):
        if keys:
            self.reading.set()
            time.sleep(self.delay)
        for k, out in zip(keys, outs):
            memoryview(out).cast("B")[:] = self.pages[k]
        self.read += len(keys)
        return [True] * len(keys)


def test_a_second_get_waits_for_the_first_read_back_instead_of_missing():
    region = Region(16 << 20)
    try:
        store = Store(region)
        info = store.register_layout(LAYOUT)
        ks = [f"k{i}".encode().ljust(16, b"_") for i in range(4)]
        below = SlowBelow({k: bytes([i + 1]) * info.page_bytes for i, k in enumerate(ks)},
                          delay=0.3)
        store.lower = below
        got, errors = [], []

        def get():
            try:
                pinned = store.acquire(info.layout_id, ks)
                got.append([int(store.mem[off]) for off in pinned.offsets.tolist()])
                store.release(pinned.lease_id)
            except Exception as exc:  # noqa: BLE001 - NOT_FOUND before the fix
                errors.append(repr(exc))

        first, second = threading.Thread(target=get), threading.Thread(target=get)
        first.start()
        assert below.reading.wait(5)        # the first is reading from below now
        second.start()
        first.join(10)
        second.join(10)
        assert errors == []
        assert got == [[1, 2, 3, 4]] * 2
        assert below.read == 4              # read back once
    finally:
        region.close()


class CountingBelow(SlowBelow):
    """SlowBelow without the delay, counting the presence checks it is asked; a page
    it lacks reads as False."""

    def __init__(self, pages: dict[bytes, bytes]) -> None:
        super().__init__(pages, delay=0.0)
        self.asked = 0

    def contains(self, layout_id, keys):
        self.asked += 1
        return super().contains(layout_id, keys)

    def read_into(self, layout_id, keys, outs):
        """As a real tier: a page it lacks is a False, the others are read."""
        ok = [k in self.pages for k in keys]
        super().read_into(layout_id, [k for k, y in zip(keys, ok) if y],
                          [o for o, y in zip(outs, ok) if y])
        return ok


def _fill(store: Store, info, prefix: str, n: int) -> list[bytes]:
    keys = [f"{prefix}{i}".encode().ljust(16, b"_") for i in range(n)]
    res = store.reserve(info.layout_id, keys)
    for off in res.offsets.tolist():
        store.mem[off:off + info.page_bytes] = 9
    store.commit(res.lease_id)
    return keys


def test_with_room_free_a_read_back_skips_the_presence_check_and_misses_cleanly():
    """The far tier's presence check is a round trip: with the pool's room free, a read
    back reserves at once. Pages the tier lacks then cost only the aborted reservation:
    NOT_FOUND, the pool's use back where it was."""
    region = Region(16 << 20)
    try:
        store = Store(region)
        info = store.register_layout(LAYOUT)
        held = [f"h{i}".encode().ljust(16, b"_") for i in range(3)]
        below = CountingBelow({k: bytes([i + 5]) * info.page_bytes for i, k in enumerate(held)})
        store.lower = below
        pinned = store.acquire(info.layout_id, held)
        assert [int(store.mem[off]) for off in pinned.offsets.tolist()] == [5, 6, 7]
        store.release(pinned.lease_id)
        assert below.asked == 0
        used = store.pool.used_bytes
        with pytest.raises(StoreError) as info_exc:
            store.acquire(info.layout_id, [held[0], b"absent".ljust(16, b"_")])
        assert info_exc.value.outcome is Outcome.NOT_FOUND
        assert store.pool.used_bytes == used
    finally:
        region.close()


def test_with_the_pool_full_a_read_back_of_absent_pages_evicts_nothing():
    """Where reserving would evict, the tier below is asked first: a Get of pages it
    lacks leaves every DRAM page in place."""
    region = Region(16 << 20)
    try:
        store = Store(region)
        info = store.register_layout(LAYOUT)
        n = store.pool.free_bytes // info.page_bytes
        stored = _fill(store, info, "d", n)
        below = CountingBelow({})
        store.lower = below
        with pytest.raises(StoreError) as info_exc:
            store.acquire(info.layout_id, [b"absent".ljust(16, b"_")])
        assert info_exc.value.outcome is Outcome.NOT_FOUND
        assert below.asked == 1
        assert store.lookup([info.layout_id], stored)[0] == len(stored)
    finally:
        region.close()
