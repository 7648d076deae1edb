"""A tenant's quota holds for pages it reads back from the disk tier: they are its pages in
DRAM like the ones it puts (it used to reach six times its quota that way)."""

from __future__ import annotations

from kvstore_client import KVStoreClient
from kvstore_testing.serverproc import ServerProcess

from .test_auth import LAYOUT, TOKENS, auth_toml, keys, pages


def test_pages_read_back_from_disk_stay_within_the_quota(tmp_path):
    path = tmp_path / "auth.toml"
    path.write_text(auth_toml(small='quota = "1MiB"', b="", ops=""))

    with ServerProcess(dram="64MiB", disk="64MiB", disk_dir=str(tmp_path / "disk"),
                       auth_file=str(path)) as srv:
        def client(name):
            return KVStoreClient(srv.address, token=TOKENS[name], retries=0)

        with client("small") as s, client("b") as b, client("ops") as ops:
            hs, hb = s.register_layout(LAYOUT), b.register_layout(LAYOUT)
            old, new = keys("old", 4), keys("new", 4)              # 4 pages = the quota
            s.put(hs, old, pages(4, LAYOUT.page_bytes))
            ops.evict(everything=True)                             # old: on disk only
            s.put(hs, new, pages(4, LAYOUT.page_bytes, seed=1))
            theirs = keys("b", 100)
            b.put(hb, theirs, pages(100, LAYOUT.page_bytes, seed=2))
            got = s.get(hs, old)                                   # read back from disk
            assert (got == pages(4, LAYOUT.page_bytes)).all()
            tenants = {t.name: t for t in ops.stats().tenants}
            assert tenants["small"].used_bytes <= 1 << 20, tenants["small"]
            assert tenants["b"].pages == 100 and b.exists(hb, theirs) == [True] * 100
