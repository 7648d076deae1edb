"""KVStoreHiCacheStorage against SGLang 0.5.23's interface, factory and host pools."""

from __future__ import annotations

import inspect
import itertools
import os
import signal
import time

import pytest

pytest.importorskip("sglang", reason="needs SGLang 0.5.23 (scripts/venv-sglang.sh)")

import torch
import xxhash
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
from sglang.srt.observability.metrics_collector import StorageMetrics

from kvstore_bench.sglang_bench import host_pool, make_backend, storage_config
from kvstore_connector.config import ConnectorConfig
from kvstore_connector.sglang import Failures, KVStoreHiCacheStorage, store_key
from kvstore_testing.serverproc import sigstop
from tests.waiting import wait_for

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
PAGES = 6
_names = itertools.count()


def _keys(n: int = PAGES) -> list[str]:
    """Fresh SGLang-style page hashes (hex strings) for one test."""
    base = next(_names)
    return [xxhash.xxh3_64_hexdigest(f"page-{base}-{i}".encode()) for i in range(n)]


def _filled(kind: str, layout: str, **kw):
    pool = host_pool(kind, layout, **kw)
    pool.kv_buffer.view(torch.uint8).random_(0, 256)
    return pool


def _indices(pool, pages: list[int]) -> torch.Tensor:
    """Host token indices of whole pages, as SGLang hands them to batch_*_v1."""
    t = pool.page_size
    return torch.cat([torch.arange(p * t, (p + 1) * t) for p in pages])


def _page_bytes(pool, page: int) -> bytes:
    """The host pool's own flat page (its layout's byte order)."""
    return pool.get_data_page(page * pool.page_size, flat=True).view(torch.uint8).numpy().tobytes()


def _tokens(pool, page: int) -> list[bytes]:
    """Each (layer, K/V, token) row of a page, read through SGLang's own per-layer views,
    so pages of pools in different layouts compare."""
    mla = pool.__class__.__name__.startswith("MLA")
    refs = [pool.data_refs] if mla else [pool.k_data_refs, pool.v_data_refs]
    if mla and pool.layout == "page_first_direct":
        # SGLang 0.5.23's MLA data_refs index pages here, not layers: transpose instead.
        refs = [pool.kv_buffer.transpose(0, 1)]
    t = pool.page_size
    rows = []
    for layer in range(pool.layer_num):
        for kv in refs:
            ref = kv[layer]
            if pool.layout == "page_first_direct":   # (pages, T, ...) per layer
                ref = ref.flatten(0, 1)
            rows += [r.contiguous().view(torch.uint8).numpy().tobytes()
                     for r in ref[page * t:(page + 1) * t]]
    return rows


def _backend(store, pool, **cfg) -> KVStoreHiCacheStorage:
    mla = pool.__class__.__name__.startswith("MLA")
    return make_backend(storage_config(store.address, mla=mla, **cfg), pool)


# -- the interface ------------------------------------------------------------------------
def test_no_abstract_method_is_missing():
    assert not KVStoreHiCacheStorage.__abstractmethods__


def test_every_signature_matches_sglangs():
    ours = [n for n, f in vars(KVStoreHiCacheStorage).items()
            if callable(f) and not n.startswith("_") and hasattr(HiCacheStorage, n)]
    assert {"get", "set", "batch_get", "batch_set", "exists", "batch_exists", "batch_get_v1",
            "batch_set_v1", "register_mem_pool_host", "clear", "get_stats"} <= set(ours)
    for name in ours:
        assert (inspect.signature(getattr(KVStoreHiCacheStorage, name))
                == inspect.signature(getattr(HiCacheStorage, name))), name


def test_sglangs_factory_builds_it(store):
    pool = host_pool("mha", "page_first")
    backend = _backend(store, pool)
    assert isinstance(backend, KVStoreHiCacheStorage)
    assert backend.handle.layout.num_layers == pool.layer_num
    assert backend.handle.layout.dtype == "bfloat16"


def test_key_is_xxh3_128_of_the_hash_string():
    assert store_key("abc") == xxhash.xxh3_128_digest(b"abc")
    assert len(store_key("x" * 1000)) == 16


# -- round trips through SGLang's host pools ------------------------------------------------
@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("writer,reader", list(itertools.product(LAYOUTS, LAYOUTS)))
def test_v1_round_trip_between_host_layouts(store, kind, writer, reader):
    src = _filled(kind, writer)
    dst = host_pool(kind, reader)
    put, get = _backend(store, src), _backend(store, dst)
    keys = _keys()
    src_pages, dst_pages = [1, 3, 0, 5, 7, 2], [9, 4, 11, 6, 2, 10]
    assert put.batch_set_v1(keys, _indices(src, src_pages)) == [True] * PAGES
    assert get.batch_exists(keys) == PAGES
    assert get.batch_get_v1(keys, _indices(dst, dst_pages)) == [True] * PAGES
    for s, d in zip(src_pages, dst_pages):
        assert _tokens(dst, d) == _tokens(src, s)
        if writer == reader:
            assert _page_bytes(dst, d) == _page_bytes(src, s)
    assert _page_bytes(dst, 0) == bytes(len(_page_bytes(dst, 0)))   # nothing else written


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_generic_round_trip_and_both_paths_share_pages(store, kind, layout):
    src = _filled(kind, layout)
    backend = _backend(store, src)
    keys = _keys(4)
    flat = [src.get_data_page(p * src.page_size, flat=True) for p in range(4)]
    assert backend.batch_set(keys[:2], flat[:2])
    assert backend.set(keys[2], flat[2])
    assert backend.batch_set_v1(keys[3:], _indices(src, [3])) == [True]
    assert backend.exists(keys[0]) and backend.batch_exists(keys) == 4
    got = backend.batch_get(keys, [src.get_dummy_flat_data_page() for _ in keys])
    assert [g.view(torch.uint8).numpy().tobytes() for g in got] == \
        [_page_bytes(src, p) for p in range(4)]
    one = backend.get(keys[1])                 # no target: a new flat page
    assert one.view(torch.uint8).numpy().tobytes() == _page_bytes(src, 1)
    dst = host_pool(kind, layout)
    reader = _backend(store, dst)
    assert reader.batch_get_v1(keys[:3], _indices(dst, [5, 6, 7])) == [True] * 3
    assert [_page_bytes(dst, p) for p in (5, 6, 7)] == [_page_bytes(src, p) for p in range(3)]


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_grpc_path_shares_pages_with_the_shared_memory_path(store, kind):
    src, dst = _filled(kind, "page_first"), host_pool(kind, "layer_first")
    remote = _backend(store, src, shared_memory=False)
    local = _backend(store, dst)
    assert remote.client.region() is None
    keys = _keys(4)
    assert remote.batch_set_v1(keys[:2], _indices(src, [0, 1])) == [True, True]
    assert remote.batch_set(keys[2:], [src.get_data_page(p * src.page_size) for p in (2, 3)])
    assert local.batch_get_v1(keys, _indices(dst, [4, 5, 6, 7])) == [True] * 4
    assert [_tokens(dst, p) for p in (4, 5, 6, 7)] == [_tokens(src, p) for p in range(4)]
    more = _keys(1)
    assert local.batch_set_v1(more, _indices(dst, [4])) == [True]
    assert remote.batch_get_v1(keys + more, _indices(src, [4, 5, 6, 7, 8])) == [True] * 5
    assert [_page_bytes(src, p) for p in (4, 5, 6, 7, 8)] == \
        [_page_bytes(src, p) for p in (0, 1, 2, 3, 0)]
    assert remote.batch_get(keys[:1])[0].view(torch.uint8).numpy().tobytes() == \
        _page_bytes(src, 0)


def test_misses_are_reported_per_page(store):
    src = _filled("mha", "page_first")
    backend = _backend(store, src)
    keys = _keys(4)
    backend.batch_set_v1(keys[:2], _indices(src, [0, 1]))
    assert backend.batch_exists(keys) == 2
    assert not backend.exists(keys[3])
    assert backend.get(keys[3], src.get_dummy_flat_data_page()) is None
    assert backend.batch_get_v1(keys, _indices(src, [4, 5, 6, 7])) == [True, True, False, False]


# -- namespaces ------------------------------------------------------------------------------
def test_two_tp_ranks_never_mix(store):
    pools = [_filled("mha", "page_first") for _ in range(2)]
    ranks = [_backend(store, p, tp_rank=r, tp_size=2) for r, p in enumerate(pools)]
    keys = _keys(3)
    assert ranks[0].batch_set_v1(keys, _indices(pools[0], [0, 1, 2])) == [True] * 3
    assert ranks[1].batch_exists(keys) == 0
    assert ranks[1].batch_get_v1(keys, _indices(pools[1], [3, 4, 5])) == [False] * 3
    assert ranks[1].batch_set_v1(keys, _indices(pools[1], [0, 1, 2])) == [True] * 3
    for rank, pool in zip(ranks, pools):
        assert rank.batch_get_v1(keys, _indices(pool, [6, 7, 8])) == [True] * 3
        assert [_page_bytes(pool, p) for p in (6, 7, 8)] == \
            [_page_bytes(pool, p) for p in (0, 1, 2)]


def test_mla_pages_are_shared_by_tp_ranks(store):
    # SGLang writes MLA pages from one rank only (is_storage_writer) and every rank reads.
    src, dst = _filled("mla", "page_first"), host_pool("mla", "page_first")
    writer = _backend(store, src, tp_rank=0, tp_size=2)
    reader = _backend(store, dst, tp_rank=1, tp_size=2)
    keys = _keys(2)
    writer.batch_set_v1(keys, _indices(src, [0, 1]))
    assert reader.batch_get_v1(keys, _indices(dst, [2, 3])) == [True, True]
    assert _page_bytes(dst, 2) == _page_bytes(src, 0)


def test_kv_dtype_and_model_scope_pages(store):
    keys = _keys(2)
    bf16 = _filled("mha", "page_first")
    _backend(store, bf16).batch_set_v1(keys, _indices(bf16, [0, 1]))
    fp16 = host_pool("mha", "page_first", dtype=torch.float16)
    assert _backend(store, fp16).batch_exists(keys) == 0          # SGLang #33268
    assert _backend(store, bf16, model="other-model").batch_exists(keys) == 0
    assert _backend(store, bf16, salt="tenant-b").batch_exists(keys) == 0
    assert _backend(store, bf16).batch_exists(keys) == 2


def test_the_settings_are_the_connector_configs_fields_of_the_extra_config(store):
    """Every ConnectorConfig field in SGLang's extra config is a setting (no list of our
    own to drift from config.py); SGLang's own keys are left to it."""
    pool = _filled("mha", "page_first")
    backend = _backend(store, pool, timeout=1.5, probe_interval=7.0, salt="tenant-b",
                       model_revision="r1", remote_connections=3)
    assert backend.settings == ConnectorConfig(
        server=store.address, timeout=1.5, probe_interval=7.0, salt="tenant-b",
        model_revision="r1", remote_connections=3)
    with pytest.raises(ValueError, match="lease_ms"):
        _backend(store, pool, lease_ms=-1)


# -- failures and metrics -----------------------------------------------------------------------
def test_a_stopped_server_gives_misses_not_exceptions(fresh_server):
    srv = fresh_server(dram="256MiB")
    pool = _filled("mha", "layer_first")
    backend = _backend(srv, pool, timeout=2.0)
    keys = _keys(2)
    assert backend.batch_set_v1(keys, _indices(pool, [0, 1])) == [True, True]
    srv.stop()
    assert backend.batch_exists(keys) == 0
    assert not backend.exists(keys[0])
    assert backend.batch_get_v1(keys, _indices(pool, [2, 3])) == [False, False]
    assert backend.batch_set_v1(_keys(2), _indices(pool, [0, 1])) == [False, False]
    assert backend.get(keys[0], pool.get_dummy_flat_data_page()) is None
    assert backend.batch_get(keys) == [None, None]
    assert backend.set(keys[0], pool.get_data_page(0)) is False
    assert not backend.batch_set(keys, [pool.get_data_page(0)] * 2)
    backend.clear()
    assert backend.failures == Failures(get=5, set=5, exists=3)


def test_a_server_down_at_start_is_not_fatal(fresh_server):
    srv = fresh_server(dram="256MiB")
    address = srv.address
    srv.stop()
    pool = _filled("mha", "page_first")
    backend = make_backend(storage_config(address, timeout=1.0), pool)
    assert backend.batch_exists(_keys(1)) == 0
    assert backend.batch_get_v1(_keys(1), _indices(pool, [0])) == [False]


def test_get_stats_reports_sglangs_storage_metrics(store):
    pool = _filled("mha", "page_first_direct")
    backend = _backend(store, pool)
    keys = _keys(3)
    backend.batch_set_v1(keys, _indices(pool, [0, 1, 2]))
    backend.batch_get_v1(keys[:2], _indices(pool, [3, 4]))
    stats = backend.get_stats()
    assert isinstance(stats, StorageMetrics)
    assert stats.backup_pgs == [3] and stats.prefetch_pgs == [2]
    assert len(stats.backup_bandwidth) == 1 and stats.backup_bandwidth[0] > 0
    assert len(stats.prefetch_bandwidth) == 1 and stats.prefetch_bandwidth[0] > 0
    assert backend.get_stats() == StorageMetrics()   # reset by reading


@pytest.mark.parametrize("how", ["sigkill", "sigterm-disk"])
def test_after_a_restart_pages_move_through_the_new_pool(fresh_server, tmp_path, how):
    """A backend that mapped the pool before a restart writes into and reads from the
    restarted server's pool: every offset with the mapping that issued it."""
    srv = fresh_server(dram="256MiB", disk="256MiB", disk_dir=str(tmp_path / "disk"))
    pool = _filled("mha", "page_first")
    writer, reader = _backend(srv, pool), _backend(srv, pool)
    old = _keys(2)
    assert writer.batch_set_v1(old, _indices(pool, [0, 1])) == [True, True]
    assert reader.batch_get_v1(old, _indices(pool, [6, 7])) == [True, True]   # both mapped
    if how == "sigkill":
        srv.stop(signal.SIGKILL)
    else:
        assert srv.stop(signal.SIGTERM) == 0
    srv.start()
    new = _keys(2)
    assert writer.batch_set_v1(new, _indices(pool, [2, 3])) == [True, True]
    assert reader.batch_get_v1(new, _indices(pool, [4, 5])) == [True, True]
    assert [_tokens(pool, p) for p in (4, 5)] == [_tokens(pool, p) for p in (2, 3)]
    if how == "sigterm-disk":                  # pages written before the restart, too
        assert reader.batch_get_v1(old, _indices(pool, [8, 9])) == [True, True]
        assert [_tokens(pool, p) for p in (8, 9)] == [_tokens(pool, p) for p in (0, 1)]


def test_a_hung_store_costs_one_timeout_then_misses_until_a_probe_answers(fresh_server):
    srv = fresh_server(dram="256MiB")
    pool = _filled("mha", "layer_first")
    backend = _backend(srv, pool, timeout=0.5, probe_interval=1.0)
    keys = _keys(2)
    assert backend.batch_set_v1(keys, _indices(pool, [0, 1])) == [True, True]
    sigstop(srv.proc.pid)
    try:
        start = time.monotonic()
        assert backend.batch_exists(keys) == 0                  # times out once
        assert time.monotonic() - start < 1.5
        start = time.monotonic()
        for _ in range(5):                                      # then answers at once
            assert backend.batch_exists(keys) == 0
            assert backend.batch_get_v1(keys, _indices(pool, [2, 3])) == [False, False]
            assert backend.batch_set_v1(_keys(1), _indices(pool, [4])) == [False]
        assert time.monotonic() - start < 0.2
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)
    # The breaker's probe, on its own thread every probe_interval, finds it answering.
    wait_for(lambda: not backend.breaker.open, "a probe to find the store answering",
             timeout=5, interval=0.05)
    assert backend.batch_exists(keys) == 2

