"""The worker half's fixed costs per step against a real server: no Acquire for a step's
loads the lookups' pins serve (else one for all of them), one Reserve for all of its
saves, and saves that the producing step does not wait for (committed at a later step
boundary once their copies have landed)."""

import dataclasses
import time
import urllib.request

import pytest

torch = pytest.importorskip("torch")

from kvstore_client import KVStoreClient  # noqa: E402
from kvstore_connector.scheduler.hashing import page_keys  # noqa: E402
from kvstore_connector.transfer import TransferError  # noqa: E402
from kvstore_testing.serverproc import free_port  # noqa: E402

from .test_connector import BLOCK, NAMES, Engine, prompt  # noqa: E402

N = 8                       # requests in the step


@pytest.fixture
def srv(fresh_server):
    port = free_port()
    server = fresh_server(dram="64MiB", lease_ttl="5s", metrics_port=port)
    server.metrics_port = port
    return server


def rpc_calls(server, word: str) -> float:
    """RPCs the server has answered whose method name contains `word` (gRPC and the
    fast path: Acquire and FastAcquire)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics",
                                  timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("kvstore_rpc_total{") and f'method="{word}' in line.replace(
                'method="Fast', 'method="'):
            total += float(line.rsplit(" ", 1)[1])
    return total


def settled(server, words, before, timeout=5.0) -> dict:
    """The calls counted since `before`, once the counters stop moving (a call is counted
    after its answer has been sent)."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        now = {w: rpc_calls(server, w) - before[w] for w in words}
        if now == last or time.monotonic() > deadline:
            return now
        last = now
        time.sleep(0.2)


def stored(server, engine, tokens, pages) -> int:
    keys = page_keys(tokens[:pages * BLOCK], BLOCK, engine.layout.chain_seed)
    with KVStoreClient(server.address) as client:
        return client.lookup(client.register_layout(engine.layout), keys)


def plan_step(engine, prompts):
    """Every prompt looked up, allocated and scheduled whole in one step."""
    blocks = {}
    for req_id, tokens in prompts.items():
        hit = engine.sched.hit(req_id, tokens, 0)
        blocks[req_id] = engine.alloc(len(tokens))
        engine.sched.allocated(req_id, blocks[req_id], hit)
        engine.sched.scheduled(req_id, tokens, hit, len(tokens) - hit,
                               block_ids=blocks[req_id])
    return blocks


def test_a_step_of_8_loads_and_8_saves_makes_one_reserve_and_no_acquire(srv):
    # 96 tokens: 6 pages; a hit loads 5 (never the page of the last token) and saves the
    # 6th, so the second engine's step has 8 loads and 8 saves.
    prompts = {f"r{i}": prompt(96, 100 + i) for i in range(N)}
    a = Engine(srv.address)
    for req_id, tokens in prompts.items():
        a.run_prompt(req_id, tokens)
    for tokens in prompts.values():
        assert stored(srv, a, tokens, 6) == 6
    b = Engine(srv.address)
    with KVStoreClient(srv.address) as client:
        client.delete(client.register_layout(b.layout),
                      [k for t in prompts.values()
                       for k in page_keys(t[:96], BLOCK, b.layout.chain_seed)[5:]])
    blocks = plan_step(b, prompts)
    meta = b.sched.build()
    assert len(meta.loads) == N and len(meta.saves) == N
    words = ("Acquire", "Reserve", "Commit")
    before = {w: rpc_calls(srv, w) for w in words}
    b.run(meta, [(blocks[r], t, 80, 96) for r, t in prompts.items()])
    calls = settled(srv, words, before)
    # The lookups' pins serve every load; the step's saves share one Reserve.
    assert calls["Acquire"] == 0 and calls["Reserve"] <= 1, calls
    for req_id, tokens in prompts.items():        # every load landed in its own blocks
        b.expect_kv(blocks[req_id], tokens, 96)
    # The saves name the step's loads: committed (one Commit) once the next plan
    # reports them good.
    b.run(b.sched.build(), [])
    b.run(b.sched.build(), [])
    for tokens in prompts.values():
        assert stored(srv, b, tokens, 6) == 6
    assert settled(srv, words, before)["Commit"] == 1
    a.close()
    b.close()


class Gate:
    """The step's save copies as a slow device would run them: not landed until the test
    opens the gate (or failed, when it sets `error`). Wraps the transfer's real handle."""

    def __init__(self, transfer) -> None:
        self.open = False
        self.error = None
        self.handles = []
        real = transfer.finish_save

        def finish_save(wait=True):
            handle = real(wait)
            self.handles.append(handle)
            return self
        transfer.finish_save = finish_save

    def done(self) -> bool:
        if self.error:
            raise TransferError(self.error)
        return self.open and all(h.done() for h in self.handles)

    def synchronize(self) -> None:
        for h in self.handles:
            h.synchronize()


def test_saves_are_committed_at_a_later_step_once_their_copies_land(srv):
    e = Engine(srv.address)
    gate = Gate(e.worker.transfer)
    tokens = prompt(64, 7)
    hit, _blocks, meta, _ = e.run_prompt("a", tokens)
    assert hit == 0 and len(meta.saves) == 1
    # The producing step returned with its copies in flight: nothing committed yet, and
    # the finished request's blocks are not free.
    assert stored(srv, e, tokens, 4) == 0
    assert e.worker.sent({"a"}) == set()
    e.run(e.sched.build(), [])                    # later steps poll, do not wait
    assert stored(srv, e, tokens, 4) == 0 and e.worker.sent() == set()
    gate.open = True
    e.run(e.sched.build(), [])
    assert stored(srv, e, tokens, 4) == 4
    assert e.worker.sent() == {"a"}               # reported once, and only once
    assert e.worker.sent() == set()
    e.close()


def test_a_save_whose_copy_fails_is_never_committed(srv):
    e = Engine(srv.address)
    gate = Gate(e.worker.transfer)
    tokens = prompt(64, 8)
    e.run_prompt("a", tokens)
    gate.error = "an injected device error"
    e.run(e.sched.build(), [])
    assert stored(srv, e, tokens, 4) == 0
    assert e.worker.sent({"a"}) == {"a"}          # the copy is over: the blocks may go
    with KVStoreClient(srv.address) as client:    # the reservation was given back
        assert sum(t.used_bytes for t in client.stats().tiers if t.name == "dram") == 0
    gate.error, gate.open = None, True
    e.close()
    assert stored(srv, e, tokens, 4) == 0


def test_a_failed_load_drops_only_its_own_part_of_the_steps_reservation(srv):
    a = Engine(srv.address)
    shared = prompt(64, 9)
    a.run_prompt("seed", shared[:49])                  # pages 0-2 stored
    b = Engine(srv.address)
    ok = prompt(64, 10)
    hit = b.sched.hit("lost", shared, 0)
    assert hit == 48
    with KVStoreClient(srv.address) as client:    # the pages vanish before the Acquire
        client.delete(client.register_layout(b.layout),
                      page_keys(shared, BLOCK, b.layout.chain_seed))
    blocks = {"lost": b.alloc(64), "ok": b.alloc(64)}
    b.sched.allocated("lost", blocks["lost"], hit)
    b.sched.scheduled("lost", shared, hit, 16, block_ids=blocks["lost"])
    b.sched.allocated("ok", blocks["ok"], 0)
    b.sched.scheduled("ok", ok, 0, 64, block_ids=blocks["ok"])
    meta = b.sched.build()
    assert len(meta.loads) == 1 and len(meta.saves) == 2
    # The lookup's lease still pins the deleted pages, and its pins would read them: the
    # load fails where it acquires them, as a worker on a pool it does not map would.
    meta = dataclasses.replace(meta, loads=tuple(dataclasses.replace(spec, pins=None)
                                                 for spec in meta.loads))
    _, _, errors = b.run(meta, [(blocks["lost"], shared, 48, 64), (blocks["ok"], ok, 0, 64)])
    assert errors == set(blocks["lost"][:3])
    assert stored(srv, b, ok, 4) == 4             # the other request's pages are stored
    assert stored(srv, b, shared, 4) == 0         # none computed over the failed load
    for e in (a, b):
        e.close()


def test_the_next_step_fences_on_saves_in_flight(srv):
    e = Engine(srv.address)
    gate = Gate(e.worker.transfer)
    fences = []
    e.worker.transfer.fence_saves = lambda: fences.append(1)
    e.run_prompt("a", prompt(64, 11))
    e.run(e.sched.build(), [])
    assert fences == [1]                          # in flight: the step waits on the device
    gate.open = True
    e.run(e.sched.build(), [])
    e.run(e.sched.build(), [])
    assert fences == [1, 1]                       # landed at the second bind's poll: no more
    e.close()


def test_kv_written_after_the_save_step_does_not_reach_the_store(srv):
    # CPU copies land before wait_for_save returns: what a later step writes into the
    # blocks (a reuse) never changes what was stored.
    e = Engine(srv.address)
    tokens = prompt(64, 12)
    _, blocks, _, _ = e.run_prompt("a", tokens)
    for name in NAMES:
        e.caches[name][:, blocks] = -7.0
    e.run(e.sched.build(), [])
    f = Engine(srv.address)
    hit, fblocks, _, _ = f.run_prompt("b", tokens)
    assert hit == 48
    f.expect_kv(fblocks, tokens, 64)
    for x in (e, f):
        x.close()
