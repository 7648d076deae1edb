"""A tenant's quota holds for pages it reads back from the far tier, as for the disk tier:
a page promoted from the cluster is its page in DRAM like one it puts."""

from __future__ import annotations

import os

from kvstore_client import KVStoreClient
from kvstore_testing.serverproc import ServerProcess
from tests.waiting import wait_for

from .test_auth import LAYOUT, TOKENS, auth_toml, keys, pages


def test_pages_read_back_from_the_far_tier_stay_within_the_quota(tmp_path, far_cluster):
    path = tmp_path / "auth.toml"
    path.write_text(auth_toml(small='quota = "1MiB"', b="", ops=""))

    with ServerProcess(dram="64MiB", auth_file=str(path), far=",".join(far_cluster.urls),
                       far_namespace="q" + os.urandom(4).hex(), far_timeout="500ms") as srv:
        def client(name):
            return KVStoreClient(srv.address, token=TOKENS[name], retries=0)

        with client("small") as s, client("b") as b, client("ops") as ops:
            hs, hb = s.register_layout(LAYOUT), b.register_layout(LAYOUT)
            old, new = keys("old", 4), keys("new", 4)              # 4 pages = the quota
            s.put(hs, old, pages(4, LAYOUT.page_bytes))
            ops.evict(everything=True)                             # old: far tier only
            wait_for(lambda: s.lookup(hs, old) == 4, "old written behind to the far tier",
                     timeout=10, interval=0.05)
            s.put(hs, new, pages(4, LAYOUT.page_bytes, seed=1))
            theirs = keys("b", 100)
            b.put(hb, theirs, pages(100, LAYOUT.page_bytes, seed=2))
            got = s.get(hs, old)                                   # read back from far
            assert (got == pages(4, LAYOUT.page_bytes)).all()
            far = next(t for t in ops.stats().tiers if t.name == "far")
            assert far.reads >= 4
            tenants = {t.name: t for t in ops.stats().tenants}
            assert tenants["small"].used_bytes <= 1 << 20, tenants["small"]
            assert tenants["b"].pages == 100 and b.exists(hb, theirs) == [True] * 100
