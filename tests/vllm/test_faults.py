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

from checking_model import GOOD_TOKEN
from fault_run import (
    ENGINES,
    FAULTS,
    Engine,
    check_run,
    new_server,
    run_warm,
    run_with_fault,
    workload,
)

from kvstore_testing.serverproc import ServerProcess, sigstop

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



class _Hang:
    """The store hangs (SIGSTOP) at step `start` -- before its plan, so the scheduler
    half's lookups meet it first, or (where="worker") before the worker runs the first
    step from `start` on that loads, after the plan's lookups answered -- and resumes
    before step `end` is planned."""

    def __init__(self, server, where: str, start: int, end: int) -> None:
        self.server, self.where, self.start, self.end = server, where, start, end
        self.fired_at = 0

    def before_schedule(self, step: int) -> None:
        if self.where == "scheduler" and step == self.start:
            self._stop(step)
        elif step == self.end and self.fired_at:
            os.kill(self.server.proc.pid, signal.SIGCONT)

    def before_worker(self, step: int, so) -> None:
        if (self.where == "worker" and not self.fired_at and self.start <= step < self.end
                and so.kv_connector_metadata.step.loads):
            self._stop(step)

    def _stop(self, step: int) -> None:
        sigstop(self.server.proc.pid)
        self.fired_at = step


# What a hung store may cost one step of each side: the step that meets it waits for one
# call's timeout (lookup_timeout 0.5 s for the scheduler half, timeout 1.0 s for the
# worker's Acquire/Reserve/Commit); every other step makes no call to the store. SLACK is
# the noisy machine's allowance over the connector's own work per step.
LOOKUP_TIMEOUT, TIMEOUT, SLACK = 0.5, 1.0, 0.25


@pytest.mark.parametrize("where", ["scheduler", "worker"])
@pytest.mark.parametrize("scheduler", ["plain", "async"])
def test_a_hung_store_costs_one_step_one_timeout_then_nothing(model_dir, tmp_path,
                                                              scheduler, where):
    """A store hung for 16 steps (several probe intervals) while a request arrives every
    step: the scheduler side (schedule + update_from_output) pays at most one
    lookup_timeout in one step, the worker side at most one timeout in one step, every
    other step under SLACK; every request arriving during the hang, with pages in the
    store or none, is scheduled within two steps; then the full checks of a fault run."""
    server = new_server(tmp_path).start()
    try:
        work = workload(36)
        run_warm(model_dir, server.address, work.warm)
        engine = Engine(model_dir, server.address, scheduler=scheduler, mode="async"
                        if scheduler == "async" else "layerwise",
                        prompts={**work.warm, **work.run})
        hang = engine.fault = _Hang(server, where, start=6, end=22)
        cost = {"scheduler": collections.Counter(), "worker": collections.Counter()}
        arrived, first_scheduled = {}, {}

        def timed(side, fn):
            def call(*args):
                begin = time.monotonic()
                try:
                    return fn(*args)
                finally:
                    cost[side][engine.steps] += time.monotonic() - begin
            return call

        def add(req_id, real_add=engine.add):
            arrived[req_id] = engine.steps + 1
            real_add(req_id)

        engine.add = add
        engine.scheduler.schedule = timed("scheduler", engine.scheduler.schedule)
        engine.scheduler.update_from_output = timed("scheduler",
                                                    engine.scheduler.update_from_output)
        engine.worker.step = timed("worker", engine.worker.step)
        ids = list(work.run)
        engine.run([[req_id] for req_id in ids])
        assert hang.fired_at, "the hang never started"
        hung = range(hang.fired_at, hang.end)
        for side, limit in (("scheduler", LOOKUP_TIMEOUT), ("worker", TIMEOUT)):
            during = sorted(cost[side][s] for s in hung)
            print(f"{side} side, {where} met the hang at step {hang.fired_at}: per step "
                  f"while hung max {during[-1]:.3f} s, then {during[-2]:.3f} s, median "
                  f"{during[len(during) // 2] * 1e3:.1f} ms")
            assert during[-1] < limit + SLACK, (side, during)
            assert during[-2] < SLACK, (side, during)      # one step at most pays
        for event in engine.events:                      # (step, {req_id: tokens})
            if isinstance(event[1], dict):
                for req_id in event[1]:
                    first_scheduled.setdefault(req_id, event[0])
        late = {r: (arrived[r], first_scheduled.get(r)) for r in ids
                if arrived[r] in hung and first_scheduled.get(r, 10**9) > arrived[r] + 2}
        assert not late, f"held back by the hung store: {late}; {engine.events}"
        check_run(engine, server, ids)
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        server.stop()
