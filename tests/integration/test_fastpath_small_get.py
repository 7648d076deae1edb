"""Small Gets against a real kvstore-server while their pages are overwritten and evicted:
every page that comes back is whole and its own key's, never torn between two writes nor
another key's (the pins a Get takes keep its slots from reuse until its pages are sent)."""

from __future__ import annotations

import threading
import time

import numpy as np

from kvstore_client import KVStoreClient, KVStoreError, PageLayout
from kvstore_client.buffers import page_aligned_empty
from kvstore_testing.serverproc import ServerProcess

LAYOUT = PageLayout(model="small-get-race", num_layers=32, page_tokens=16, num_kv_heads=1,
                    head_size=32)                                       # 64 KiB pages
RACED = 8
SECONDS = 3.0


def _key(i: int) -> bytes:
    return f"raced-{i}".encode().ljust(20, b".")


def _page(key: bytes, gen: int, page_bytes: int) -> np.ndarray:
    """The key's first 16 bytes, then one byte of its generation throughout."""
    page = np.full(page_bytes, gen % 256, dtype=np.uint8)
    page[:16] = np.frombuffer(key[:16], dtype=np.uint8)
    return page


def _whole(page: np.ndarray, key: bytes) -> bool:
    return page[:16].tobytes() == key[:16] and bool((page[16:] == page[16]).all())


def test_a_small_get_racing_overwrites_and_evictions_is_never_torn():
    # A pool of 256 pages: the filler's puts evict the raced pages again and again.
    with ServerProcess(dram="16MiB") as srv, \
            KVStoreClient(srv.address, shared_memory=False, data_plane=True) as writer, \
            KVStoreClient(srv.address, shared_memory=False, data_plane=True) as reader:
        ns = writer.register_layout(LAYOUT)
        pb = ns.page_bytes
        stop = threading.Event()
        failures: list[BaseException] = []

        def overwrite() -> None:
            gen = 0
            try:
                while not stop.is_set():
                    gen += 1
                    for i in range(RACED):
                        key = _key(i)
                        writer.delete(ns, [key])
                        writer.put(ns, [key], _page(key, gen, pb)[None])
            except BaseException as exc:         # noqa: BLE001 - reported by the test
                failures.append(exc)

        def fill() -> None:
            n = 0
            try:
                with KVStoreClient(srv.address, shared_memory=False, data_plane=True) as c:
                    filler = c.register_layout(LAYOUT)
                    block = np.zeros((16, pb), dtype=np.uint8)
                    while not stop.is_set():
                        c.put(filler, [f"fill-{n}-{j}".encode().ljust(20, b".") for j in range(16)],
                              block)
                        n += 1
            except BaseException as exc:         # noqa: BLE001 - reported by the test
                failures.append(exc)

        threads = [threading.Thread(target=overwrite), threading.Thread(target=fill)]
        for t in threads:
            t.start()
        ok = missing = 0
        out = page_aligned_empty((2, pb))
        deadline = time.monotonic() + SECONDS
        try:
            while time.monotonic() < deadline and not failures:
                for pair in ((0, 1), (2, 2), (3,)):
                    ks = [_key(i) for i in pair]
                    try:
                        reader.get_into(ns, ks, out[:len(ks)])
                    except KVStoreError:            # deleted or evicted just now
                        missing += 1
                        continue
                    for page, key in zip(out[:len(ks)], ks, strict=True):
                        assert _whole(page, key), f"a torn or foreign page for {key!r}"
                    ok += 1
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        assert not failures, failures
        assert ok >= 50, (ok, missing)      # the race was run, not only missed
