"""vLLM 0.33's real scheduler and connector factory driving connector.vllm against a real
kvstore-server: lookups, WAITING_FOR_REMOTE_KVS, saves, loads of bytes, failures."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm", reason="needs vLLM 0.33 (scripts/venv-vllm.sh)")

import torch
from harness import (
    BLOCK_SIZE,
    ConnectorSpec,
    ModelShape,
    SchedulerDriver,
    WorkerDriver,
    fill_prompt_kv,
    make_kv_cache_config,
    make_request,
    make_scheduler,
    make_vllm_config,
)
from vllm.v1.request import RequestStatus

from kvstore_client import KVStoreClient
from kvstore_testing.serverproc import ServerProcess
from tests.waiting import wait_for

SHAPE = ModelShape()
PROMPT = list(range(1000, 1064))           # 64 tokens: 3 pages can be claimed (not the last)


def engine(model_dir, address, *, mode="layerwise", role="kv_both", async_scheduling=False,
           policy="recompute", lookup_wait_ms=5000):
    # These tests count steps: a new request's first ask waits for its lookup (a cold
    # connection's first one outlasts the default 2 ms on a loaded machine), except where
    # a test sets lookup_wait_ms to see "ask again".
    spec = ConnectorSpec(name="KVStoreConnector", module_path="kvstore_connector.vllm", role=role,
                         extra_config={"server": address, "load_mode": mode,
                                       "lookup_timeout": 5.0,
                                       "lookup_wait_ms": lookup_wait_ms},
                         load_failure_policy=policy)
    config = make_vllm_config(model_dir, spec, async_scheduling=async_scheduling)
    kv_cache_config = make_kv_cache_config(config)
    scheduler = make_scheduler(config, kv_cache_config)
    worker = WorkerDriver(config, kv_cache_config, SHAPE)
    return SchedulerDriver(scheduler, worker)


def run_to_completion(driver, req_id, max_steps=20):
    seen = []
    for _ in range(max_steps):
        if req_id not in driver.scheduler.requests:
            break
        seen.append(driver.status(req_id))
        driver.step()
    return seen


def expected_kv(driver, req_id, upto):
    """What fill_prompt_kv writes for the request's first `upto` tokens, per layer."""
    request = driver.request(req_id)
    blocks = driver.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
    out = {}
    for name in SHAPE.layer_names:
        cache = torch.zeros_like(driver.worker.kv_caches[name])
        slots = [(req_id, p, blocks[p // BLOCK_SIZE], p % BLOCK_SIZE,
                  request.all_token_ids[p]) for p in range(upto)]
        fill_prompt_kv(name, cache, slots)
        out[name] = (cache, [s[2:4] for s in slots])
    return out


def assert_loaded(driver, req_id, upto):
    for name, (want, places) in expected_kv(driver, req_id, upto).items():
        got = driver.worker.kv_caches[name]
        for block, offset in places:
            assert torch.equal(got[block, :, offset], want[block, :, offset]), (name, block)


@pytest.fixture
def store(fresh_server):
    return fresh_server(dram="64MiB")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_stored_prefix_goes_through_waiting_for_remote_kvs(model_dir, store, async_scheduling):
    first = engine(model_dir, store.address, mode="async", async_scheduling=async_scheduling)
    first.add(make_request("a", PROMPT, max_tokens=2))
    run_to_completion(first, "a")
    with KVStoreClient(store.address) as c:
        assert c.stats().tiers[0].pages == 4          # every full page of the prompt saved

    second = engine(model_dir, store.address, mode="async", async_scheduling=async_scheduling)
    second.add(make_request("b", PROMPT, max_tokens=2))
    assert second.status("b") == RequestStatus.WAITING
    second.step()
    assert second.status("b") == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert second.request("b").num_computed_tokens == 48
    # The load is reported by the worker, then the next schedule() runs the request.
    for _ in range(5):
        second.step()
        if second.status("b") == RequestStatus.RUNNING:
            break
    assert second.status("b") == RequestStatus.RUNNING
    assert_loaded(second, "b", 48)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_a_burst_is_looked_up_off_the_loop_and_admitted_at_a_later_ask(model_dir, store,
                                                                       async_scheduling):
    """Prefetched lookups with no wait: vLLM's schedule() hears "ask again" for every new
    request, skips them, and admits them with their hits once the answers have come."""
    first = engine(model_dir, store.address)
    first.add(make_request("a", PROMPT, max_tokens=2))
    run_to_completion(first, "a")
    burst = engine(model_dir, store.address, lookup_wait_ms=0,
                   async_scheduling=async_scheduling)
    # Connected and registered first: the first lookup also opens the connection, and an
    # ask that finds a call in flight past 2 ms (the store may hang) waits for its answer.
    burst.add(make_request("warm", list(range(3000, 3040)), max_tokens=2))
    for _ in range(200):                               # it hears "ask again" at first
        if "warm" not in burst.scheduler.requests:
            break
        burst.step()
        time.sleep(0.01)
    assert "warm" not in burst.scheduler.requests
    ids = [f"b{i}" for i in range(6)]
    burst.add(*(make_request(r, PROMPT, max_tokens=2) for r in ids))
    out = burst.schedule()
    assert not out.scheduled_new_reqs                  # all asked again
    assert all(burst.status(r) == RequestStatus.WAITING for r in ids)
    burst.finish(out)
    admitted = {}
    for _ in range(40):                                # answers as they come
        time.sleep(0.02)
        out = burst.schedule()
        # Layer-wise: running this step; AsyncScheduler loads async: waiting for the KV.
        admitted.update((n.req_id, n.num_computed_tokens) for n in out.scheduled_new_reqs)
        admitted.update((r, burst.request(r).num_computed_tokens) for r in ids
                        if r in burst.scheduler.requests      # not finished already
                        and burst.status(r) == RequestStatus.WAITING_FOR_REMOTE_KVS)
        burst.finish(out)
        if len(admitted) == len(ids):
            break
    assert admitted == dict.fromkeys(ids, 48)
    for r in ids:
        run_to_completion(burst, r)
        assert r not in burst.scheduler.requests
    with KVStoreClient(store.address) as c:
        wait_for(lambda: not c.stats().leases, "no lease left in the store", timeout=5,
                 interval=0.05)


def test_layerwise_load_runs_in_the_same_step(model_dir, store):
    first = engine(model_dir, store.address)
    first.add(make_request("a", PROMPT, max_tokens=2))
    run_to_completion(first, "a")
    second = engine(model_dir, store.address)
    second.add(make_request("b", PROMPT, max_tokens=2))
    out = second.schedule()
    assert second.status("b") == RequestStatus.RUNNING
    assert out.scheduled_new_reqs[0].num_computed_tokens == 48
    assert out.has_sync_kv_loads
    result = second.finish(out)
    assert_loaded(second, "b", 48)
    stats = result.kv_connector_output.kv_connector_stats
    assert stats.data["pages_loaded"] == 3 and stats.data["bytes_loaded"] > 0


def test_no_hit_and_producer_consumer_hand_over(model_dir, store):
    producer = engine(model_dir, store.address, role="kv_producer")
    producer.add(make_request("p", PROMPT, max_tokens=1))
    run_to_completion(producer, "p")
    consumer = engine(model_dir, store.address, role="kv_consumer")
    consumer.add(make_request("c", PROMPT, max_tokens=4))
    out = consumer.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 48
    consumer.finish(out)
    assert_loaded(consumer, "c", 48)
    consumer.add(make_request("other", list(range(5000, 5064)), max_tokens=1))
    out = consumer.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    with KVStoreClient(store.address) as c:
        pages = c.stats().tiers[0].pages
    consumer.finish(out)
    with KVStoreClient(store.address) as c:
        assert c.stats().tiers[0].pages == pages      # the consumer saved nothing


def test_failed_load_is_reported_and_recomputed(model_dir, store):
    first = engine(model_dir, store.address)
    first.add(make_request("a", PROMPT, max_tokens=1))
    run_to_completion(first, "a")
    second = engine(model_dir, store.address, mode="async")
    second.add(make_request("b", PROMPT, max_tokens=8))
    out = second.schedule()                         # the lookup found 48 tokens
    assert second.status("b") == RequestStatus.WAITING_FOR_REMOTE_KVS
    store.stop()                                     # the store restarts, empty
    again = ServerProcess(port=store.port, dram="64MiB").start()
    try:
        result = second.finish(out)
        assert result.kv_connector_output.invalid_block_ids
        out = second.schedule()          # promoted: rescheduled from the failed block on
        assert second.status("b") == RequestStatus.RUNNING
        assert out.scheduled_new_reqs[0].num_computed_tokens == 0   # recomputed, not loaded
        assert out.num_scheduled_tokens["b"] == len(PROMPT)
        second.finish(out)
    finally:
        again.stop()


def test_store_down_serves_without_it(model_dir, store):
    driver = engine(model_dir, store.address)
    store.stop()
    driver.add(make_request("x", PROMPT, max_tokens=1))
    out = driver.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0


class SaveGate:
    """The worker's save copies as a slow device runs them: not landed until `open`."""

    def __init__(self, transfer) -> None:
        self.open = False
        self.handles = []
        real = transfer.finish_save

        def finish_save(wait=True):
            self.handles.append(real(wait))
            return self
        transfer.finish_save = finish_save

    def done(self) -> bool:
        return self.open and all(h.done() for h in self.handles)

    def synchronize(self) -> None:
        for h in self.handles:
            h.synchronize()


def test_a_finished_requests_blocks_wait_for_its_saves_to_land(model_dir, store):
    driver = engine(model_dir, store.address)
    gate = SaveGate(driver.worker.connector.group_workers.workers[0].transfer)
    pool = driver.scheduler.kv_cache_manager.block_pool
    free = pool.get_num_free_blocks()
    driver.add(make_request("a", PROMPT, max_tokens=1))
    result = driver.step()                  # prefill, 4 pages saved, finished
    assert result.engine_outputs            # the token came out at once ...
    for _ in range(3):                      # ... but vLLM holds the blocks (delay free)
        assert "a" in driver.scheduler.requests
        assert pool.get_num_free_blocks() < free
        with KVStoreClient(store.address) as c:
            assert c.stats().tiers[0].pages == 0      # not committed either
        driver.step()
    gate.open = True
    result = driver.step()
    assert result.kv_connector_output.finished_sending == {"a"}
    assert "a" not in driver.scheduler.requests
    assert pool.get_num_free_blocks() == free
    with KVStoreClient(store.address) as c:
        assert c.stats().tiers[0].pages == 4
