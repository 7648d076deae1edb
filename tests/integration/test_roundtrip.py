"""Pages through a real kvstore-server process over gRPC."""

import dataclasses

import numpy as np
import pytest
import xxhash

from kvstore_client import KVStoreClient, PageLayout
from tests.waiting import wait_for

LAYOUTS = [
    PageLayout(model="llama-3-8b", num_layers=32, page_tokens=16, num_kv_heads=8,
               head_size=128, dtype="bfloat16"),
    PageLayout(model="tiny-fp32", num_layers=2, page_tokens=4, num_kv_heads=2,
               head_size=16, dtype="float32"),
    PageLayout(model="deepseek-mla", num_layers=3, page_tokens=64, num_kv_heads=1,
               head_size=576, dtype="bfloat16", kv_factor=1),
    PageLayout(model="fp8", num_layers=5, page_tokens=32, num_kv_heads=4, head_size=64,
               dtype="float8_e4m3fn", tp_rank=1, tp_size=2),
]


def keys(tag, n):
    return [xxhash.xxh3_128_digest(f"{tag}:{i}".encode()) for i in range(n)]


def pages_for(ns, n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, ns.page_bytes), dtype=np.uint8)


@pytest.fixture(scope="module", params=[True, False], ids=["shm", "grpc"])
def client(server, request):
    """Both data paths: the shared-memory pool and page bytes over gRPC."""
    with KVStoreClient(server.address, shared_memory=request.param) as c:
        assert (c.region() is not None) == request.param
        yield c


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.model)
def test_byte_exact_round_trip(client, layout):
    ns = client.register_layout(layout)
    assert ns.page_bytes == layout.page_bytes and ns.layout_id == layout.layout_id
    n = max(2, min(20, (8 << 20) // ns.page_bytes))
    ks = keys(f"{layout.model}-{client.shared_memory}", n)
    pages = pages_for(ns, n)
    assert client.put(ns, ks, pages).stored == n
    assert np.array_equal(client.get(ns, ks), pages)
    out = np.zeros_like(pages)
    client.get_into(ns, ks[::-1], out)          # any order, into a caller buffer
    assert np.array_equal(out, pages[::-1])
    layers = dict(client.get_layers(ns, ks))
    assert sorted(layers) == list(range(layout.num_layers))
    for layer, slab in layers.items():
        lb = ns.layer_bytes
        assert slab.flags.c_contiguous and slab.shape == (n, lb)
        assert np.array_equal(slab, pages[:, layer * lb:(layer + 1) * lb])
    client.delete(ns, ks)


def test_put_accepts_bytes_and_torch_tensors(client):
    torch = pytest.importorskip("torch")
    ns = client.register_layout(LAYOUTS[1])
    pages = pages_for(ns, 3, seed=5)
    tag = str(client.shared_memory)
    client.put(ns, keys("bytes" + tag, 3), pages.tobytes())
    tensor = torch.from_numpy(pages.copy())
    client.put(ns, keys("torch" + tag, 3), tensor)
    out = torch.zeros_like(tensor)
    client.get_into(ns, keys("torch" + tag, 3), out)
    assert torch.equal(out, tensor)
    assert np.array_equal(client.get(ns, keys("bytes" + tag, 3)), pages)


def test_prefix_count_with_holes_and_exists(client):
    ns = client.register_layout(LAYOUTS[1])
    ks = keys(f"holes{client.shared_memory}", 10)
    client.put(ns, ks[:4] + ks[5:], pages_for(ns, 9))
    assert client.lookup(ns, ks) == 4
    assert client.lookup(ns, ks[5:]) == 5
    assert client.lookup(ns, []) == 0
    assert client.exists(ns, ks) == [True] * 4 + [False] + [True] * 5
    with pytest.raises(KeyError, match="key 4 of 10"):
        client.get(ns, ks)


def test_repeated_put_is_skipped(client):
    ns = client.register_layout(LAYOUTS[1])
    ks = keys(f"again{client.shared_memory}", 4)
    first = pages_for(ns, 4, seed=1)
    assert client.put(ns, ks, first).stored == 4
    result = client.put(ns, ks, pages_for(ns, 4, seed=2))
    assert (result.stored, result.skipped) == (0, 4)
    assert np.array_equal(client.get(ns, ks), first)   # never overwritten


@pytest.mark.parametrize("change", [{"dtype": "float16"}, {"tp_rank": 1, "tp_size": 2},
                                    {"tp_size": 2}, {"salt": "tenant-b"}, {"page_tokens": 32}])
def test_layouts_are_isolated(client, change):
    base = LAYOUTS[0]
    a = client.register_layout(base)
    b = client.register_layout(dataclasses.replace(base, **change))
    assert a.layout_id != b.layout_id
    ks = keys(f"iso{sorted(change)}{client.shared_memory}", 3)
    client.put(a, ks, pages_for(a, 3))
    assert client.lookup(b, ks) == 0
    assert client.exists(b, ks) == [False] * 3
    assert client.lookup([a, b], ks) == 0          # a multi-layout lookup is the minimum
    client.put(b, ks, pages_for(b, 3))
    assert client.lookup([a, b], ks) == 3


def test_register_is_idempotent(client):
    assert client.register_layout(LAYOUTS[2]) == client.register_layout(LAYOUTS[2])


def test_lease_protects_pages_from_eviction(fresh_server):
    srv = fresh_server(dram="32MiB")
    with KVStoreClient(srv.address) as c:
        ns = c.register_layout(PageLayout(model="lease", num_layers=4, page_tokens=16,
                                          num_kv_heads=8, head_size=128))   # 256 KiB pages
        held = keys("held", 8)
        c.put(ns, held, pages_for(ns, 8, seed=3))
        lease = c.lookup_lease(ns, held, lease_ms=60_000)
        assert lease.count == 8
        for r in range(6):                         # 6 x 24 MiB through a 32 MiB pool
            c.put(ns, keys(f"churn{r}", 96), pages_for(ns, 96, seed=r))
        assert c.lookup(ns, held) == 8
        assert np.array_equal(c.get(ns, held), pages_for(ns, 8, seed=3))
        assert c.release_lease(lease)
        assert not c.release_lease(lease)          # a second release is a no-op
        for r in range(6):
            c.put(ns, keys(f"churn-b{r}", 96), pages_for(ns, 96, seed=r))
        assert c.lookup(ns, held) < 8


def test_lease_expires(fresh_server):
    srv = fresh_server(dram="32MiB", lease_ttl="1s")
    with KVStoreClient(srv.address) as c:
        ns = c.register_layout(LAYOUTS[1])
        ks = keys("exp", 2)
        c.put(ns, ks, pages_for(ns, 2))
        lease = c.lookup_lease(ns, ks, lease_ms=300)
        assert c.stats().leases == 1
        wait_for(lambda: c.stats().leases == 0, "the lease to expire")
        assert not c.release_lease(lease)


def test_eviction_under_pressure_keeps_prefixes_whole(fresh_server):
    srv = fresh_server(dram="32MiB")
    with KVStoreClient(srv.address) as c:
        ns = c.register_layout(PageLayout(model="pressure", num_layers=4, page_tokens=16,
                                          num_kv_heads=8, head_size=128))
        prompts = [keys(f"prompt{p}", 12) for p in range(40)]      # 40 x 3 MiB > 32 MiB
        rng = np.random.default_rng(7)
        for p, ks in enumerate(prompts):
            c.put(ns, ks, pages_for(ns, 12, seed=p))
            for q in rng.choice(p + 1, size=min(p + 1, 3), replace=False):
                c.lookup(ns, prompts[q])               # engines re-read some prompts
        total = 0
        for p, ks in enumerate(prompts):
            present = c.exists(ns, ks)
            n = sum(present)
            assert present == [True] * n + [False] * (12 - n), f"prompt {p} has a hole"
            total += n
            if n:
                assert np.array_equal(c.get(ns, ks[:n]), pages_for(ns, 12, seed=p)[:n])
        assert 0 < total < 40 * 12
        assert c.stats().tiers[0].evictions > 0


def test_client_reregisters_after_server_restart(fresh_server):
    from kvstore_testing.serverproc import ServerProcess
    srv = fresh_server(dram="32MiB")
    with KVStoreClient(srv.address) as c:
        ns = c.register_layout(LAYOUTS[1])
        c.put(ns, keys("r", 2), pages_for(ns, 2))
        srv.stop()
        again = ServerProcess(port=srv.port, dram="32MiB").start()
        try:
            assert c.lookup(ns, keys("r", 2)) == 0      # a new, empty store; no error
            c.put(ns, keys("r", 2), pages_for(ns, 2))
            assert c.lookup(ns, keys("r", 2)) == 2
        finally:
            again.stop()
