"""Hybrid models (vLLM's hybrid KV cache manager on) under vLLM 0.33's real scheduler:
full + sliding window, MLA + sliding window, full + an EAGLE/MTP draft group, against a
real kvstore-server; every read the model makes is checked, every stored page compared
with the KV the model wrote, and the bytes a full hit moves counted by the store."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vLLM 0.33 (scripts/venv-vllm.sh)")

import torch
from harness import BLOCK_SIZE, ConnectorSpec, make_request
from hybrid import HybridShape, build_hybrid, hybrid_engine
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import (
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)

from kvstore_client import KVStoreClient
from kvstore_connector.groups import UnsupportedCache

SLIDING = HybridShape(("full", "sliding", "full", "sliding"), window=40)
MLA_SLIDING = HybridShape(("mla", "sliding_mla", "mla", "sliding_mla"), window=40)
DRAFT = HybridShape(("full", "sliding", "draft"), window=40)
PROMPT = list(range(2000, 2160))            # 160 tokens: 10 pages, 9 may be claimed
HIT_PAGES = (len(PROMPT) - 1) // BLOCK_SIZE


def spec(address: str, mode: str = "layerwise", **extra: object) -> ConnectorSpec:
    return ConnectorSpec(name="KVStoreConnector", module_path="kvstore_connector.vllm",
                         extra_config={"server": address, "load_mode": mode,
                                       "lookup_timeout": 5.0, "lookup_wait_ms": 5000,
                                       **extra},
                         load_failure_policy="recompute")


def run(driver, max_steps: int = 40) -> None:
    for _ in range(max_steps):
        if not driver.scheduler.requests:
            return
        driver.step()
    raise AssertionError(f"still running: {list(driver.scheduler.requests)}")


def layout_stats(address: str) -> dict[str, tuple[int, int, int]]:
    """Group scope (the salt after '#', '' for none) -> (pages, bytes in, bytes out)."""
    with KVStoreClient(address) as c:
        return {s.layout.salt.partition("#")[2]: (s.pages, s.bytes_in, s.bytes_out)
                for s in c.stats().layouts}


def group_layers(driver) -> list[tuple[object, list[int]]]:
    """(the connector's CacheGroup, its layers' indices) per group."""
    connector = driver.connector
    names = list(driver.worker.shape_h.layer_names)
    return [(g, [names.index(n) for n in g.layer_names]) for g in connector.groups]


def check_stored(driver, address: str, req_id: str, pages: int) -> int:
    """Compare every group's stored pages of the request with the KV the model wrote;
    returns how many pages were compared."""
    model = driver.worker.model
    sched = driver.connector.scheduler_half
    keys = sched._requests[req_id].keys[:pages] if req_id in sched._requests else None
    if keys is None:
        from kvstore_connector.scheduler.hashing import page_keys
        keys = page_keys(PROMPT[:pages * BLOCK_SIZE], BLOCK_SIZE, sched.seed)
    compared = 0
    with KVStoreClient(address) as c:
        for (group, layers), layouts in zip(group_layers(driver),
                                            driver.connector.group_layouts):
            ns = c.register_layout(layouts[0])
            present = c.exists(ns, keys)
            for i, (key, there) in enumerate(zip(keys, present)):
                if not there:
                    continue
                got = c.get(ns, [key])[0]
                want = model.expected_page(req_id, layers, i * BLOCK_SIZE, group.mla)
                assert bytes(got) == bytes(want), (group.kind, i)
                compared += 1
    return compared


@pytest.fixture
def store(fresh_server):
    return fresh_server(dram="64MiB")


@pytest.mark.parametrize("shape", [SLIDING, MLA_SLIDING], ids=["full+sliding", "mla+sliding"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_a_full_hit_loads_only_the_window_of_sliding_layers(tmp_path, store, shape,
                                                           async_scheduling):
    # A hybrid model's loads are async (connector.vllm says why), and an async load
    # acquires its pages: the store's counters see every byte it serves.
    connector = spec(store.address)
    first = hybrid_engine(tmp_path, shape, connector, {"a": PROMPT},
                          async_scheduling=async_scheduling)
    assert len(first.connector.groups) == 2        # vLLM kept its hybrid manager on
    first.add(make_request("a", PROMPT, max_tokens=2))
    run(first)
    assert not first.worker.model.wrong
    # Every page of both groups is saved: a later prefix of any length may end anywhere.
    assert check_stored(first, store.address, "a", 10) == 20
    saved = layout_stats(store.address)
    assert sorted(p for p, _, _ in saved.values()) == [10, 10]

    second = hybrid_engine(tmp_path, shape, connector, {"b": PROMPT},
                           async_scheduling=async_scheduling)
    second.add(make_request("b", PROMPT, max_tokens=2))
    second.step()
    assert second.request("b").num_computed_tokens >= HIT_PAGES * BLOCK_SIZE
    run(second)
    model = second.worker.model
    assert model.reads > 0 and not model.wrong, model.wrong

    # The store's own byte counters: the full group served every page of the hit, the
    # sliding group only the pages its window reaches from the hit's end.
    after = layout_stats(store.address)
    full_group, sliding_group = sorted(second.connector.groups, key=lambda g: g.kind.value)
    assert sliding_group.kind.value == "sliding"
    page_bytes = {g.scope: layouts[0].page_bytes for g, layouts in
                  zip(second.connector.groups, second.connector.group_layouts)}
    window = HIT_PAGES - sliding_group.first_page(HIT_PAGES, BLOCK_SIZE)
    assert window == 3                 # tokens 105..143 of the 144 the hit holds
    full_out = after[full_group.scope][2] - saved[full_group.scope][2]
    sliding_out = after[sliding_group.scope][2] - saved[sliding_group.scope][2]
    assert full_out == HIT_PAGES * page_bytes[full_group.scope]
    assert sliding_out == window * page_bytes[sliding_group.scope]
    assert full_out + sliding_out < HIT_PAGES * sum(page_bytes.values())


@pytest.mark.parametrize("mode", ["layerwise", "async"])
def test_a_shared_prefix_hits_as_far_as_every_group_holds(tmp_path, store, mode):
    other = PROMPT[:96] + list(range(5000, 5064))       # shares 6 pages, then differs
    first = hybrid_engine(tmp_path, SLIDING, spec(store.address, mode), {"a": PROMPT})
    first.add(make_request("a", PROMPT, max_tokens=2))
    run(first)
    second = hybrid_engine(tmp_path, SLIDING, spec(store.address, mode), {"b": other})
    second.add(make_request("b", other, max_tokens=2))
    second.step()
    run(second)
    assert second.worker.model.loaded == {"b": 96}
    assert second.worker.model.reads > 0 and not second.worker.model.wrong


def test_the_groups_share_one_client_mapping_and_registration(tmp_path, store):
    # Each registration pins the whole pool again and each client opens its own
    # connections and mapping: a hybrid worker makes one of each, not one per group.
    first = hybrid_engine(tmp_path, DRAFT, spec(store.address), {"a": PROMPT})
    first.add(make_request("a", PROMPT, max_tokens=2))
    run(first)
    workers = first.worker.connector.group_workers.workers
    assert len(workers) == 3
    clients = {id(w.client): w.client for w in workers}
    assert len(clients) == 1
    assert next(iter(clients.values())).region() is not None    # the pool is mapped
    tables = {id(w._mappings): w._mappings for w in workers}
    assert sum(len(t) for t in tables.values()) == 1             # registered once
    first.worker.connector.group_workers.close()
    assert sum(len(t) for t in tables.values()) == 0


def test_a_draft_groups_volatile_last_page_is_never_stored(tmp_path, store):
    prompt = PROMPT[:64]                                 # 4 pages exactly
    first = hybrid_engine(tmp_path, DRAFT, spec(store.address), {"a": prompt})
    kinds = sorted(g.kind.value for g in first.connector.groups)
    assert kinds == ["draft", "full", "sliding"]  # as vLLM's planner groups the layers
    first.add(make_request("a", prompt, max_tokens=3))
    first.step()                                         # the whole prompt, prefilled
    # The prefill's last page is not stable for a drafter: in no group is it stored yet.
    assert all(p <= 3 for p, _, _ in layout_stats(store.address).values())
    run(first)
    assert sorted(p for p, _, _ in layout_stats(store.address).values()) == [4, 4, 4]
    assert check_stored(first, store.address, "a", 4) == 12

    second = hybrid_engine(tmp_path, DRAFT, spec(store.address), {"b": prompt})
    second.add(make_request("b", prompt, max_tokens=2))
    run(second)
    assert second.worker.model.loaded == {"b": 48}      # the last page is computed
    assert second.worker.model.reads > 0 and not second.worker.model.wrong


def abort_and_preempt(make_engine) -> None:
    """A first engine stores PROMPT; a second runs it beside a request that is aborted
    after one step, then is preempted as vLLM does when it runs out of blocks and resumes
    from the store or its own cache: every read must be right and every block freed.
    make_engine(prompts) builds an engine of the hybrid shape under test."""
    first = make_engine({"a": PROMPT})
    first.add(make_request("a", PROMPT, max_tokens=2))
    run(first)
    prompts = {"b": PROMPT, "c": PROMPT[:80] + list(range(7000, 7080))}
    second = make_engine(prompts)
    second.add(make_request("b", prompts["b"], max_tokens=6),
               make_request("c", prompts["c"], max_tokens=6))
    second.step()
    second.scheduler.finish_requests("c", _aborted())
    second.step()
    request = second.request("b")
    second.scheduler.running.remove(request)
    second.scheduler._preempt_request(request, 0)
    run(second)
    model = second.worker.model
    assert model.reads > 0 and not model.wrong, model.wrong
    pool = second.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


def test_an_abort_and_a_preemption_keep_every_read_right(tmp_path, store):
    abort_and_preempt(lambda prompts: hybrid_engine(tmp_path, SLIDING, spec(store.address),
                                                    prompts))


def test_a_store_restart_between_engines_is_a_miss_not_wrong_kv(tmp_path, fresh_server):
    srv = fresh_server(dram="64MiB")
    first = hybrid_engine(tmp_path, SLIDING, spec(srv.address), {"a": PROMPT})
    first.add(make_request("a", PROMPT, max_tokens=2))
    run(first)
    srv.stop()
    srv.start()
    second = hybrid_engine(tmp_path, SLIDING, spec(srv.address), {"b": PROMPT})
    second.add(make_request("b", PROMPT, max_tokens=2))
    run(second)
    assert second.worker.model.reads > 0 and not second.worker.model.wrong


def _aborted():
    from vllm.v1.request import RequestStatus
    return RequestStatus.FINISHED_ABORTED


def _refused(tmp_path, store, extra_spec) -> str:
    config, _ = build_hybrid(tmp_path, SLIDING, spec(store.address))
    full = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=4, head_size=16,
                             dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["model.decoder.layers.0.self_attn.attn"], full),
        KVCacheGroupSpec(["model.decoder.layers.1.self_attn.attn"], extra_spec)])
    with pytest.raises(UnsupportedCache) as info:
        KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER,
                                            kv_cache_config)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_mamba_state_outside_align_mode_is_refused_at_start_up_with_one_line(tmp_path,
                                                                             store):
    # mamba_cache_mode "none" keeps one running state per request: nothing to store.
    # (align mode is supported: tests/vllm/test_hybrid_mamba.py.)
    mamba = MambaSpec(block_size=BLOCK_SIZE, shapes=((4, 8),), dtypes=(torch.float32,),
                      mamba_cache_mode="none")
    message = _refused(tmp_path, store, mamba)
    assert "group 1" in message and "Mamba" in message and "'none'" in message
    assert "--mamba-cache-mode align" in message
    speculative = MambaSpec(block_size=BLOCK_SIZE, shapes=((4, 8),), dtypes=(torch.float32,),
                            mamba_cache_mode="align", num_speculative_blocks=2)
    assert "speculative blocks" in _refused(tmp_path, store, speculative)


def test_cross_attention_is_refused_at_start_up_with_one_line(tmp_path, store):
    cross = CrossAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=4, head_size=16,
                               dtype=torch.float32)
    assert "CrossAttentionSpec" in _refused(tmp_path, store, cross)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_a_failed_load_is_reported_per_request_and_recomputed(tmp_path, fresh_server,
                                                            async_scheduling):
    """vLLM 0.33 refuses block-level load failures from a model of several groups (block
    ids repeat across groups): the connector reports the request (failed_recving), vLLM
    recomputes it, and no read is wrong."""
    srv = fresh_server(dram="64MiB")
    first = hybrid_engine(tmp_path, SLIDING, spec(srv.address), {"a": PROMPT})
    first.add(make_request("a", PROMPT, max_tokens=2))
    run(first)
    second = hybrid_engine(tmp_path, SLIDING, spec(srv.address, timeout=2.0),
                           {"b": PROMPT}, async_scheduling=async_scheduling)
    second.add(make_request("b", PROMPT, max_tokens=2))
    planned = second.schedule()                 # the lookup found 9 pages and leased them
    assert len(planned.kv_connector_metadata.step.loads) == 1
    srv.stop()                                  # ... and the store is gone before the load
    result = second.finish(planned)
    assert result.kv_connector_output.failed_recving == {"b"}
    assert not result.kv_connector_output.invalid_block_ids
    srv.start()
    run(second)
    model = second.worker.model
    assert model.loaded == {"b": 0}             # recomputed from the start
    assert model.reads > 0 and not model.wrong
