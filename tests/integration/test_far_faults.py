"""Routine faults of the far tier's cluster through real servers: a put-only host writes
again by itself after an outage; deletes are durable (never undone by a queued write,
retried while a master hangs or a breaker is open); an admin clear that cannot reach the
whole cluster says so in time; one hung master of three costs only its own slots."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import glide_sync as glide
import numpy as np
import pytest
import xxhash

from kvstore_client import KVStoreClient, PageLayout
from kvstore_server.far.keys import page_key
from kvstore_testing.serverproc import ServerProcess, sigstop
from tests.waiting import wait_for

from .test_admin_cli import admin

LAYOUT = PageLayout(model="far-faults", num_layers=4, page_tokens=16, num_kv_heads=8,
                    head_size=64)                               # 128 KiB pages


def keys(n, tag):
    return [xxhash.xxh3_128_digest(f"{tag}:{i}".encode()) for i in range(n)]


def pages(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, LAYOUT.page_bytes),
                                                dtype=np.uint8)


def far_tier(client):
    return next(t for t in client.stats().tiers if t.name == "far")


class Cluster:
    """A direct client of the cluster: what it holds, asked of the cluster itself."""

    def __init__(self, cluster, namespace: str) -> None:
        self.namespace = namespace
        self.client = glide.GlideClusterClient.create(glide.GlideClusterClientConfiguration(
            [glide.NodeAddress("127.0.0.1", n.port) for n in cluster.nodes if n.alive],
            request_timeout=2000))

    def held(self, layout_id: bytes, ks) -> list[bytes]:
        """The keys whose page name the cluster holds a value under."""
        return [k for k in ks
                if self.client.exists([page_key(self.namespace, layout_id, k)]) == 1]

    def close(self) -> None:
        self.client.close()


def test_a_put_only_server_writes_again_after_the_cluster_comes_back(fresh_cluster):
    # The prefill side of a hand-over only puts (write through) and never reads: its
    # writes alone must find the cluster again once it is back.
    cluster = fresh_cluster(masters=3)
    ns = "po" + os.urandom(3).hex()
    with ServerProcess(far=",".join(cluster.urls), far_write="through",
                       far_timeout="100ms", far_namespace=ns) as a, \
            KVStoreClient(a.address) as ca:
        na = ca.register_layout(LAYOUT)
        ca.put(na, keys(4, "before"), pages(4))
        assert wait_for(lambda: far_tier(ca).writes == 4, timeout=30)
        for node in cluster.nodes:
            cluster.kill(node)
        ca.put(na, keys(4, "down"), pages(4, 1))
        # Lookups that miss DRAM open the breakers at once (a write waits 2 s for a dead
        # node); after the restart this host only puts, as a prefill host does.
        assert wait_for(lambda: ca.lookup(na, keys(4, "x")) == 0 and
                        far_tier(ca).state != "reachable", "the breakers to open")
        for node in cluster.nodes:
            cluster.restart(node)               # back, empty (nothing persisted)
        cluster.wait_ok()
        direct = Cluster(cluster, ns)
        try:
            after: list[bytes] = []
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                batch = keys(4, f"after{len(after)}")
                ca.put(na, batch, pages(4, len(after)))         # puts only, no read
                after += batch
                if direct.held(na.layout_id, after):
                    break
                time.sleep(0.3)
            assert direct.held(na.layout_id, after), "no page reached the cluster again"
        finally:
            direct.close()
        assert far_tier(ca).state == "reachable"


def test_a_page_deleted_right_after_its_put_does_not_come_back(far_cluster):
    # Written through, its SET waits in the write-behind queue when the delete comes:
    # the delete must drop it (or order it before the UNLINK), never let it land after.
    ns = "dq" + os.urandom(3).hex()
    flags = dict(far=",".join(far_cluster.urls), far_namespace=ns, far_timeout="500ms")
    with ServerProcess(far_write="through", **flags) as a, KVStoreClient(a.address) as ca:
        na = ca.register_layout(LAYOUT)
        gone = []
        for round_ in range(4):
            ks = keys(40, f"q{round_}")
            ca.put(na, ks, pages(40, round_))           # 5 MiB: the queue is behind
            assert ca.delete(na, ks[:20]) == 20
            gone += ks[:20]
        direct = Cluster(far_cluster, ns)
        try:
            assert wait_for(lambda: len(direct.held(na.layout_id, keys(40, "q3"))) == 20,
                            "the last round's pages kept", timeout=20, interval=0.2)
            time.sleep(1.0)                     # a retried delete, a late write: both done
            assert direct.held(na.layout_id, gone) == []
        finally:
            direct.close()
        with ServerProcess(far_write="off", **flags) as b, KVStoreClient(b.address) as cb:
            assert cb.exists(cb.register_layout(LAYOUT), gone) == [False] * len(gone)


def _open_the_breakers(cluster, client, handle) -> None:
    """Hang every node until the server's far breakers open, then let them go on."""
    for node in cluster.nodes:
        sigstop(node.proc.pid)
    try:
        for _ in range(8):
            client.lookup(handle, keys(4, "probe"))
        assert far_tier(client).state != "reachable", far_tier(client)
    finally:
        for node in cluster.nodes:
            node.proc.send_signal(signal.SIGCONT)


def test_deletes_and_clears_while_the_breaker_is_open_are_not_skipped(fresh_cluster):
    cluster = fresh_cluster(masters=3)
    ns = "bo" + os.urandom(3).hex()
    with ServerProcess(far=",".join(cluster.urls), far_write="through",
                       far_timeout="100ms", far_namespace=ns) as a, \
            KVStoreClient(a.address) as ca:
        na = ca.register_layout(LAYOUT)
        deleted, cleared = keys(16, "del"), keys(16, "clr")
        ca.put(na, deleted + cleared, pages(32))
        assert wait_for(lambda: far_tier(ca).writes == 32, timeout=30)
        direct = Cluster(cluster, ns)
        try:
            assert len(direct.held(na.layout_id, deleted + cleared)) == 32
            _open_the_breakers(cluster, ca, na)
            # the cluster answers again; the breakers are still open (probe every 1 s)
            ca.delete(na, deleted)
            assert wait_for(lambda: direct.held(na.layout_id, deleted) == [],
                            "the deleted pages gone", interval=0.2)
            _open_the_breakers(cluster, ca, na)
            out = admin(a.address, "evict", "--tier", "far", "--all")
            assert out.returncode == 0, out.stderr
            assert "evicted 16 pages" in out.stdout, out.stdout
            assert direct.held(na.layout_id, cleared) == []
        finally:
            direct.close()


def test_an_evict_of_the_far_tier_during_a_hang_answers_in_time_and_finishes_later(
        fresh_cluster):
    cluster = fresh_cluster(masters=3)
    ns = "eh" + os.urandom(3).hex()
    with ServerProcess(far=",".join(cluster.urls), far_write="through",
                       far_timeout="250ms", far_namespace=ns) as a, \
            KVStoreClient(a.address) as ca:
        na = ca.register_layout(LAYOUT)
        ks = keys(48, "eh")
        ca.put(na, ks, pages(48))
        assert wait_for(lambda: far_tier(ca).writes == 48, timeout=30)
        victim = cluster.nodes[0]
        sigstop(victim.proc.pid)
        try:
            ca.put(na, keys(8, "queued"), pages(8, 1))  # some bound for the hung master
            t = time.monotonic()
            out = admin(a.address, "evict", "--tier", "far", "--all")
            elapsed = time.monotonic() - t
        finally:
            victim.proc.send_signal(signal.SIGCONT)
        assert elapsed < 5, f"{elapsed:.1f}s: kvstore-admin's own deadline is 5 s"
        assert out.returncode != 0, out.stdout
        assert "removed" in out.stderr and "did not finish" in out.stderr, out.stderr
        assert f"127.0.0.1:{victim.port}" in out.stderr, out.stderr
        direct = Cluster(cluster, ns)
        try:                                    # finished in the background
            assert wait_for(lambda: direct.held(na.layout_id, ks + keys(8, "queued")) == [],
                            "the clear to finish", timeout=15, interval=0.2)
        finally:
            direct.close()
        assert far_tier(ca).state == "reachable"


@pytest.mark.slow
def test_one_hung_master_of_three_costs_only_its_slots(fresh_cluster):
    """One master of three SIGSTOPped for 10 s under a mixed load from two servers (A
    puts and writes through, B reads A's pages with its DRAM emptied every round, both
    delete): B keeps serving the healthy slots' pages, no client sees an error, no page
    is wrong, and every page deleted before, during or after the hang is gone from the
    cluster once it ends."""
    cluster = fresh_cluster(masters=3, replicas=1)
    ns = "hg" + os.urandom(3).hex()
    flags = dict(far=",".join(cluster.urls), far_write="through", far_timeout="250ms",
                 far_namespace=ns)
    n_pages = 96
    ks, data = keys(n_pages, "hang"), pages(n_pages, 3)
    expected = dict(zip(ks, data))
    with ServerProcess(**flags) as a, ServerProcess(**flags) as b, \
            KVStoreClient(a.address) as ca, KVStoreClient(b.address) as cb:
        na, nb = ca.register_layout(LAYOUT), cb.register_layout(LAYOUT)
        ca.put(na, ks, data)
        assert wait_for(lambda: far_tier(ca).writes >= n_pages, timeout=30)
        for node in cluster.master_nodes():     # replicas hold every page first
            cluster.cli_call(node, "wait", "1", "2000")
        victim = cluster.master_nodes()[0]

        errors: list[str] = []
        wrong = 0
        served = {"before": 0, "during": 0, "after": 0}
        phase = ["before"]
        deleted: list[bytes] = []
        stop = threading.Event()

        def load() -> None:
            nonlocal wrong
            rng = np.random.default_rng(0)
            rounds = 0
            while not stop.is_set():
                rounds += 1
                try:
                    ca.put(na, keys(2, f"new{rounds}"), data[:2])
                    if rounds % 5 == 0:         # fresh pages deleted at once, by the
                        doomed = keys(4, f"doomed{rounds}")    # host that put them
                        c, h = (ca, na) if rounds % 10 else (cb, nb)
                        c.put(h, doomed, data[:4])
                        c.delete(h, doomed)
                        deleted.extend(doomed)
                    # B reads only pages no one deletes: a page B holds goes back to
                    # the cluster when B's DRAM lets it go, which a delete on A cannot
                    # prevent (docs/far.md, "Deletes and clears")
                    batch = [ks[24 + i] for i in rng.choice(n_pages - 24, 8, replace=False)]
                    held = cb.exists(nb, batch)
                    hits = [k for k, h in zip(batch, held) if h]
                    try:
                        got = cb.get(nb, hits) if hits else []
                    except KeyError:            # gone between exists and get: a miss
                        got = []
                    wrong += sum(not np.array_equal(p, expected[k]) for k, p in zip(hits, got))
                    served[phase[0]] += len(got)
                    cb.evict(everything=True, tier="dram")
                except Exception as exc:  # noqa: BLE001 - any error reaching a client counts
                    errors.append(repr(exc))

        thread = threading.Thread(target=load)
        thread.start()
        try:
            time.sleep(2)
            before = ks[:8]
            ca.delete(na, before)               # deleted before the hang
            deleted.extend(before)
            sigstop(victim.proc.pid)
            phase[0] = "during"
            # a server started while the master hangs serves the healthy slots' pages
            with ServerProcess(**{**flags, "far_write": "off"}) as c, \
                    KVStoreClient(c.address) as cc:
                nc = cc.register_layout(LAYOUT)
                fresh = sum(cc.exists(nc, ks[24:]))
            time.sleep(1)
            during = ks[8:16]
            t = time.monotonic()
            ca.delete(na, during)               # while the master hangs
            delete_s = time.monotonic() - t
            deleted.extend(during)
            time.sleep(7)
        finally:
            victim.proc.send_signal(signal.SIGCONT)
        phase[0] = "after"
        after = ks[16:24]
        ca.delete(na, after)
        deleted.extend(after)
        time.sleep(2)
        stop.set()
        thread.join(30)

    assert errors == [], errors[:5]
    assert wrong == 0
    assert served["during"] > 0, served         # the healthy slots kept serving
    assert fresh > 0, "a server started during the hang found no page"
    # a Delete asks the cluster twice (which keys it holds, then UNLINK), each within
    # --far-timeout (250 ms), never the 2 s of a write
    assert delete_s < 1.5, f"a delete during the hang took {delete_s:.2f}s"
    cluster.wait_ok()
    direct = Cluster(cluster, ns)
    try:
        with contextlib.suppress(AssertionError):          # what stayed is told below
            wait_for(lambda: not direct.held(na.layout_id, deleted), "the deleted pages gone",
                     timeout=15, interval=0.2)
        stayed = direct.held(na.layout_id, deleted)
        assert stayed == [], (f"{len(stayed)} of {len(deleted)} deleted pages stayed; of "
                              f"the 8 deleted before, during, after the hang: "
                              f"{[sum(k in stayed for k in p) for p in (before, during, after)]}")
        assert len(direct.held(na.layout_id, ks[24:])) > 0      # the names are right
    finally:
        direct.close()
