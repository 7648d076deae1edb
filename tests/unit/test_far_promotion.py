"""Two Gets of one prefix held only below DRAM (the far tier, most often: a fleet's
shared system prompt) promote it once; the second waits for the first's read-back to
land instead of missing."""

from __future__ import annotations

import threading
import time

import numpy as np

from kvstore_client.layout import PageLayout
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
