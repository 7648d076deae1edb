"""The scheduler half's lease releases against a real server reached over a slow link:
the step that releases a finished request's lease does not wait for the store's answer
(a round trip per lease on the engine's loop), and the lease still ends on the server
by that release, long before it would expire."""

from __future__ import annotations

import time

import numpy as np

from kvstore_client import KVStoreClient, PageLayout
from kvstore_connector.config import ConnectorConfig, LookupMode
from kvstore_connector.scheduler import SchedulerHalf
from kvstore_connector.scheduler.hashing import page_keys

from ..waiting import wait_for
from .delayproxy import DelayProxies

LAYOUT = PageLayout(model="releases", num_layers=1, page_tokens=16, num_kv_heads=1,
                    head_size=64, dtype="bfloat16")
DELAY = 0.4                 # each client->server chunk, both paths
PAGES = 8


def test_a_step_does_not_wait_for_its_lease_releases(fresh_server):
    srv = fresh_server(dram="64MiB")
    tokens = np.arange(PAGES * 16 + 1, dtype=np.int32)
    keys = page_keys(tokens[:PAGES * 16], 16, LAYOUT.chain_seed)
    with KVStoreClient(srv.address, shared_memory=False) as direct:
        ns = direct.register_layout(LAYOUT)
        direct.put(ns, keys, np.zeros((PAGES, ns.page_bytes), np.uint8))
        port = int(srv.address.rsplit(":", 1)[1])
        proxies = DelayProxies([port, port + 1], DELAY)       # gRPC and the fast path
        try:
            client = KVStoreClient(f"127.0.0.1:{proxies.map[port]}", shared_memory=False,
                                   data_plane=True, retries=0, timeout=10.0,
                                   data_address=f"127.0.0.1:{proxies.map[port + 1]}")
            # A lease far longer than the test: it can only end by its release.
            config = ConnectorConfig(server=client.address, lookups=LookupMode.SYNC,
                                     lookup_timeout=10.0, lease_ms=120_000,
                                     shared_memory=False)
            sched = SchedulerHalf(config, [LAYOUT], 16, client=client)
            try:
                assert sched.hit("r", tokens, 0) == PAGES * 16
                sched.build()
                assert direct.stats().leases == 1
                started = time.perf_counter()
                sched.finished("r")
                sched.build()                   # sends the release
                took = time.perf_counter() - started
                assert took < DELAY / 2, f"the step waited {took:.3f} s for its release"
                wait_for(lambda: direct.stats().leases == 0, "the lease released",
                         timeout=10)
            finally:
                sched.close()
        finally:
            proxies.close()
