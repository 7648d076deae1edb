"""The disk tier's rule for pages it let go of, with a real server SIGKILLed just after:

- a page evicted to make room (not deleted) whose slot was not blanked yet may come back
  at restart. That is allowed, because it comes back as the right page for its key: its
  slot's header names its layout and key, its checksum is checked before it is served,
  and a key names its contents (the store never stores a key twice), so it is the page
  the key named when it was put. The rebuild then evicts down to the capacity;
- a page deleted never comes back, even one the tier had evicted just before the delete
  (a delete waits until every slot freed so far is blank or rewritten: disk/tier.py, _durable);
- an admin eviction of a layout or of everything is a delete.

Each round kills the server while its disk writer is busy with a spill, so that freed
slots are likely still unblanked at the kill; the rule must hold whether or not a page
came back (how many did is printed)."""

from __future__ import annotations

import signal

import numpy as np
import xxhash

from kvstore_client import KVStoreClient, PageLayout
from kvstore_testing.serverproc import ServerProcess
from tests.waiting import wait_for

LAYOUT = PageLayout(model="kill-evicted", num_layers=8, page_tokens=16, num_kv_heads=8,
                    head_size=64)                               # 256 KiB pages
DISK_PAGES = 64                                                 # a 16 MiB disk tier


def keys(tag, n):
    return [xxhash.xxh3_128_digest(f"{tag}:{i}".encode()) for i in range(n)]


def page(key: bytes) -> np.ndarray:
    """Each key's one page: what a key names never changes."""
    seed = int.from_bytes(key[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, LAYOUT.page_bytes, dtype=np.uint8)


def disk(client):
    return next(t for t in client.stats().tiers if t.name == "disk")


def served(client, ns, ks) -> set[bytes]:
    """The keys a server returns, each page checked byte-exact against its key."""
    got = set()
    for key in ks:
        try:
            data = client.get(ns, [key])[0]
        except KeyError:
            continue
        assert np.array_equal(data, page(key)), "a page came back other than its key's"
        got.add(key)
    return got


def spill(client, ns, ks) -> None:
    """Put pages and push them out of DRAM: the disk writer is busy with them after."""
    for start in range(0, len(ks), 16):
        chunk = ks[start:start + 16]
        client.put(ns, chunk, np.stack([page(k) for k in chunk]))
    client.evict(everything=True, tier="dram")


def test_evicted_pages_come_back_right_or_not_at_all_and_deleted_ones_never(tmp_path):
    flags = dict(dram="32MiB", disk=f"{DISK_PAGES // 4}MiB", disk_dir=str(tmp_path / "d"))
    srv = ServerProcess(**flags).start()
    deleted: set[bytes] = set()
    every: list[bytes] = []
    came_back = 0
    try:
        for r in range(4):
            with KVStoreClient(srv.address) as c:
                ns = c.register_layout(LAYOUT)
                old = keys(f"r{r}-old", DISK_PAGES // 2)
                spill(c, ns, old)
                assert wait_for(lambda: disk(c).pages >= len(old), timeout=30)
                new = keys(f"r{r}-new", DISK_PAGES // 2)
                spill(c, ns, new)                       # the writer is busy with these
                c.evict(nbytes=(DISK_PAGES // 2) * LAYOUT.page_bytes, tier="disk")
                gone = [k for k, held in zip(old, c.exists(ns, old)) if not held]
                if r % 2:                               # deleted after being evicted
                    c.delete(ns, gone[: len(gone) // 2] or old[:4])
                    deleted.update(gone[: len(gone) // 2] or old[:4])
                every += old + new
            srv.stop(signal.SIGKILL)
            srv = ServerProcess(port=srv.port, **flags).start()
            with KVStoreClient(srv.address) as c:
                ns = c.register_layout(LAYOUT)
                here = served(c, ns, every)             # byte-exact, or absent
                assert not here & deleted, "a deleted page came back"
                assert disk(c).pages <= DISK_PAGES
                came_back += len(here & (set(gone) - deleted))
        with KVStoreClient(srv.address) as c:            # an admin evict is a delete
            ns = c.register_layout(LAYOUT)
            spill(c, ns, keys("admin", DISK_PAGES // 2))
            c.evict(layout_id=ns.layout_id, tier="disk")
        srv.stop(signal.SIGKILL)
        srv = ServerProcess(port=srv.port, **flags).start()
        with KVStoreClient(srv.address) as c:
            assert not served(c, c.register_layout(LAYOUT), every + keys("admin", 32))
    finally:
        srv.stop()
    print(f"evicted pages that came back after a kill, byte-exact: {came_back}")
