"""The same-host data plane against a real server: two-phase puts, leased gets, crashes."""

import os
import signal
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import xxhash

from kvstore_client import KVStoreClient, KVStoreError, PageLayout
from kvstore_testing.serverproc import ServerProcess
from tests.waiting import wait_for

LAYOUT = PageLayout(model="shm", num_layers=4, page_tokens=16, num_kv_heads=2, head_size=64)


def keys(tag, n):
    return [xxhash.xxh3_128_digest(f"{tag}:{i}".encode()) for i in range(n)]


def pages(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, LAYOUT.page_bytes), dtype=np.uint8)


def test_two_phase_put_and_leased_get(server):
    with KVStoreClient(server.address, shared_memory=True) as c:
        ns = c.register_layout(LAYOUT)
        ks, data = keys("two-phase", 5), pages(5)
        with c.reserve(ns, ks[:3]) as res:
            assert res.skipped == 0 and all(v is not None for v in res.views)
            for view, page in zip(res.views, data):
                view[:] = page
            assert c.lookup(ns, ks) == 0             # invisible until commit
        assert c.lookup(ns, ks) == 3                 # committed on leaving the block
        res = c.reserve(ns, ks)
        assert res.skipped == 3 and res.views[:3] == [None] * 3
        for view, page in zip(res.views[3:], data[3:]):
            view[:] = page
        assert res.commit() == 2
        with c.acquire(ns, ks) as acq:
            for view, page in zip(acq.views, data):
                assert np.array_equal(view, page)
                assert not view.flags.writeable
            assert c.stats().leased_pages == 5
            lb = ns.layer_bytes
            assert np.array_equal(acq.layer(2)[4], data[4, 2 * lb:3 * lb])
        wait_for(lambda: c.stats().leased_pages == 0)    # the release is sent async


def test_abort_and_exception_leave_nothing_visible(server):
    with KVStoreClient(server.address, shared_memory=True) as c:
        ns = c.register_layout(LAYOUT)
        ks = keys("aborted", 3)
        used = c.stats().tiers[0].used_bytes
        res = c.reserve(ns, ks)
        res.abort()
        with pytest.raises(RuntimeError):
            with c.reserve(ns, ks) as res:
                res.views[0][:] = 1
                raise RuntimeError("engine failed mid-write")
        assert c.lookup(ns, ks) == 0 and c.stats().tiers[0].used_bytes == used


def test_acquire_missing_is_not_found(server):
    with KVStoreClient(server.address, shared_memory=True) as c:
        ns = c.register_layout(LAYOUT)
        with pytest.raises(KVStoreError) as err:
            c.acquire(ns, keys("absent", 1))
        assert err.value.code.name == "NOT_FOUND"
        with pytest.raises(KeyError):
            c.get(ns, keys("absent", 1))


def test_both_paths_see_the_same_pages(server):
    with KVStoreClient(server.address, shared_memory=True) as shm, \
            KVStoreClient(server.address, shared_memory=False) as remote:
        ns_a, ns_b = shm.register_layout(LAYOUT), remote.register_layout(LAYOUT)
        data = pages(4, seed=9)
        shm.put(ns_a, keys("cross-a", 4), data)
        remote.put(ns_b, keys("cross-b", 4), data)
        assert np.array_equal(remote.get(ns_b, keys("cross-a", 4)), data)
        assert np.array_equal(shm.get(ns_a, keys("cross-b", 4)), data)
        layers = dict(shm.get_layers(ns_a, keys("cross-b", 4)))
        assert np.array_equal(layers[3], data[:, 3 * ns_a.layer_bytes:])


def test_reservation_lease_expires(fresh_server):
    srv = fresh_server(lease_ttl="1s")
    with KVStoreClient(srv.address, shared_memory=True) as c:
        ns = c.register_layout(LAYOUT)
        ks = keys("expire", 4)
        res = c.reserve(ns, ks, lease_ms=200)
        wait_for(lambda: c.stats().leases == 0, "the reservation to expire")
        # Its slots are held back another --lease-ttl (1 s), in case the client is slow.
        wait_for(lambda: c.stats().tiers[0].used_bytes == 0, "the slots to go free")
        assert c.stats().held_back_pages == 0
        with pytest.raises(KVStoreError) as err:
            res.commit()
        assert err.value.code.name == "FAILED_PRECONDITION"
        assert c.lookup(ns, ks) == 0


CRASHER = textwrap.dedent("""
    import sys, time, numpy as np, xxhash
    from kvstore_client import KVStoreClient, PageLayout
    layout = PageLayout(model="shm", num_layers=4, page_tokens=16, num_kv_heads=2, head_size=64)
    c = KVStoreClient(sys.argv[1], shared_memory=True)
    ns = c.register_layout(layout)
    k = lambda tag, n: [xxhash.xxh3_128_digest(f"{tag}:{i}".encode()) for i in range(n)]
    res = c.reserve(ns, k("crash-reserved", 6))
    for v in res.views:
        v[:] = 7
    acq = c.acquire(ns, k("crash-stored", 3))
    print("holding", flush=True)
    time.sleep(60)
""")


def test_client_killed_holding_reservations_and_leases(fresh_server):
    srv = fresh_server(lease_ttl="1s")
    with KVStoreClient(srv.address, shared_memory=True) as c:
        ns = c.register_layout(LAYOUT)
        stored = keys("crash-stored", 3)
        c.put(ns, stored, pages(3))
        proc = subprocess.Popen([sys.executable, "-c", CRASHER, srv.address],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "holding"
            assert c.stats().leases == 2 and c.stats().leased_pages == 9
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        finally:
            proc.kill()
        # Deleting pages a dead client still pins: invisible now, freed at lease expiry.
        assert c.delete(ns, stored) == 3
        assert c.lookup(ns, stored) == 0
        wait_for(lambda: not c.stats().leases, "the dead client's leases to expire", timeout=5,
                 interval=0.1)
        s = c.stats()
        assert s.leases == 0 and s.leased_pages == 0 and s.tiers[0].used_bytes == 0
        assert c.lookup(ns, keys("crash-reserved", 6)) == 0   # never became visible


def test_server_restart_while_attached(fresh_server):
    srv = fresh_server()
    with KVStoreClient(srv.address, shared_memory=True) as c:
        ns = c.register_layout(LAYOUT)
        old_path = c.region().path
        c.put(ns, keys("before", 2), pages(2, seed=1))
        srv.stop()
        again = ServerProcess(port=srv.port, dram="64MiB").start()
        try:
            with pytest.raises(KeyError):
                c.get(ns, keys("before", 2))         # a new, empty store: no stale bytes
            c.put(ns, keys("after", 2), pages(2, seed=2))
            assert c.region().path != old_path       # re-attached to the new region
            assert np.array_equal(c.get(ns, keys("after", 2)), pages(2, seed=2))
        finally:
            again.stop()


def test_region_permissions_and_removal(fresh_server):
    srv = fresh_server()
    with KVStoreClient(srv.address, shared_memory=True) as c:
        path = c.region().path
    mode = stat.S_IMODE(os.stat(path).st_mode)
    assert mode == 0o600
    srv.stop()
    assert not os.path.exists(path)
