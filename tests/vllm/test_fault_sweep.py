"""Each fault at every step boundary of a 100-request mixed run, under both schedulers and
both load modes: 0 wrong reads in accepted steps, 0 wrong pages in the store, every request
finished, 0 leaked blocks, leases and reservations (fault_run.py's checks, every run).

A fault-free run first counts the run's steps N (the run is deterministic: the same
fault at the same step replays the same run); then step k = 1..N each gets the fault
exactly there, whether or not that step plans loads. One server per case, cleared between
runs (a restart fault restarts it). By default a seeded sample of SAMPLE steps per case
runs (CI); KVSTORE_FAULT_SWEEP=all runs every step, KVSTORE_FAULT_SWEEP_SEED picks
another sample. Each case prints its runs, steps and time.
"""

from __future__ import annotations

import os
import random
import time

import pytest

pytest.importorskip("vllm", reason="needs vLLM 0.33 (scripts/venv-vllm.sh)")

from fault_run import ENGINES, FAULTS, new_server, run_with_fault

REQUESTS = 100
SAMPLE = 2                                            # steps per case outside a full sweep
FULL = os.environ.get("KVSTORE_FAULT_SWEEP", "") == "all"
SEED = int(os.environ.get("KVSTORE_FAULT_SWEEP_SEED", "16"))


def steps_to_sweep(case: str, n: int) -> list[int]:
    if FULL:
        return list(range(1, n + 1))
    # Seeded per case, so each case samples its own steps and a rerun replays them.
    return sorted(random.Random(f"{SEED}-{case}").sample(range(1, n + 1), min(SAMPLE, n)))


@pytest.mark.slow
@pytest.mark.parametrize(("scheduler", "mode"), ENGINES, ids=[f"{s}-{m}" for s, m in ENGINES])
@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_at_every_step_boundary(model_dir, tmp_path, fault, scheduler, mode):
    case = f"{fault}-{scheduler}-{mode}"
    start = time.monotonic()
    server = new_server(tmp_path).start()
    try:
        base = run_with_fault(model_dir, tmp_path, None, scheduler, mode, REQUESTS,
                              server=server)
        steps = steps_to_sweep(case, base.steps)
        met_loads = 0
        for k in steps:
            result = run_with_fault(model_dir, tmp_path, fault, scheduler, mode, REQUESTS,
                                    at=k, exact=True, server=server)
            assert result.fired_at == k, f"{case}: the fault at step {k} never fired"
            met_loads += result.stats.get("load_failures", 0) > 0
    finally:
        server.stop()
    print(f"\nsweep {case}: {len(steps)} of {base.steps} step boundaries, "
          f"{'all' if FULL else f'seed {SEED}'}, {met_loads} runs with a failed load, "
          f"0 wrong reads or pages, {time.monotonic() - start:.1f} s")
