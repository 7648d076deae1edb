"""The reference engine against a real server: requests served from stored pages give the
logits of a full recompute.

CPU, tiny preset, fp32: a prefix loaded from the store, then the rest of the prompt as its
own chunk, differs from one full prefill only by GEMM-shape rounding, so logits must agree
within 1e-5 and greedy tokens exactly. (On a GPU in bf16 different chunkings shift logits
by up to ~0.1; there, kvstore_bench.e2e_bench compares a stored-prefix run against a
recompute split at the same chunk boundaries, where the logits agree exactly.)
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvstore_bench.engine.engine import Engine  # noqa: E402
from kvstore_bench.engine.kvconnector import StoreConnector, page_layout  # noqa: E402
from kvstore_bench.engine.model import LlamaModel, ModelConfig  # noqa: E402
from kvstore_bench.engine.paged_cache import allocate_kv_caches  # noqa: E402
from kvstore_bench.engine.scheduler import (  # noqa: E402
    Request,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    StepResult,
)
from kvstore_client import KVStoreClient  # noqa: E402
from kvstore_connector.config import ConnectorConfig, LoadMode  # noqa: E402
from kvstore_connector.scheduler.hashing import page_keys  # noqa: E402
from kvstore_testing.serverproc import ServerProcess  # noqa: E402

BLOCK = 16
TOL = 1e-5
SEED = 1234
MODES = [LoadMode.LAYERWISE, LoadMode.ASYNC]


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return LlamaModel(ModelConfig.preset("tiny"), device="cpu", dtype=torch.float32, seed=SEED)


@pytest.fixture
def srv(fresh_server):
    return fresh_server(dram="64MiB", lease_ttl="5s")


def make_engine(model, server=None, *, num_blocks=64, budget=8192, page_tokens=BLOCK,
                connector_cls=StoreConnector, **config) -> Engine:
    caches = allocate_kv_caches(model.cache_spec(num_blocks, BLOCK), dtype=model.dtype,
                                device=model.device)
    for t in caches.values():           # stale data everywhere: a bad read shows in logits
        t.normal_(0.0, 3.0, generator=torch.Generator().manual_seed(5))
    connector = None
    if server is not None:
        layout = page_layout(model.config, model.dtype, page_tokens, weights=f"seed={SEED}")
        connector = connector_cls(ConnectorConfig(server=server.address, **config), layout,
                                  caches, BLOCK)
    return Engine(model, caches, SchedulerConfig(num_blocks, BLOCK, budget),
                  connector=connector)


def prompt(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 512, n).astype(np.int32)


def serve(engine: Engine, requests: dict[str, np.ndarray], max_tokens: int = 4):
    for req_id, tokens in requests.items():
        engine.add_request(req_id, tokens, max_tokens, keep_logits=True)
    return engine.run(max_steps=500)


def recompute(model, tokens, max_tokens=4):
    """The reference: no store, the whole prompt in one step, then greedy decode."""
    return serve(make_engine(model), {"ref": tokens}, max_tokens)["ref"]


def assert_same(out, ref):
    assert out.token_ids == ref.token_ids
    diff = (out.logits - ref.logits).abs().max().item()
    assert diff < TOL, f"max abs logit difference {diff}"


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_full_hit_equals_recompute(model, srv, mode):
    tokens = prompt(100, 1)
    ref = recompute(model, tokens)
    first = serve(make_engine(model, srv), {"a": tokens})["a"]
    assert first.num_external_tokens == 0
    assert_same(first, ref)
    engine = make_engine(model, srv, load_mode=mode)
    out = serve(engine, {"b": tokens})["b"]
    assert out.num_external_tokens == 96       # every full page; never the last token
    assert engine.num_computed_tokens == 4 + 3  # the rest of the prompt, then 3 decodes
    assert_same(out, ref)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_partial_hit(model, srv, mode):
    stored = prompt(96, 2)
    serve(make_engine(model, srv), {"a": stored})
    tokens = np.concatenate([stored[:40], prompt(50, 3)])   # shares 2 whole pages
    engine = make_engine(model, srv, load_mode=mode)
    out = serve(engine, {"b": tokens})["b"]
    assert out.num_external_tokens == 32
    assert engine.num_computed_tokens == 90 - 32 + 3
    assert_same(out, recompute(model, tokens))


@pytest.mark.parametrize("page_tokens", [16, 32])
def test_page_unaligned_prompt(model, srv, page_tokens):
    tokens = prompt(77, 4)                      # 4 pages of 16 + 13, or 2 of 32 + 13
    serve(make_engine(model, srv, page_tokens=page_tokens), {"a": tokens})
    engine = make_engine(model, srv, page_tokens=page_tokens)
    out = serve(engine, {"b": tokens}, 6)["b"]
    assert out.num_external_tokens == 64
    assert engine.num_computed_tokens == 77 - 64 + 5
    assert_same(out, recompute(model, tokens, 6))


def test_two_requests_sharing_a_prefix(model, srv):
    system = prompt(64, 5)
    serve(make_engine(model, srv), {"warm": np.concatenate([system, prompt(9, 6)])})
    r1, r2 = (np.concatenate([system, prompt(n, s)]) for n, s in ((30, 7), (41, 8)))
    # Both answers awaited in their step (a cold connection's first lookup takes longer
    # than the default wait on a loaded machine, and this counts steps).
    engine = make_engine(model, srv, lookup_wait_ms=5000)
    outs = serve(engine, {"r1": r1, "r2": r2})
    # Both prefills in the first step, 3 more tokens, and one step that reports the
    # finished requests' saves landed (saves are async: the blocks are held till then).
    assert engine.num_steps == 5
    assert engine.num_computed_tokens == 30 + 41 + 2 * 3
    for req_id, tokens in (("r1", r1), ("r2", r2)):
        assert outs[req_id].num_external_tokens == 64
        assert_same(outs[req_id], recompute(model, tokens))


def test_chunked_prefill_saves_and_loads_across_chunks(model, srv):
    tokens = prompt(150, 9)
    first = serve(make_engine(model, srv, budget=40), {"a": tokens})["a"]
    ref = recompute(model, tokens)
    assert_same(first, ref)
    engine = make_engine(model, srv, budget=40)
    out = serve(engine, {"b": tokens})["b"]
    assert out.num_external_tokens == 144
    assert engine.num_computed_tokens == 6 + 3
    assert_same(out, ref)


def test_preemption_and_resume_from_the_store(model, srv):
    """Seven blocks for two requests that each grow to five: the second is preempted,
    its blocks freed, and on resume its saved pages (prompt and output) are loaded."""
    a, b = prompt(40, 10), prompt(40, 11)
    engine = make_engine(model, srv, num_blocks=7)
    outs = serve(engine, {"a": a, "b": b}, max_tokens=30)
    assert outs["a"].num_preemptions == 0
    assert outs["b"].num_preemptions == 1
    assert outs["b"].num_external_tokens >= 32   # the resume hit the store
    assert_same(outs["a"], recompute(model, a, 30))
    assert_same(outs["b"], recompute(model, b, 30))


def test_preemption_without_a_store_recomputes(model):
    b = prompt(40, 11)
    outs = serve(make_engine(model, num_blocks=7), {"a": prompt(40, 10), "b": b}, 30)
    assert outs["b"].num_preemptions == 1 and outs["b"].num_external_tokens == 0
    assert_same(outs["b"], recompute(model, b, 30))


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_after_a_restart_pages_come_from_disk(model, tmp_path, mode):
    """SIGTERM flushes DRAM to the disk tier; the restarted server finds the pages in
    its slot files and the engine loads them with the logits of a recompute."""
    tokens = prompt(100, 14)
    flags = dict(dram="32MiB", disk="64MiB", disk_dir=str(tmp_path / "disk"))
    first = ServerProcess(**flags).start()
    try:
        serve(make_engine(model, first), {"a": tokens})
    finally:
        first.stop()
    with ServerProcess(port=first.port, **flags) as again:
        engine = make_engine(model, again, load_mode=mode)
        out = serve(engine, {"b": tokens})["b"]
        assert out.num_external_tokens == 96
        assert_same(out, recompute(model, tokens))


def test_restarted_empty_server_means_a_clean_recompute(model, srv):
    tokens = prompt(100, 12)
    serve(make_engine(model, srv), {"a": tokens})
    engine = make_engine(model, srv)           # connected before the restart
    srv.stop()
    again = ServerProcess(port=srv.port, dram="64MiB").start()
    try:
        out = serve(engine, {"b": tokens})["b"]
        assert out.num_external_tokens == 0
        assert_same(out, recompute(model, tokens))
        # ... and stored them again, for the next engine.
        assert serve(make_engine(model, again), {"c": tokens})["c"].num_external_tokens == 96
    finally:
        again.stop()


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_failed_load_is_recomputed(model, srv, mode):
    """The server restarts between the lookup and the load: the engine recomputes."""
    tokens = prompt(100, 13)
    serve(make_engine(model, srv), {"a": tokens})
    servers = []

    class RestartBeforeLoad(StoreConnector):
        def start_load_kv(self, meta):
            if meta.loads and not servers:
                srv.stop()
                servers.append(ServerProcess(port=srv.port, dram="64MiB").start())
            super().start_load_kv(meta)

    try:
        engine = make_engine(model, srv, connector_cls=RestartBeforeLoad, load_mode=mode)
        out = serve(engine, {"b": tokens})["b"]
        assert servers, "the load never started"
        assert_same(out, recompute(model, tokens))
    finally:
        for s in servers:
            s.stop()


# -- the scheduler alone, with a connector stand-in --------------------------------------
class FakeConnector:
    """Answers lookups from a table: None = "ask again", (n, True) = an async hit."""

    def __init__(self, answers):
        self.answers = answers
        self.calls = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.calls.append(("lookup", request.req_id))
        return self.answers.get(request.req_id, (0, False))

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.calls.append(("alloc", request.req_id, num_external_tokens))

    def build_connector_meta(self, output):
        self.calls.append(("build", tuple(s.request.req_id for s in output.scheduled)))

    def update_connector_output(self, finished_recving, invalid_block_ids):
        pass

    def request_finished(self, request):
        self.calls.append(("finished", request.req_id))


def test_waiting_for_remote_kvs_is_skipped_and_promoted():
    conn = FakeConnector({"slow": (32, True), "later": (None, False)})
    sched = Scheduler(SchedulerConfig(num_blocks=32, block_size=BLOCK), conn)
    for req_id in ("slow", "later", "plain"):
        sched.add_request(Request(req_id, prompt(40, 0), 2))
    out = sched.schedule()
    # The async hit waits, the unanswered lookup is asked again, neither blocks "plain".
    assert [s.request.req_id for s in out.scheduled] == ["plain"]
    assert sched.requests["slow"].status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert [r.req_id for r in sched.waiting] == ["slow", "later"]
    assert conn.calls[:4] == [("lookup", "slow"), ("alloc", "slow", 32), ("lookup", "later"),
                              ("lookup", "plain")]
    sched.update_from_output(out, StepResult({"plain": 1}))
    out = sched.schedule()                       # not loaded yet: still skipped
    assert "slow" not in [s.request.req_id for s in out.scheduled]
    sched.update_from_output(out, StepResult({"plain": 2}, finished_recving=frozenset({"slow"})))
    conn.answers["later"] = (0, False)
    out = sched.schedule()                       # promoted: runs from its loaded prefix
    got = {s.request.req_id: (s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled}
    assert got == {"slow": (32, 8), "later": (0, 40)}
    assert ("alloc", "slow", 0) in conn.calls    # the second call, as vLLM makes it


def test_a_sync_hit_counts_as_computed():
    sched = Scheduler(SchedulerConfig(num_blocks=32, block_size=BLOCK),
                      FakeConnector({"hit": (32, False)}))
    sched.add_request(Request("hit", prompt(40, 0), 2))
    out = sched.schedule()
    (s,) = out.scheduled
    assert (s.num_computed_tokens, s.num_new_tokens, s.num_external_tokens) == (32, 8, 32)
    assert out.has_sync_kv_loads and s.samples
    assert sched.requests["hit"].num_computed_tokens == 40
    sched.update_from_output(out, StepResult({"hit": 7}))
    (s,) = sched.schedule().scheduled              # a decode, not a recompute
    assert (s.num_computed_tokens, s.num_new_tokens) == (40, 1)


def test_token_budget_chunks_prefills_and_preemption_requeues_first():
    sched = Scheduler(SchedulerConfig(num_blocks=6, block_size=BLOCK, max_num_batched_tokens=50))
    sched.add_request(Request("a", prompt(40, 0), 20))
    sched.add_request(Request("b", prompt(40, 1), 20))
    out = sched.schedule()
    assert [(s.request.req_id, s.num_new_tokens) for s in out.scheduled] == [("a", 40),
                                                                             ("b", 10)]
    sched.update_from_output(out, StepResult({"a": 1}))
    out = sched.schedule()
    assert [(s.request.req_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1),
                                                                             ("b", 30)]
    for _ in range(8):                            # decode until a needs its 4th block
        sched.update_from_output(out, StepResult({s.request.req_id: 3 for s in out.scheduled}))
        out = sched.schedule()
        if out.preempted_req_ids:
            break
    assert out.preempted_req_ids == ("b",)
    assert sched.waiting[0].req_id == "b" and sched.waiting[0].num_computed_tokens == 0
    assert sched.requests["b"].status is RequestStatus.PREEMPTED


def test_a_finished_requests_blocks_are_held_until_its_save_is_committed(model, srv):
    from .test_connector_step import Gate
    engine = make_engine(model, srv)
    gate = Gate(engine.connector.worker_half.transfer)     # the save copies "run" until opened
    tokens = prompt(64, 21)
    engine.add_request("a", tokens, 1)
    sched = engine.scheduler
    while "a" in sched.requests:
        engine.step()
    layout = engine.connector.layout
    with KVStoreClient(srv.address) as client:
        ns = client.register_layout(layout)
        keys = page_keys(tokens, BLOCK, layout.chain_seed)
        for _ in range(3):              # finished: its blocks stay the engine's, not free
            assert engine.has_unfinished() and sched.blocks.num_free == 64 - 4
            assert client.lookup(ns, keys) == 0
            engine.step()
        gate.open = True
        engine.step()                   # landed: committed, then reported and freed
        assert client.lookup(ns, keys) == 4
        assert not engine.has_unfinished() and sched.blocks.num_free == 64
    engine.connector.close()
