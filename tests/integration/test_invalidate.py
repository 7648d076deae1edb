"""kvstore-admin invalidate and Admin.Invalidate through real servers and a real cluster:
a model's (a revision's) pages leave DRAM, disk and the far tier of the whole fleet,
layouts only another server registered included, and nothing else does; a hung master
makes the command fail with what it removed; a tenant invalidates its own layouts only."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from kvstore_client import KVStoreClient, PageLayout
from kvstore_client.errors import KVStoreError
from kvstore_testing.serverproc import ServerProcess, sigstop
from tests.waiting import wait_for

from .test_admin_cli import admin
from .test_auth import TOKENS, auth_toml
from .test_far_faults import Cluster, far_tier, keys, pages

# 128 KiB pages, as test_far_faults' pages(); revisions r1 and r2 of one model, another
# model, and a layout of the model that only server B registers
R1 = PageLayout(model="inv-model", num_layers=4, page_tokens=16, num_kv_heads=8,
                head_size=64, salt="r1")
R2 = PageLayout(model="inv-model", num_layers=4, page_tokens=16, num_kv_heads=8,
                head_size=64, salt="r2")
OTHER = PageLayout(model="inv-other", num_layers=4, page_tokens=16, num_kv_heads=8,
                   head_size=64)
WARM = PageLayout(model="inv-warm", num_layers=4, page_tokens=16, num_kv_heads=8,
                  head_size=64)
ONLY_B = PageLayout(model="inv-model", num_layers=4, page_tokens=16, num_kv_heads=8,
                    head_size=64, tp_size=2, tp_rank=1)


def settle(*clients: KVStoreClient) -> None:
    """Wait until the servers' far-tier writes stop moving (for 1 s, 30 s at most)."""
    last, since = None, time.monotonic()
    while time.monotonic() - since < 30:
        now = [(far_tier(c).writes, far_tier(c).errors) for c in clients]
        if now != last:
            last, steady = now, time.monotonic()
        elif time.monotonic() - steady >= 1.0:
            return
        time.sleep(0.1)


def test_a_model_leaves_every_tier_of_the_fleet_and_nothing_else_does(fresh_cluster, tmp_path):
    cluster = fresh_cluster(masters=3)
    ns = "iv" + os.urandom(3).hex()
    flags = dict(far=",".join(cluster.urls), far_write="through", far_namespace=ns)
    with ServerProcess(dram="64MiB", disk="256MiB", disk_dir=str(tmp_path / "a"), **flags) as a, \
            ServerProcess(dram="64MiB", **flags) as b, \
            KVStoreClient(a.address) as ca, KVStoreClient(b.address) as cb:
        # Connections to every master first: a fresh server's first batches may fail
        # while it connects under load, and a failed batch is not written again
        for c in (ca, cb):
            c.put(c.register_layout(WARM), keys(32, "warm"), pages(32))
        settle(ca, cb)
        h1, h2, ho = (ca.register_layout(x) for x in (R1, R2, OTHER))
        hb = cb.register_layout(ONLY_B)
        on_disk, in_dram = keys(8, "disk"), keys(8, "dram")
        for n, h in enumerate((h1, h2, ho)):
            ca.put(h, on_disk, pages(8, n))
        ca.evict(everything=True)               # to A's disk (and through to the cluster)
        for n, h in enumerate((h1, h2, ho)):
            ca.put(h, in_dram, pages(8, 10 + n))
        cb.put(hb, in_dram, pages(8, 20))
        settle(ca, cb)
        ks = on_disk + in_dram
        direct = Cluster(cluster, ns)
        try:
            # A batch the cluster failed under load is not written again (a cache): what
            # is asserted is what the cluster holds, asked of the cluster
            held = {h.layout_id: direct.held(h.layout_id, ks) for h in (h1, h2, ho, hb)}
            assert all(held.values()), {k.hex(): len(v) for k, v in held.items()}
            # One revision: r2 goes, r1 and the other model stay
            out = admin(a.address, "invalidate", "--model", "inv-model", "--revision", "r2")
            assert out.returncode == 0, out.stderr
            assert "8 pages from DRAM, 8 from disk" in out.stdout, out.stdout
            assert direct.held(h2.layout_id, ks) == []
            assert ca.exists(h2, ks) == [False] * 16
            # The whole model, from A: B's layout too, which A never registered
            done = ca.admin.invalidate(model="inv-model")
            assert (done.dram_pages, done.disk_pages) == (8, 8)
            assert done.far_pages == len(held[h1.layout_id]) + len(held[hb.layout_id])
            assert {h1.layout_id, hb.layout_id} <= set(done.layout_ids)
            for h in (h1, h2, hb):
                assert direct.held(h.layout_id, ks) == []
            assert ca.exists(h1, ks) == [False] * 16
            # Untouched: the other model, in all three tiers
            assert direct.held(ho.layout_id, ks) == held[ho.layout_id]
            assert ca.exists(ho, ks) == [True] * 16
            tiers = {t.name: t for t in ca.stats().tiers}
            assert tiers["dram"].pages == 8 and tiers["disk"].pages == 8 + 32     # and WARM's
        finally:
            direct.close()


def test_a_hung_master_fails_the_command_with_what_it_removed(fresh_cluster):
    cluster = fresh_cluster(masters=3)
    ns = "ih" + os.urandom(3).hex()
    with ServerProcess(far=",".join(cluster.urls), far_write="through",
                       far_timeout="250ms", far_namespace=ns) as a, \
            KVStoreClient(a.address) as ca:
        h = ca.register_layout(R1)
        ks = keys(48, "ih")
        ca.put(h, ks, pages(48))
        settle(ca)              # a batch failed under load is a miss: not waited for
        victim = cluster.nodes[0]
        sigstop(victim.proc.pid)
        try:
            out = admin(a.address, "invalidate", "--model", "inv-model")
        finally:
            victim.proc.send_signal(signal.SIGCONT)
        assert out.returncode == 1, out.stdout
        assert "ABORTED" in out.stderr and "removed 48 pages from DRAM" in out.stderr, \
            out.stderr
        assert f"127.0.0.1:{victim.port}" in out.stderr, out.stderr
        direct = Cluster(cluster, ns)
        try:                                    # finished in the background
            assert wait_for(lambda: direct.held(h.layout_id, ks) == [],
                            "the invalidation to finish", timeout=15, interval=0.2)
        finally:
            direct.close()


@pytest.fixture
def auth_server(tmp_path):
    path = tmp_path / "auth.toml"
    path.write_text(auth_toml(a="", b="", ops=""))
    with ServerProcess(dram="64MiB", auth_file=str(path)) as server:
        yield server


def test_a_tenant_invalidates_its_own_layouts_only(auth_server):
    def client(name):
        return KVStoreClient(auth_server.address, token=TOKENS[name], retries=0)

    with client("a") as ca, client("b") as cb, client("ops") as ops:
        ha, hb = ca.register_layout(R1), cb.register_layout(R1)
        ks = keys(4, "t")
        ca.put(ha, ks, pages(4))
        cb.put(hb, ks, pages(4, 1))
        b_id = next(s.layout_id for s in ops.list_layouts() if s.tenant == "b")
        for scope in (dict(layout_id=b_id), dict(tenant="b")):
            with pytest.raises(KVStoreError) as info:
                ca.admin.invalidate(**scope)
            assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
            assert "its own layouts" in info.value.message
        done = ca.admin.invalidate(model="inv-model")   # narrowed to a's own
        assert done.dram_pages == 4
        assert cb.exists(hb, ks) == [True] * 4
        assert ca.exists(ha, ks) == [False] * 4
        ca.put(ha, ks, pages(4))
        assert ca.admin.invalidate(layout_id=R1.layout_id).dram_pages == 4   # its client id
        assert cb.exists(hb, ks) == [True] * 4
        assert ops.admin.invalidate(tenant="b").dram_pages == 4
