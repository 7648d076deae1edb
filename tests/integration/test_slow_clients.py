"""Clients that are slow, not dead, past their lease: against a real server, over the
same-host data plane. An expired lease ends at once, but its slots are held back for
another --lease-ttl (kvstore_server/store/holdback.py), so a late write into a reserved slot,
or a late read of an acquired one, never meets another key's page."""

import time

import numpy as np
import pytest
import xxhash

from kvstore_client import KVStoreClient, KVStoreError, PageLayout
from tests.waiting import wait_for

# 512 KiB pages; a 16 MiB pool holds about thirty.
LAYOUT = PageLayout(model="slow", num_layers=4, page_tokens=16, num_kv_heads=8, head_size=256)
# The server's ttl: also how long an expired lease's slots are held back, so the margin
# a test's late write or read has after expiry (a loaded machine's fill takes ~1 s).
TTL_MS = 3000


def keys(tag, n):
    return [xxhash.xxh3_128_digest(f"{tag}:{i}".encode()) for i in range(n)]


@pytest.fixture
def small(fresh_server):
    srv = fresh_server(dram="16MiB", lease_ttl=f"{TTL_MS}ms")
    with KVStoreClient(srv.address, shared_memory=True) as client:
        yield client, client.register_layout(LAYOUT)


def _fill_twice_over(client, ns, pool_pages):
    """Put twice as many pages as the pool holds, one a call, each of its own byte;
    returns the keys and bytes of those still stored."""
    put = []
    for r, key in enumerate(keys("fill", 2 * pool_pages)):
        with client.reserve(ns, [key]) as res:
            res.views[0][:] = r % 251
        put.append((key, r % 251))
    stored = client.exists(ns, [k for k, _ in put])
    kept = [kf for kf, there in zip(put, stored) if there]
    assert len(kept) >= pool_pages // 2
    return kept


# lease_ms 0 is the server's ttl. A short lease is held back for the server's ttl too: its
# client may stall longer than twice its own (the write below comes well after 200 ms).
@pytest.mark.parametrize("lease_ms", [0, 100], ids=["server-ttl", "short-lease"])
def test_a_late_write_past_the_reservations_ttl_lands_in_no_other_page(small, lease_ms):
    client, ns = small
    slow = client.reserve(ns, keys("slow", 2), lease_ms=lease_ms)
    wait_for(lambda: client.stats().leases == 0, "the reservation to expire", timeout=10)
    assert client.stats().held_back_pages == 2
    pool_pages = client.stats().tiers[0].capacity_bytes // LAYOUT.page_bytes
    if lease_ms:
        time.sleep(2 * lease_ms / 1000)                     # past twice the lease's own
    stored = _fill_twice_over(client, ns, pool_pages)
    for view in slow.views:                                  # the late DMA write lands
        view[:] = 0xAA
    with pytest.raises(KVStoreError) as err:
        slow.commit()
    assert "expired" in str(err.value)
    got = client.get(ns, [k for k, _ in stored])
    for row, (_, fill) in zip(got, stored):
        assert (row == fill).all()
    assert client.lookup(ns, keys("slow", 2)) == 0
    # Held back another --lease-ttl, then let go.
    wait_for(lambda: client.stats().held_back_pages == 0, "the slots let go", timeout=10)
    assert client.stats().leased_pages == 0


def test_a_late_read_past_the_acquires_ttl_still_reads_its_own_pages(small):
    client, ns = small
    held = keys("held", 3)
    data = np.random.default_rng(1).integers(0, 256, (3, LAYOUT.page_bytes), dtype=np.uint8)
    client.put(ns, held, data)
    late = client.acquire(ns, held, lease_ms=TTL_MS)
    wait_for(lambda: client.stats().leases == 0, "the acquire to expire", timeout=10)
    assert client.delete(ns, held) == 3                      # invisible now, freed later
    pool_pages = client.stats().tiers[0].capacity_bytes // LAYOUT.page_bytes
    _fill_twice_over(client, ns, pool_pages)
    for view, page in zip(late.views, data):                 # the late copy out
        assert np.array_equal(np.asarray(view), page)
    wait_for(lambda: client.stats().held_back_pages == 0, "the pages let go", timeout=10)
    s = client.stats()
    assert s.leased_pages == 0 and s.leases == 0
