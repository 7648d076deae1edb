"""What the store's counters count, read from a real server the three ways an operator
reads them: Stats, kvstore-admin and /metrics.

Two readings from a real vLLM engine looked wrong (issue 40). After expired lookup
leases, stats said `pages 10 leases 0 leased_pages 10 held_back_pages 200`: held back
counted pins (20 leases x 10 pages), and leased pages counted held-back ones, so a
server with no lease looked like it leaked. And an engine looks a waiting request up
again, leased, at every step: the hit counter said ~7,500-8,000 pages for ~250 loaded.
Now pins are counted as pages, and pages served (Acquire, Get) apart from lookup hits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from kvstore_client import KVStoreClient, PageLayout
from kvstore_testing.serverproc import free_port
from tests.waiting import wait_for

LAYOUT = PageLayout(model="stats-counts", num_layers=2, page_tokens=16, num_kv_heads=2,
                    head_size=64)
KEYS = [f"counted-{i}".encode().ljust(16, b".") for i in range(10)]
LOOKUPS = 20


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def admin(address: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "kvstore_client.admin_cli", "--server",
                           address, *args], capture_output=True, text=True, timeout=60,
                          check=False, stdin=subprocess.DEVNULL, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def put_pages(c: KVStoreClient):
    ns = c.register_layout(LAYOUT)
    c.put(ns, KEYS, np.random.default_rng(7).integers(0, 256, (len(KEYS), ns.page_bytes),
                                                      np.uint8))
    return ns


def test_expired_lookup_leases_read_as_held_back_pages_not_as_leaks(fresh_server):
    """20 leased lookups of the same 10 pages, left to expire: while their pages are held
    back, there are no leases and no leased pages; 10 pages (not 200) held back, by 20
    expired leases; 10 pinned. Then the hold ends and nothing is pinned."""
    port = free_port()
    srv = fresh_server(dram="64MiB", lease_ttl="5s", metrics_port=port)
    with KVStoreClient(srv.address, shared_memory=False, data_plane=False) as c:
        ns = put_pages(c)
        for _ in range(LOOKUPS):
            assert c.lookup_lease(ns, KEYS, lease_ms=300).count == len(KEYS)
        wait_for(lambda: c.stats().leases == 0, "the lookup leases to expire", timeout=10)
        s = c.stats()
        metrics = scrape(port)
        text = admin(srv.address, "stats")
        data = json.loads(admin(srv.address, "stats", "--json"))
        assert s.tiers[0].pages == 10 and s.leases == 0
        assert s.held_back_pages == 10, s           # pages, not 20 x 10 pins
        assert s.leased_pages == 0, s               # no live lease pins anything
        assert s.held_back_leases == LOOKUPS and s.pinned_pages == 10, s
        assert metrics[("kvstore_leased_pages", ())] == 0
        assert metrics[("kvstore_held_back_pages", ())] == 10
        assert metrics[("kvstore_held_back_leases", ())] == LOOKUPS
        assert metrics[("kvstore_pinned_pages", ())] == 10
        assert (data["leases"], data["leased_pages"], data["held_back_pages"],
                data["held_back_leases"], data["pinned_pages"]) == (0, 0, 10, LOOKUPS, 10)
        assert "leased pages 0" in text
        assert f"held back 10 pages (of {LOOKUPS} expired leases)" in text, text

        wait_for(lambda: c.stats().pinned_pages == 0, "the held-back pages let go",
                 timeout=15)
        s = c.stats()
        assert (s.leased_pages, s.held_back_pages, s.held_back_leases) == (0, 0, 0)


def test_a_page_looked_up_again_and_again_is_served_once_when_read(fresh_server):
    """An engine's pattern: the same 10 pages looked up, leased and released 20 times (a
    request waiting for KV blocks, at every step), then read once with Get over gRPC and
    once with Acquire on the fast path. Lookup hits count 200; pages served count 20,
    in Stats (tier and layout), kvstore-admin and /metrics."""
    port = free_port()
    srv = fresh_server(dram="64MiB", metrics_port=port)
    with KVStoreClient(srv.address, shared_memory=False, data_plane=False) as c:
        ns = put_pages(c)
        for _ in range(LOOKUPS):
            lease = c.lookup_lease(ns, KEYS, lease_ms=5000)
            assert lease.count == len(KEYS)
            c.release_lease(lease)
        s = c.stats()
        assert (s.tiers[0].hits, s.tiers[0].served) == (LOOKUPS * len(KEYS), 0)
        c.get(ns, KEYS)                             # gRPC Get
    with KVStoreClient(srv.address, shared_memory=True, data_plane=True) as fast:
        fns = fast.register_layout(LAYOUT)
        with fast.acquire(fns, KEYS) as pinned:     # the fast path's Acquire
            assert len(pinned.views) == len(KEYS)
        s = fast.stats()
    dram = s.tiers[0]
    assert dram.name == "dram"
    assert dram.hits == LOOKUPS * len(KEYS) and dram.misses == 0
    assert dram.served == 2 * len(KEYS), dram
    assert [lay.served for lay in s.layouts] == [2 * len(KEYS)]
    metrics = scrape(port)
    assert metrics[("kvstore_served_pages_total", (("tier", "dram"),))] == 2 * len(KEYS)
    assert metrics[("kvstore_hits_total", (("tier", "dram"),))] == LOOKUPS * len(KEYS)
    data = json.loads(admin(srv.address, "stats", "--json"))
    assert data["tiers"][0]["served"] == 2 * len(KEYS)
    assert data["tiers"][0]["hits"] == LOOKUPS * len(KEYS)
    text = admin(srv.address, "stats")
    assert "served" in text and "lookup hits" in text and "lookup hit rate" in text


LAYOUT_RANK1 = PageLayout(model="stats-counts", num_layers=2, page_tokens=16, num_kv_heads=2,
                          head_size=64, tp_rank=1, tp_size=2)


def test_pages_read_under_a_leased_lookups_pins_are_served_once(fresh_server):
    """A same-host engine reads a leased lookup's pages from the pool with no Acquire
    (fastwire.PINS), so only its release can say they were read: pages_read counts, per
    layout of the lease (here two TP ranks' of 10 pages), at most the lease's pages,
    once (a second release of the lease is refused, and counts nothing); a release that
    names no pages read counts none. Over the fast path (with pins) and over gRPC."""
    srv = fresh_server(dram="64MiB")
    with KVStoreClient(srv.address, shared_memory=True, data_plane=True) as fast, \
            KVStoreClient(srv.address, shared_memory=False, data_plane=False) as rpc:
        handles = [put_pages(fast), fast.register_layout(LAYOUT_RANK1)]
        fast.put(handles[1], KEYS, np.zeros((len(KEYS), handles[1].page_bytes), np.uint8))

        def served() -> list[int]:
            return sorted(lay.served for lay in fast.stats().layouts)

        lease = fast.lookup_lease(handles, KEYS, lease_ms=5000, pins=True)
        assert lease.count == len(KEYS) and lease.pins is not None
        assert fast.release_lease(lease, pages_read=6)
        assert served() == [6, 6]
        assert not fast.release_lease(lease, pages_read=6)       # once
        assert served() == [6, 6]
        lease = fast.lookup_lease(handles, KEYS, lease_ms=5000, pins=True)
        assert fast.release_lease(lease)                           # read nothing
        assert served() == [6, 6]
        rpc_handles = [rpc.register_layout(LAYOUT), rpc.register_layout(LAYOUT_RANK1)]
        lease = rpc.lookup_lease(rpc_handles, KEYS[:4], lease_ms=5000)
        assert rpc.release_lease(lease, pages_read=100)            # at most the lease's
        assert not rpc.release_lease(lease, pages_read=4)
        s = fast.stats()
    assert sorted(lay.served for lay in s.layouts) == [10, 10]
    assert s.tiers[0].served == 20 and s.leases == 0


def test_a_release_sent_without_waiting_ends_the_lease_and_counts_pages_read(fresh_server):
    """release_lease_later (a remote engine's release, one round trip less): over the fast
    path (a quiet RELEASE, no answer) and over gRPC alike, the lease ends, its pages_read
    count as served, and the next call on the connection gets its own answer."""
    srv = fresh_server(dram="64MiB")
    with KVStoreClient(srv.address, shared_memory=False, data_plane=True) as fast, \
            KVStoreClient(srv.address, shared_memory=False, data_plane=False) as rpc:
        ns = put_pages(fast)
        for c, read in ((fast, 3), (rpc, 4)):
            lease = c.lookup_lease(c.register_layout(LAYOUT), KEYS, lease_ms=60_000)
            assert lease.count == len(KEYS) and lease.lease_id
            c.release_lease_later(lease, pages_read=read)
            assert c.lookup(ns, KEYS[:2]) == 2            # the next call's own answer
            wait_for(lambda: fast.stats().leases == 0, timeout=10)
        c.release_lease_later(0)                          # no lease: nothing sent
        s = fast.stats()
    assert [lay.served for lay in s.layouts] == [7] and s.leases == 0
