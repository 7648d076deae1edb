"""Faults at a step boundary of a mixed run, under vLLM 0.33's Scheduler and AsyncScheduler.

The run, the faults and the checks are fault_run.py's: every attention read of every step
compared with the KV it must see, every stored page compared after the run, every request
finished, blocks, leases and reservations back to zero. Here: each fault under each engine
at one step, two 100-request runs, and what a hung store costs a step. test_fault_sweep.py
puts each fault at every step boundary.
"""

from __future__ import annotations

import collections
import os
import signal
import time

import pytest

pytest.importorskip("vllm", reason="needs vLLM 0.33 (scripts/venv-vllm.sh)")

from checking_model import GOOD_TOKEN  # noqa: E402
from fault_run import ENGINES, FAULTS, Engine, run_warm, run_with_fault, workload  # noqa: E402

from kvstore_bench.serverproc import ServerProcess, sigstop  # noqa: E402

# "async-layerwise" checks that AsyncScheduler gets async loads whatever the config says,
# with the faults that showed why.
CASES = [pytest.param(f, s, m, id=f"{f}-{s}-{m}") for f in FAULTS for s, m in ENGINES]
CASES.append(pytest.param("sigkill", "async", "layerwise", id="sigkill-async-layerwise"))
CASES.append(pytest.param("device", "async", "layerwise", id="device-async-layerwise"))


@pytest.mark.parametrize(("fault", "scheduler", "mode"), CASES)
def test_one_fault_in_a_mixed_run(model_dir, tmp_path, fault, scheduler, mode):
    run_with_fault(model_dir, tmp_path, fault, scheduler, mode, requests=40)


@pytest.mark.slow
@pytest.mark.parametrize(("fault", "scheduler", "mode"), [
    pytest.param("sigkill", "plain", "layerwise", id="sigkill-plain-layerwise"),
    pytest.param("device", "async", "async", id="device-async-async")])
def test_one_fault_in_a_hundred_request_run(model_dir, tmp_path, fault, scheduler, mode):
    run_with_fault(model_dir, tmp_path, fault, scheduler, mode, requests=100)


@pytest.mark.slow
@pytest.mark.parametrize("step", range(1, 13))       # the shortest run has 13 steps
@pytest.mark.parametrize(("scheduler", "mode"), [("plain", "layerwise"), ("async", "async")])
def test_a_restart_at_every_step_boundary(model_dir, tmp_path, scheduler, mode, step):
    run_with_fault(model_dir, tmp_path, "sigkill", scheduler, mode, requests=40, at=step,
                   exact=True)


@pytest.mark.parametrize("scheduler", ["plain", "async"])
def test_a_hung_store_holds_no_request_back(model_dir, tmp_path, scheduler):
    """With the server stopped (SIGSTOP), new requests -- with pages in the store or with
    none -- are all scheduled within two steps; only the step that meets the hang waits,
    and for at most one lookup timeout (0.5 s here)."""
    server = ServerProcess(dram="32MiB", lease_ttl="5s").start()
    try:
        work = workload(8)
        run_warm(model_dir, server.address, work.warm)
        engine = Engine(model_dir, server.address, scheduler=scheduler, mode="async",
                        prompts={**work.warm, **work.run})
        sigstop(server.proc.pid)
        ids = list(work.run)                 # r0, r1: stored prefixes; r3, r7: fresh
        for req_id in ids:
            engine.add(req_id)
        times, scheduled = [], set()
        queue: collections.deque = collections.deque()
        for _ in range(2):
            start = time.monotonic()
            launched = engine._launch()
            times.append(time.monotonic() - start)
            scheduled |= set(launched[1].num_scheduled_tokens)
            queue.appendleft(launched)
            if len(queue) == (2 if engine.async_scheduling else 1):
                engine._finish(queue.pop())
        assert scheduled == set(ids), f"held back: {set(ids) - scheduled}"
        assert max(times) < 0.5 + 0.4 and sorted(times)[0] < 0.2, times
        os.kill(server.proc.pid, signal.SIGCONT)
        while queue:
            engine._finish(queue.pop())
        engine.run([])
        assert all(engine.outputs[r] == [GOOD_TOKEN] * 3 for r in ids)
        assert not engine.model.wrong
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        server.stop()

