"""A leased lookup that answers where its pages lie (fastwire.PINS), and the loads that copy
from those offsets under the lookup's own lease instead of acquiring the pages again."""

from __future__ import annotations

import dataclasses
import hashlib
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvstore_client import KVStoreClient  # noqa: E402
from kvstore_connector.config import LoadMode, SavePolicy  # noqa: E402
from kvstore_protocol.region import region_id  # noqa: E402
from tests.waiting import wait_for  # noqa: E402

from .test_connector import Engine, layout, prompt  # noqa: E402
from .test_connector_reserve import lease_calls  # noqa: E402


@pytest.fixture
def srv(fresh_server):
    return fresh_server(dram="64MiB", lease_ttl="20s")


def _stored(c: KVStoreClient, n: int, seed: int = 0):
    ns = c.register_layout(layout())
    ks = [hashlib.sha256(f"pins-{seed}-{i}".encode()).digest()[:16] for i in range(n)]
    data = np.random.default_rng(seed).integers(0, 256, (n, ns.page_bytes), dtype=np.uint8)
    c.put(ns, ks, data)
    return ns, ks, data


def test_a_pinned_lookup_answers_the_offsets_acquire_would(srv):
    with KVStoreClient(srv.address) as c:
        ns, ks, data = _stored(c, 6)
        lease = c.lookup_lease([ns, ns], ks + [b"\xee" * 16], 5000, pins=True)
        assert lease.count == 6 and lease.pins is not None
        pins = lease.pins
        assert pins.region_id == c.region().id == region_id(c.region().token)
        assert 0 < pins.ttl_s <= 5.0
        assert list(pins.offsets) == [ns.layout_id]       # a repeated layout: one row
        with c.acquire(ns, ks) as acq:
            assert np.array_equal(pins.offsets[ns.layout_id], acq.offsets)
        mem = c.region().mem
        for i, off in enumerate(pins.offsets[ns.layout_id].tolist()):
            assert np.array_equal(mem[off:off + ns.page_bytes], data[i])
        # Not asked, not leased, or not over the fast path: no pins.
        assert c.lookup_lease(ns, ks, 5000).pins is None
        assert c.lookup(ns, ks) == 6
        for lease_id in (lease.lease_id,):
            assert c.release_lease(lease_id)
    with KVStoreClient(srv.address, data_plane=False) as grpc_only:
        ns = grpc_only.register_layout(layout())
        got = grpc_only.lookup_lease(ns, ks, 5000, pins=True)
        assert got.count == 6 and got.pins is None
        grpc_only.release_lease(got)


def test_a_pinned_lease_outlives_its_connection_until_released(srv):
    """The pins are for a worker in another process: closing the lookup's connection
    must not unpin pages that worker may be copying (a lease without pins does go)."""
    with KVStoreClient(srv.address) as c:
        _ns, ks, _ = _stored(c, 4, seed=1)
        before = c.stats().leases
    with KVStoreClient(srv.address, shared_memory=False) as a:
        ns_a = a.register_layout(layout())
        pinned = a.lookup_lease(ns_a, ks, 20000, pins=True)
        plain = a.lookup_lease(ns_a, ks, 20000)
        assert pinned.pins is not None and plain.pins is None
    with KVStoreClient(srv.address) as c:
        wait_for(lambda: c.stats().leases == before + 1, "the unpinned lease to go")
        time.sleep(0.2)
        assert c.stats().leases == before + 1
        assert c.release_lease(pinned.lease_id)
        assert c.stats().leases == before


def test_a_tenant_that_may_not_map_the_pool_gets_no_pins(fresh_server, tmp_path):
    path = tmp_path / "auth.toml"
    path.write_text('[tenants.a]\ntoken_sha256 = "'
                    + hashlib.sha256(b"pins-tok-a").hexdigest() + '"\n')
    srv = fresh_server(auth_file=str(path))
    with KVStoreClient(srv.address, token="pins-tok-a", shared_memory=False) as a:
        ns = a.register_layout(layout())
        ks = [bytes([i]) * 16 for i in range(3)]
        a.put(ns, ks, np.zeros((3, ns.page_bytes), np.uint8))
        lease = a.lookup_lease(ns, ks, 5000, pins=True)
        assert lease.count == 3 and lease.lease_id and lease.pins is None


@pytest.mark.parametrize("shared_memory", [None, False])
def test_the_scheduler_asks_over_the_unix_socket_unless_shared_memory_is_off(srv,
                                                                            shared_memory):
    e = Engine(srv.address, shared_memory=shared_memory)
    assert e.sched.hit("r", prompt(64, 23), 0) == 0
    address = e.sched.client.fast_path().address
    assert address.endswith(".sock") == (shared_memory is None)
    e.close()


def _hit(e: Engine, cached):
    """A step that loads the first three pages of `cached` (stored by another engine)."""
    assert e.sched.hit("load", cached, 0) == 48
    blocks = e.alloc(64)
    e.sched.allocated("load", blocks, 48)
    e.sched.scheduled("load", cached, 48, 16, block_ids=blocks)
    return e.sched.build(), blocks


def _with_pins(meta, **change):
    return dataclasses.replace(meta, loads=tuple(
        dataclasses.replace(spec, pins=dataclasses.replace(spec.pins, **change))
        for spec in meta.loads))


@pytest.mark.parametrize("case", ["pinned", "stale", "other pool", "not in the pool",
                                  "async"])
def test_a_load_copies_from_the_pins_only_when_they_hold(srv, case):
    """Pins in time, of the pool this worker maps, every page in it: the load copies
    without an Acquire. Otherwise (the lease may be running out, another pool, a page on
    the tier below, an async load that may outlive its request) it acquires, as before.
    Either way the loaded KV is exact."""
    seed = Engine(srv.address)
    cached = prompt(64, 21)
    seed.run_prompt("seed", cached[:49])                  # pages 0-2 stored
    e = Engine(srv.address, mode=LoadMode.ASYNC if case == "async" else LoadMode.LAYERWISE)
    e.run_prompt("warm", prompt(32, 99))                  # the pool mapped, connections up
    calls = lease_calls(e.worker.client)
    meta, blocks = _hit(e, cached)
    (spec,) = meta.loads
    if case == "async":
        assert spec.pins is None
    else:
        assert spec.pins is not None and len(spec.pins.offsets[e.worker.ns.layout_id]) == 3
    if case == "stale":
        meta = _with_pins(meta, use_by=time.time() - 1)
    elif case == "other pool":
        meta = _with_pins(meta, region_id=spec.pins.region_id ^ 1)
    elif case == "not in the pool":
        offsets = {lid: np.where(np.arange(len(o)) == 1, -1, o)
                   for lid, o in spec.pins.offsets.items()}
        meta = _with_pins(meta, offsets=offsets)
    e.worker.take_stats()
    _, done, errors = e.run(meta, [(blocks, cached, 48, 64)])
    if case == "async":
        done = set(done)
        wait_for(lambda: "load" in done or done.update(e.worker.finished()),
                 "the async load landed")
    assert errors == set() and e.worker.load_errors() == set()
    e.expect_kv(blocks, cached, 48)
    pinned = case == "pinned"
    assert calls.count("acquire") == (0 if pinned else 1)
    assert e.worker.take_stats().loads_pinned == int(pinned)
    for x in (seed, e):
        x.close()


def test_the_lookup_lease_is_held_until_a_pinned_load_has_come_back(srv):
    """With no Acquire of the worker's own, the lookup's lease is what keeps the pages in
    place while they are copied: it goes only once the step's outcome is known."""
    seed = Engine(srv.address)
    cached = prompt(64, 22)
    seed.run_prompt("seed", cached[:49])
    e = Engine(srv.address, lag=2, save=SavePolicy.NONE)     # no lease of a save's
    e.run_prompt("warm", prompt(32, 98))
    with KVStoreClient(srv.address) as c:
        wait_for(lambda: c.stats().leases == 0, "the warm-up's leases to go")
        meta, blocks = _hit(e, cached)
        assert meta.loads[0].pins is not None and c.stats().leases == 1
        e.run(meta, [(blocks, cached, 48, 64)])
        assert e.worker.take_stats().loads_pinned == 1
        e.step([])                        # lag 2: the load's outcome is not known yet
        time.sleep(0.2)
        assert c.stats().leases == 1
        e.step([])
        wait_for(lambda: c.stats().leases == 0, "the lookup's lease to go")
    e.expect_kv(blocks, cached, 48)
    for x in (seed, e):
        x.close()
