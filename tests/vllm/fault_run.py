"""One mixed run under vLLM 0.33's Scheduler or AsyncScheduler, with one fault at a step boundary.

A checking fake model (checking_model.py) compares every attention read of every
scheduled request at every layer with the KV it must see. One engine first fills the store
with some prompts; a second engine then runs a mixed load (prefixes in the store, prefixes
shared within a batch, fresh prompts, chunked prefill, a small KV cache that evicts) and
meets one fault just before the worker runs a chosen step -- after the scheduler's lookups,
before the loads:

    sigkill       the server is killed and restarted empty
    sigterm-disk  the server stops gracefully and restarts from its disk tier
    evict         every unleased page is evicted (between lookup and load)
    sigstop       the server hangs for three steps (or to the end of the run), then resumes
    device        the step's loads fail in their copies (the worker's transfer)

After the run: no request sampled a token over a wrong read, every page in the store under
the run's keys holds the bytes the model computes, every request finished, vLLM's blocks
are all free, and no lease or reservation is left in the store or in the connector.
AsyncScheduler is driven as EngineCore.step_with_batch_queue drives it: the next step is
scheduled before the previous step's output is processed, and the worker runs each step
as late as it can (after the next one was planned), which opens the window between a
step's plan and its loads as wide as a real engine can.

Importing this module needs vLLM (tests guard with pytest.importorskip). Used by
test_faults.py (chosen cases) and test_fault_sweep.py (every step boundary).
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
from dataclasses import dataclass

import numpy as np
from checking_model import GOOD_TOKEN, WRONG_TOKEN, CheckingModel
from harness import (
    ConnectorSpec,
    ModelShape,
    WorkerDriver,
    make_kv_cache_config,
    make_request,
    make_scheduler,
    make_vllm_config,
)
from vllm.v1.outputs import ModelRunnerOutput

from connector.scheduler.hashing import page_keys
from kvstore_client import KVStoreClient
from kvstore_testing.serverproc import ServerProcess, sigstop
from tests.waiting import wait_for

__all__ = ["ENGINES", "FAULTS", "SHAPE", "Engine", "Fault", "RunResult", "Workload", "check_run",
           "new_server", "run_warm", "run_with_fault", "workload"]

SHAPE = ModelShape()
FAULTS = ["sigkill", "sigterm-disk", "evict", "sigstop", "device"]


@dataclass(frozen=True, slots=True)
class Workload:
    """Prompts of the run: the store is warmed with `warm`, the engine runs `run`."""

    warm: dict[str, list[int]]
    run: dict[str, list[int]]


def workload(n: int, seed: int = 0) -> Workload:
    rng = np.random.default_rng(seed)
    systems = [rng.integers(3, 30000, size).tolist() for size in (32, 48, 64, 80)]
    warm, run = {}, {}
    for i, system in enumerate(systems):
        warm[f"warm{i}"] = system + rng.integers(3, 30000, 20).tolist()
    for i in range(n):
        kind = i % 4
        if kind == 3:                                        # a fresh prompt
            prompt = rng.integers(3, 30000, int(rng.integers(20, 90))).tolist()
        elif kind == 2 and i >= 4:                           # a repeat of an earlier one
            prompt = list(run[f"r{i - 4}"])
        else:                                                # a stored or shared prefix
            system = systems[int(rng.integers(len(systems)))]
            prompt = system + rng.integers(3, 30000, int(rng.integers(5, 60))).tolist()
        run[f"r{i}"] = prompt
    return Workload(warm, run)


class Engine:
    """vLLM's scheduler and our connector's worker, stepped with the checking model."""

    def __init__(self, model_dir, address, *, scheduler: str, mode: str, prompts,
                 num_blocks: int = 96):
        spec = ConnectorSpec(
            name="KVStoreConnector", module_path="connector.vllm", role="kv_both",
            extra_config={"server": address, "load_mode": mode, "lookup_timeout": 0.5,
                          "timeout": 1.0, "probe_interval": 0.5, "lease_ms": 3000,
                          "lookup_wait_ms": 5000},   # answered in the step asked: steps fixed
            load_failure_policy="recompute")
        self.async_scheduling = scheduler == "async"
        config = make_vllm_config(model_dir, spec, async_scheduling=self.async_scheduling,
                                  max_num_batched_tokens=192, max_num_seqs=12)
        kv_cache_config = make_kv_cache_config(config, num_blocks=num_blocks)
        self.num_blocks = num_blocks
        self.scheduler = make_scheduler(config, kv_cache_config)
        self.model = CheckingModel(prompts, SHAPE.num_heads, SHAPE.head_size)
        self.worker = WorkerDriver(config, kv_cache_config, SHAPE, writer=self.model)
        self.model.block_tables = lambda req_id: self.worker._requests[req_id].block_ids
        self.prompts = prompts
        self.outputs: dict[str, list[int]] = collections.defaultdict(list)
        self.steps = 0
        self.fault: Fault | None = None
        self.events: list = []
        self.stats: collections.Counter = collections.Counter()   # the connector's counters

    @property
    def connector(self):
        return self.scheduler.get_kv_connector()

    def add(self, req_id: str, max_tokens: int = 3) -> None:
        self.scheduler.add_request(make_request(req_id, self.prompts[req_id],
                                                max_tokens=max_tokens))

    def _launch(self):
        """schedule(); which requests sample is decided now, as vLLM decides it."""
        self.steps += 1
        if self.fault is not None:
            self.fault.before_schedule(self.steps)
        so = self.scheduler.schedule()
        samplers = set()
        for req_id in so.num_scheduled_tokens:
            request = self.scheduler.requests.get(req_id)
            if request is not None and not request.is_prefill_chunk:
                samplers.add(req_id)
        return self.steps, so, samplers

    def _finish(self, launched) -> None:
        """The worker's part of the step, then the scheduler's update. Under async
        scheduling this runs after the next step was scheduled: the latest a worker can
        start a step, so the window between the next plan and this step's loads is open."""
        step, so, samplers = launched
        if self.fault is not None:
            self.fault.before_worker(step, so)
        self.model.begin_step()
        kv_output = self.worker.step(so)
        samples = {r: WRONG_TOKEN if r in self.model.wrong_now else GOOD_TOKEN
                   for r in samplers}
        stats = kv_output.kv_connector_stats if kv_output is not None else None
        for name, value in (stats.data if stats is not None else {}).items():
            self.stats[name] += value
        if kv_output is not None and kv_output.invalid_block_ids:
            self.stats["steps_with_invalid_blocks"] += 1
            self.events.append((step, "invalid", sorted(kv_output.invalid_block_ids)))
        self.events.append((step, dict(so.num_scheduled_tokens)))
        req_ids = list(so.num_scheduled_tokens)
        output = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[samples[r]] if r in samples else [] for r in req_ids],
            kv_connector_output=kv_output)
        for engine_outputs in self.scheduler.update_from_output(so, output).values():
            for out in engine_outputs.outputs:
                self.outputs[out.request_id].extend(out.new_token_ids)

    def run(self, arrivals: list[list[str]], max_steps: int = 400) -> None:
        """Add arrivals[i] before step i; step until every request has finished."""
        queue: collections.deque = collections.deque()
        depth = 2 if self.async_scheduling else 1
        pending = collections.deque(arrivals)
        for _ in range(max_steps):
            if pending:
                for req_id in pending.popleft():
                    self.add(req_id)
            if not pending and not self.scheduler.has_requests() and not queue:
                return
            # EngineCore.step_with_batch_queue: fill the queue, then finish the oldest.
            if self.scheduler.has_requests() and len(queue) < depth:
                queue.appendleft(self._launch())
                if len(queue) < depth:
                    continue
            if queue:
                self._finish(queue.pop())
        raise AssertionError(f"not finished after {max_steps} steps: "
                             f"{list(self.scheduler.requests)}")


def run_warm(model_dir, address, prompts):
    engine = Engine(model_dir, address, scheduler="plain", mode="layerwise", prompts=prompts,
                    num_blocks=256)
    engine.run([list(prompts)])
    engine.connector.shutdown()
    engine.worker.connector.shutdown()
    assert not engine.model.wrong


def stored_pages_check(engine, address):
    """Every page of the run's keys that the store holds has the model's bytes."""
    layout = engine.connector.layouts[0]
    checked = 0
    with KVStoreClient(address) as client:
        ns = client.register_layout(layout)
        for req_id, prompt in engine.prompts.items():
            tokens = np.asarray(prompt + [GOOD_TOKEN] * 3, dtype=np.int32)
            keys = page_keys(tokens, layout.page_tokens, layout.chain_seed)
            present = client.exists(ns, keys)
            for p, (key, there) in enumerate(zip(keys, present)):
                if not there or (p + 1) * layout.page_tokens > len(prompt):
                    continue     # generated tokens' KV counts by position: not compared
                try:
                    got = client.get(ns, [key])[0]
                except KeyError:
                    continue     # evicted meanwhile
                want = engine.model.expected_page(req_id, p * layout.page_tokens,
                                                  layout.page_tokens, SHAPE.num_layers)
                assert np.array_equal(got, want), f"wrong page {p} of {req_id} in the store"
                checked += 1
    return checked


class Fault:
    """One fault, at the first step from `at` on whose plan has loads (the hung store:
    before step `at` is scheduled, so its lookups meet it; it resumes three steps later)."""

    def __init__(self, kind: str, at: int, server: ServerProcess, engine: Engine,
                 exact: bool = False) -> None:
        """exact: at step `at` itself, whether or not it plans loads."""
        self.kind, self.at, self.server, self.engine = kind, at, server, engine
        self.exact = exact
        self.fired_at = 0
        self._transfer = engine.worker.connector.group_workers.workers[0].transfer
        self._real_load = self._transfer.load

    def before_schedule(self, step: int) -> None:
        if self.kind != "sigstop":
            return
        if step == self.at:
            sigstop(self.server.proc.pid)
            self.fired_at = step
        elif step == self.at + 3:
            os.kill(self.server.proc.pid, signal.SIGCONT)

    def before_worker(self, step: int, so) -> None:
        if self.kind == "device" and self.fired_at and step == self.fired_at + 1:
            self._transfer.load = self._real_load
        if self.kind == "sigstop" or self.fired_at or step < self.at:
            return
        if not so.kv_connector_metadata.step.loads and not self.exact:
            return
        self.fired_at = step
        if self.kind in ("sigkill", "sigterm-disk"):
            # No call of the connector's is in flight when the store goes: a lease release
            # sent from the lookup thread meanwhile outlasts its retries if the restart is
            # slow, and opens the breaker. The steps after it here take ~3 ms each, less in
            # all than one probe interval, so the run then ends without writing a page to
            # the restarted store, which is what these faults are here to check (once in
            # CI: 35 pages saved, all before the kill, none stored after). A store that
            # stops answering in the middle of calls is the sigstop fault.
            lookups = self.engine.connector.scheduler_half.prefetch
            assert lookups is None or wait_for(lookups.idle, "the lookup thread idle",
                                               timeout=5.0, interval=0.05)
        if self.kind == "sigkill":
            self.server.stop(signal.SIGKILL)
            self.server.start()
        elif self.kind == "sigterm-disk":
            assert self.server.stop(signal.SIGTERM) == 0
            self.server.start()
        elif self.kind == "evict":
            with KVStoreClient(self.server.address) as client:
                client.evict(everything=True, tier="all")
        elif self.kind == "device":
            self._transfer.load = lambda *args: _FailedCopy()


class _FailedCopy:
    """A load whose copies fail on the device: nothing lands, the wait reports it."""

    def wait_layer(self, layer: int) -> None:
        pass

    def done(self) -> bool:
        from connector.transfer import TransferError
        raise TransferError("injected: the copy failed on the device")

    synchronize = done


# The engines a fault is met under: (scheduler, load mode). Under AsyncScheduler the
# connector loads async whatever it is configured to do (connector.vllm).
ENGINES = [("plain", "layerwise"), ("plain", "async"), ("async", "async")]


def new_server(tmp_path) -> ServerProcess:
    """A server for fault runs (not started): small DRAM that evicts, a disk tier."""
    return ServerProcess(dram="32MiB", disk="64MiB", disk_dir=str(tmp_path / "disk"),
                         lease_ttl="5s")


@dataclass(frozen=True, slots=True)
class RunResult:
    steps: int                 # engine steps the run took
    fired_at: int              # the step the fault met (0: never, or no fault)
    stats: dict                # the connector's counters over the run
    reads: int                 # attention positions read and checked
    pages_checked: int         # stored pages compared with the model's bytes


def run_with_fault(model_dir, tmp_path, fault, scheduler, mode, requests, at=3,
                   exact=False, server: ServerProcess | None = None) -> RunResult:
    """One run of `requests` requests with `fault` (None: none) at step `at` (exact: at
    that step whatever it plans; else the first step from `at` on with loads), then every
    check of check_run. server: a started one to reuse (it is cleared first), else one
    of its own. The run is deterministic: the same fault at the same step replays it."""
    own = server is None
    if own:
        server = new_server(tmp_path).start()
    else:
        with KVStoreClient(server.address) as client:
            client.clear()
    try:
        work = workload(requests)
        run_warm(model_dir, server.address, work.warm)
        engine = Engine(model_dir, server.address, scheduler=scheduler, mode=mode,
                        prompts={**work.warm, **work.run})
        if fault is not None:
            engine.fault = Fault(fault, at, server, engine, exact)
        ids = list(work.run)
        engine.run([ids[i:i + 6] for i in range(0, len(ids), 6)])
        if fault == "sigstop":
            # A hang at one of the run's last three steps outlasts the run: the store
            # resumes now, so that the checks can read it.
            os.kill(server.proc.pid, signal.SIGCONT)
        if fault is not None and not exact:
            assert engine.fault.fired_at, "the fault never met a load"
            assert engine.stats["pages_loaded"] > 0
        checked = check_run(engine, server, ids, pages_expected=not exact)
        return RunResult(engine.steps, engine.fault.fired_at if engine.fault else 0,
                         dict(engine.stats), engine.model.reads, checked)
    finally:
        with contextlib.suppress(ProcessLookupError, TypeError):
            os.kill(server.proc.pid, signal.SIGCONT)
        if own:
            server.stop()


def check_run(engine: Engine, server: ServerProcess, ids: list[str],
              pages_expected: bool = True) -> int:
    """pages_expected: the store must hold pages of the run (not after a late restart).
    Returns how many stored pages were compared."""
    # Every request finished with the tokens of a model that never read wrong KV.
    wrong_tokens = {r: out for r, out in engine.outputs.items() if WRONG_TOKEN in out}
    assert not wrong_tokens, (f"tokens sampled over wrong KV: {wrong_tokens}; wrong reads "
                              f"{engine.model.wrong}; {engine.events}")
    assert all(engine.outputs[r] == [GOOD_TOKEN] * 3 for r in ids), "a request did not finish"
    assert engine.model.reads > 0
    if engine.async_scheduling:
        assert not engine.stats["pages_loaded"] or engine.connector.config.load_mode.value \
            == "async", "layer-wise loads under AsyncScheduler"
    print(f"{engine.steps} steps, {engine.model.reads} positions read and checked, "
          f"connector: {dict(engine.stats)}, wrong reads in rejected steps: "
          f"{len(engine.model.wrong)}")
    # What the store holds under the run's keys is what the model computes.
    checked = stored_pages_check(engine, server.address)
    assert checked > 0 or not pages_expected
    # Nothing leaked: vLLM's blocks, the connector's state, the store's leases.
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == engine.num_blocks - 1
    sched_half = engine.connector.scheduler_half
    # Lease releases wait while the breaker is open; its probe closes it once the store
    # answers, and the next build sends them.
    wait_for(lambda: not sched_half.breaker.open, "the store back", timeout=5.0, interval=0.05)
    sched_half.build()
    assert not sched_half._requests and not sched_half._unconfirmed
    worker_half = engine.worker.connector.group_workers.workers[0]
    assert not worker_half._async and not worker_half._saves and not worker_half._loads
    engine.worker.connector.shutdown()
    engine.connector.shutdown()
    with KVStoreClient(server.address) as client:
        # A call that timed out while the store hung can still take a lease when the store
        # resumes, which no one then releases: it expires by itself (lease_ms 3 s for a
        # lookup, the server's lease_ttl 5 s for Acquire and Reserve).
        wait_for(lambda: client.stats().leases == 0, "no lease left in the store", timeout=8.0,
                 interval=0.05)
    return checked


