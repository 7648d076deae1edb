"""The store's write-through tier (the far tier under --far-write through): every commit
offers its pages, byte-exact, outside the store's lock and with the slots pinned while
they are copied; a page read back from the tiers below is not written back."""

from __future__ import annotations

import threading

import numpy as np

from kvstore_protocol.layout import PageLayout
from kvstore_server.region import Region
from kvstore_server.store import Store
from kvstore_server.tier import NullTier

LAYOUT = PageLayout(model="t", num_layers=4, page_tokens=16, num_kv_heads=8, head_size=128)


class Recorder(NullTier):
    """Takes copies of what it is offered and notes what the store held meanwhile."""

    holds_pages = True

    def __init__(self) -> None:
        self.store = None
        self.pages: dict[bytes, bytes] = {}
        self.lock_held: list[bool] = []
        self.pinned: list[bool] = []

    def offer(self, layout_id, key, page) -> bool:
        self.pages[key] = bytes(page)
        # Another caller asks the store meanwhile: answered only while its lock is free.
        seen: list = []
        asker = threading.Thread(target=lambda: seen.append(self.store.stats()), daemon=True)
        asker.start()
        asker.join(5)
        self.lock_held.append(not seen)
        self.pinned.append(bool(seen) and seen[0].pinned_pages > 0)
        return True

    def read_into(self, layout_id, keys, outs):
        for key, out in zip(keys, outs):
            memoryview(out).cast("B")[:] = self.pages[key]
        return [True] * len(keys)

    def contains(self, layout_id, keys):
        return np.array([k in self.pages for k in keys], dtype=bool)


def test_commit_offers_each_page_outside_the_lock_pinned():
    far = Recorder()
    region = Region(16 << 20)
    try:
        store = Store(region, lower=far, through=far)
        far.store = store
        info = store.register_layout(LAYOUT)
        ks = [f"k{i}".encode().ljust(16, b"_") for i in range(4)]
        res = store.reserve(info.layout_id, ks)
        for i, off in enumerate(res.offsets.tolist()):
            store.mem[off:off + info.page_bytes] = i + 1
        assert store.commit(res.lease_id) == 4
        assert sorted(far.pages) == sorted(ks)
        assert all(far.pages[k] == bytes([i + 1]) * info.page_bytes for i, k in enumerate(ks))
        assert far.lock_held == [False] * 4 and far.pinned == [True] * 4
        assert store.stats().pinned_pages == 0                  # unpinned after
        # read back from below into DRAM: promoted, not offered again
        store.evict(everything=True)
        offered = len(far.lock_held)
        pinned = store.acquire(info.layout_id, ks)
        store.release(pinned.lease_id)
        assert store.promotions == 4 and len(far.lock_held) == offered
    finally:
        region.close()
