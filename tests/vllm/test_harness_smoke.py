"""The harness drives vLLM's real scheduler and worker-role connector through an async load."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vLLM 0.33 (scripts/venv-vllm.sh)")

import harness
from harness import BLOCK_SIZE, ConnectorSpec, SchedulerDriver, WorkerDriver
from toy_connector import ToyConnector, ToyMetadata
from vllm.v1.request import RequestStatus

HIT = 48  # three blocks claimed by the toy store
PROMPT = list(range(1000, 1000 + 80))  # five blocks

SCHEDULERS = pytest.mark.parametrize(
    "async_scheduling", [False, True], ids=["sync", "async"]
)


def _build(
    model_dir: Path, async_scheduling: bool, with_worker: bool, **extra: object
) -> SchedulerDriver:
    spec = ConnectorSpec(
        name="ToyConnector",
        module_path="toy_connector",
        role="kv_both",
        extra_config={"hit_tokens": HIT, **extra},
    )
    vllm_config = harness.make_vllm_config(
        model_dir, spec, async_scheduling=async_scheduling
    )
    kv_cache_config = harness.make_kv_cache_config(vllm_config)
    scheduler = harness.make_scheduler(vllm_config, kv_cache_config)
    worker = WorkerDriver(vllm_config, kv_cache_config) if with_worker else None
    return SchedulerDriver(scheduler, worker)


@SCHEDULERS
def test_scheduler_class_follows_async_scheduling(
    model_dir: Path, async_scheduling: bool
):
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    engine = _build(model_dir, async_scheduling, with_worker=False)
    assert isinstance(engine.scheduler, AsyncScheduler) == async_scheduling
    assert isinstance(engine.connector, ToyConnector)
    # HMA is off (no SupportsHMA, and this CPU platform has none): one KV cache group,
    # so the scheduler calls request_finished, not request_finished_all_groups.
    assert engine.scheduler.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager


@SCHEDULERS
def test_async_hit_waits_for_remote_kvs_then_runs(
    model_dir: Path, async_scheduling: bool
):
    """Scheduler only: the test plays the worker and reports the load a step later."""
    engine = _build(model_dir, async_scheduling, with_worker=False)
    engine.add(harness.make_request("r1", PROMPT, max_tokens=3))
    assert engine.status("r1") == RequestStatus.WAITING

    first = engine.step()
    assert engine.status("r1") == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert first.scheduler_output.total_num_scheduled_tokens == 0
    assert engine.request("r1").num_computed_tokens == HIT  # set while it waits
    (alloc,) = engine.connector.alloc_calls
    assert alloc.num_external_tokens == HIT
    assert len(alloc.block_ids) == HIT // BLOCK_SIZE  # blocks for the hit only
    meta = first.scheduler_output.kv_connector_metadata
    assert isinstance(meta, ToyMetadata)
    assert meta.loads == {"r1": list(alloc.block_ids)}

    engine.step(finished_recving={"r1"})  # the load is reported done
    assert (
        engine.status("r1") == RequestStatus.WAITING_FOR_REMOTE_KVS
    )  # promoted next schedule

    third = engine.step()
    assert engine.status("r1") == RequestStatus.RUNNING
    assert [r.req_id for r in third.scheduler_output.scheduled_new_reqs] == ["r1"]
    (new_req,) = third.scheduler_output.scheduled_new_reqs
    assert new_req.num_computed_tokens == HIT
    assert third.scheduler_output.num_scheduled_tokens["r1"] == len(PROMPT) - HIT
    # A second update_state_after_alloc, with 0 external tokens and all the blocks.
    assert [c.num_external_tokens for c in engine.connector.alloc_calls] == [HIT, 0]
    assert len(engine.connector.alloc_calls[1].block_ids) == len(PROMPT) // BLOCK_SIZE


@SCHEDULERS
def test_worker_connector_gets_metadata_and_reports_the_load(
    model_dir: Path, async_scheduling: bool
):
    """Scheduler and factory-built worker connector in one loop, as in an engine."""
    engine = _build(model_dir, async_scheduling, with_worker=True, load_steps=1)
    worker = engine.worker
    assert worker is not None
    toy = worker.connector
    assert isinstance(toy, ToyConnector) and toy is not engine.connector
    assert toy.role.name == "WORKER" and engine.connector.role.name == "SCHEDULER"
    assert set(toy.kv_caches) == set(harness.ModelShape().layer_names)

    engine.add(harness.make_request("r1", PROMPT, max_tokens=3))
    statuses = []
    for _ in range(6):
        result = engine.step()
        statuses.append(engine.status("r1"))
        if statuses[-1] == RequestStatus.RUNNING:
            break
    # Step 1 starts the load, step 2 reports it, step 3 schedules the rest of the prompt.
    assert statuses == [
        RequestStatus.WAITING_FOR_REMOTE_KVS,
        RequestStatus.WAITING_FOR_REMOTE_KVS,
        RequestStatus.RUNNING,
    ]
    (new_req,) = result.scheduler_output.scheduled_new_reqs
    assert new_req.num_computed_tokens == HIT

    # The worker half saw exactly the metadata the scheduler half built, in order.
    assert toy.bound == engine.connector.built
    assert toy.bound[0].loads == {"r1": list(engine.connector.alloc_calls[0].block_ids)}

    # Call order: steps 1-2 have no tokens (no layers); step 3 runs both layers.
    layer0, layer1 = harness.ModelShape().layer_names
    empty_step = [
        "handle_preemptions",
        "bind_connector_metadata",
        "start_load_kv",
        "wait_for_save",
        "get_finished",
        "get_block_ids_with_load_errors",
        "clear_connector_metadata",
    ]
    forward_step = [
        "handle_preemptions",
        "bind_connector_metadata",
        f"wait_for_layer_load:{layer0}",
        f"save_kv_layer:{layer0}",
        f"wait_for_layer_load:{layer1}",
        f"save_kv_layer:{layer1}",
        "start_load_kv",  # no sync loads this step: started after the forward
        "wait_for_save",
        "get_finished",
        "get_block_ids_with_load_errors",
        "clear_connector_metadata",
    ]
    assert toy.calls == ["register_kv_caches", *empty_step, *empty_step, *forward_step]

    # The "model" wrote the prompt tail's KV into the request's blocks.
    kv = worker.kv_caches[layer0]
    first_computed_block = new_req.block_ids[0][HIT // BLOCK_SIZE]
    assert kv[first_computed_block].abs().sum() > 0
    assert (
        kv[new_req.block_ids[0][0]].abs().sum() == 0
    )  # loaded blocks: toy moved nothing


@SCHEDULERS
def test_deferred_lookup_is_asked_again(model_dir: Path, async_scheduling: bool):
    """get_num_new_matched_tokens -> None: the request stays WAITING and is asked again."""
    engine = _build(model_dir, async_scheduling, with_worker=False, defer_lookups=2)
    engine.add(harness.make_request("r1", PROMPT, max_tokens=3))
    engine.step()
    engine.step()
    assert engine.status("r1") == RequestStatus.WAITING
    engine.step()
    assert engine.status("r1") == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert [n for _, n in engine.connector.lookups] == [0, 0, 0]


@SCHEDULERS
def test_failed_load_is_an_error_under_fail_policy(
    model_dir: Path, async_scheduling: bool
):
    """invalid_block_ids for a waiting request + kv_load_failure_policy="fail"."""
    engine = _build(model_dir, async_scheduling, with_worker=True, fail_load=True)
    engine.add(harness.make_request("r1", PROMPT, max_tokens=3))
    engine.step()
    result = engine.step()  # the worker reports r1 finished with its blocks invalid
    assert result.kv_connector_output is not None
    assert result.kv_connector_output.invalid_block_ids
    (outputs,) = result.engine_outputs.values()
    (out,) = [o for o in outputs.outputs if o.request_id == "r1"]
    assert out.finish_reason is not None and str(out.finish_reason) == "error"
    assert "r1" not in engine.scheduler.requests


@SCHEDULERS
def test_failed_load_is_recomputed_under_recompute_policy(
    model_dir: Path, async_scheduling: bool
):
    """Same failure with kv_load_failure_policy="recompute": the prefix is recomputed.

    vLLM frees the blocks and sends the request through the connector lookup again,
    so the connector must not claim the failed hit a second time (the toy remembers).
    """
    spec = ConnectorSpec(
        name="ToyConnector",
        module_path="toy_connector",
        extra_config={"hit_tokens": HIT, "fail_load": True},
        load_failure_policy="recompute",
    )
    vllm_config = harness.make_vllm_config(
        model_dir, spec, async_scheduling=async_scheduling
    )
    kv_cache_config = harness.make_kv_cache_config(vllm_config)
    engine = SchedulerDriver(
        harness.make_scheduler(vllm_config, kv_cache_config),
        WorkerDriver(vllm_config, kv_cache_config),
    )
    engine.add(harness.make_request("r1", PROMPT, max_tokens=3))
    engine.step()
    engine.step()  # finished_recving + every loaded block invalid
    assert engine.status("r1") == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert engine.request("r1").num_computed_tokens == 0  # cut at the first bad block
    third = engine.step()
    assert engine.status("r1") == RequestStatus.RUNNING
    assert third.scheduler_output.num_scheduled_tokens["r1"] == len(PROMPT)
    assert [n for _, n in engine.connector.lookups] == [0, 0]  # asked again
    assert engine.connector.failed_req_ids == {"r1"}


def test_async_scheduler_with_two_batches_in_flight(model_dir: Path):
    """The engine core's batch queue: schedule step N+1 before step N's output is back."""
    engine = _build(model_dir, True, with_worker=True, load_steps=0)
    engine.add(harness.make_request("r1", PROMPT, max_tokens=4))
    in_flight = [engine.schedule()]
    seen = []
    for _ in range(8):
        in_flight.append(engine.schedule())
        engine.finish(in_flight.pop(0))
        seen.append(engine.status("r1"))
        if engine.request("r1").num_output_tokens >= 2:
            break
    assert seen[0] == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert RequestStatus.RUNNING in seen
    assert engine.request("r1").num_output_tokens >= 2


@SCHEDULERS
def test_sync_hit_runs_at_once_and_loads_before_the_layers(
    model_dir: Path, async_scheduling: bool
):
    """async=False: scheduled in the same step, has_sync_kv_loads, start_load_kv first."""
    engine = _build(model_dir, async_scheduling, with_worker=True, async_load=False)
    engine.add(harness.make_request("r1", PROMPT, max_tokens=3))
    result = engine.step()
    assert engine.status("r1") == RequestStatus.RUNNING
    so = result.scheduler_output
    assert so.has_sync_kv_loads
    (new_req,) = so.scheduled_new_reqs
    assert new_req.num_computed_tokens == HIT
    assert so.num_scheduled_tokens["r1"] == len(PROMPT) - HIT
    (alloc,) = engine.connector.alloc_calls  # one call, with every block of the prompt
    assert alloc.num_external_tokens == HIT
    assert len(alloc.block_ids) == len(PROMPT) // BLOCK_SIZE
    calls = engine.worker.connector.calls
    assert calls.index("start_load_kv") < calls.index(
        f"wait_for_layer_load:{harness.ModelShape().layer_names[0]}"
    )
