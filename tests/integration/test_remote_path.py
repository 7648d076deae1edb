"""The connector's path to a store on another host (no shared pool) against a real server:
saves send only pages the store lacks, a load that is slow but coming is waited for, and
the testing hook that fails chosen loads."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvstore_client import KVStoreClient, KVStoreError  # noqa: E402
from kvstore_connector.config import ConnectorConfig  # noqa: E402
from tests.waiting import wait_for  # noqa: E402

from .test_connector import (  # noqa: E402
    BLOCK,
    Engine,
    expected_pages,
    keys_of,
    prompt,
    stored_pages,
)
from .test_remote_load import SHAPES, SLABS, Rig, remote_threads  # noqa: E402


@pytest.fixture
def srv(fresh_server):
    return fresh_server(dram="64MiB", lease_ttl="5s")


def _count_puts(worker) -> list[int]:
    """Pages the worker's client sends in Puts (one entry per Put)."""
    sent: list[int] = []
    real = worker.client.put

    def put(ns, keys, pages):
        sent.append(len(keys))
        return real(ns, keys, pages)

    worker.client.put = put
    return sent


def _dram_pages(address: str) -> int:
    with KVStoreClient(address) as c:
        return sum(t.pages for t in c.stats().tiers if t.name == "dram")


def _run(eng: Engine, prompts: dict[str, tuple[np.ndarray, str | None]]) -> None:
    """One step computing each prompt; (tokens, src): src names an earlier request whose
    blocks vLLM's own prefix cache holds for the prompt's first 4 pages (the store is not
    asked for them, and the step computes the rest)."""
    writes = []
    for rid, (tokens, src) in prompts.items():
        local = 4 * BLOCK if src else 0
        assert eng.sched.hit(rid, tokens, local) == 0, rid
        blocks = (eng.blocks_of[src][:4] if src else []) + eng.alloc(len(tokens) - local)
        eng.blocks_of[rid] = blocks
        eng.sched.allocated(rid, blocks, 0)
        eng.sched.scheduled(rid, tokens, local, len(tokens) - local, block_ids=blocks)
        writes.append((blocks, tokens, local, len(tokens)))
    eng.step(writes)


def test_a_cold_round_sharing_prefixes_sends_only_pages_the_store_lacks(srv):
    """Two prompts sharing a 4-page prefix in one step, a third sharing it a step later
    (vLLM's own cache holding the prefix), and a prompt of that round again (its prefix
    in vLLM's cache, the rest a hit in the store): each page
    crosses the network once, pages_saved counts what the store stored, and the stored
    bytes are the engine's."""
    eng = Engine(srv.address, shared_memory=False)
    eng.blocks_of = {}
    sent = _count_puts(eng.worker)
    shared = prompt(4 * BLOCK, 1)
    a = np.concatenate([shared, prompt(2 * BLOCK + 5, 2)])
    b = np.concatenate([shared, prompt(3 * BLOCK, 3)])
    c = np.concatenate([shared, prompt(BLOCK, 4)])
    _run(eng, {"a": (a, None), "b": (b, None)})       # cold, in one step
    _run(eng, {"c": (c, "a")})                         # a's saves may be on their way
    hit, *_ = eng.run_prompt("a2", a, 4 * BLOCK, eng.blocks_of["a"][:4])   # a again
    assert hit == 2 * BLOCK
    for _ in range(3):                                 # let every save finish
        eng.step([])
    stats = eng.worker.take_stats()
    stored = _dram_pages(srv.address)
    want = 4 + 2 + 3 + 1                               # distinct full pages
    print(f"pages sent {sum(sent)} in {len(sent)} puts, stored {stored}, "
          f"pages_saved {stats.pages_saved}")
    assert stored == want
    assert sum(sent) == stored, f"sent {sum(sent)} pages for {stored} stored"
    assert stats.pages_saved == stored
    assert stats.bytes_saved == stored * eng.worker.ns.page_bytes
    for rid, tokens, pages in (("a", a, 6), ("b", b, 7), ("c", c, 5)):
        keys = keys_of(tokens, pages, eng.layout)
        got = stored_pages(srv.address, eng.layout, keys)
        assert np.array_equal(got, np.stack(expected_pages(tokens, pages))), rid
    eng.close()


def _slowed(worker, delay: float) -> None:
    """The worker's remote Gets deliver each layer `delay` s late (a slow link, or a
    receiving thread that waits for a busy host's CPU): the thread that received it
    sleeps before handing it over (the worker's copy is enqueued by `landed`)."""
    real = worker.client.get_layers

    def get_layers(ns, keys, dest=None, stop=None, landed=None):
        def late(layer, slab):
            time.sleep(delay)
            if landed is not None:
                landed(layer, slab)
        return real(ns, keys, dest, stop, late)

    worker.client.get_layers = get_layers


def test_a_load_slow_but_coming_is_waited_for_past_the_old_bound(srv):
    """Layers 0.3 s apart with a 0.2 s timeout: the whole load takes ~1.2 s, far past the
    old fixed deadline (timeout + bytes at 100 MB/s), and nothing fails, layer-wise or
    async, because each layer that lands moves the deadline on."""
    rig = Rig(srv.address, SHAPES["kv2-fp16-page32"], pages=12, seed=21)
    remote = rig.worker(srv.address, shared_memory=False, timeout=0.2)
    _slowed(remote, 0.3)
    start = time.monotonic()
    errors = rig.step(remote, rig.specs([5], is_async={1}))
    took = time.monotonic() - start
    assert errors == set(), "a slow load failed"
    assert remote.take_stats().load_failures == 0
    assert took > 1.0, took                           # it was slow
    rig.expected(remote)
    assert remote_threads() == []
    remote.close()


def test_loads_queued_behind_each_other_for_slabs_are_waited_for(srv):
    """A ring of four one-page slabs and three async loads of four pages, each layer 0.3 s
    late with a 0.2 s timeout: a load's chunks wait for slabs the others hold, longer than
    a budget with nothing of their own landing, while the worker's receives keep coming.
    None fails."""
    rig = Rig(srv.address, SHAPES["kv2-fp16-page32"], pages=12, seed=24)
    lb = rig.layout.page_bytes // len(rig.names)
    remote = rig.worker(srv.address, shared_memory=False, timeout=0.2,
                        remote_staging_bytes=SLABS * lb)
    _slowed(remote, 0.3)
    errors = rig.step(remote, rig.specs([4, 8], is_async={0, 1, 2}))
    assert errors == set() and remote.take_failed_recving() == set()
    assert remote.take_stats().load_failures == 0
    rig.expected(remote)
    remote.close()


def test_a_load_that_stops_coming_still_fails_within_its_budget(srv):
    """After its first layer a load receives nothing more: it is stopped one budget after
    that layer (SLACK x the timeout here) and the engine recomputes."""
    rig = Rig(srv.address, SHAPES["kv2-fp16-page32"], pages=6, seed=22)
    remote = rig.worker(srv.address, shared_memory=False, timeout=0.2)
    real = remote.client.get_layers
    release = threading.Event()
    held: list[float] = []

    def stalls(ns, keys, dest=None, stop=None, landed=None):
        def held_at_one(layer, slab):
            if layer == 1:                    # held until the load is stopped
                held.append(time.monotonic())
                while not (stop is not None and stop.is_set()) and not release.is_set():
                    time.sleep(0.01)
            if landed is not None:
                landed(layer, slab)
        return real(ns, keys, dest, stop, held_at_one)

    remote.client.get_layers = stalls
    start = time.monotonic()
    try:
        errors = rig.step(remote, rig.specs([]))
    finally:
        release.set()
    took = time.monotonic() - start
    assert errors == {int(b) for b in rig.blocks.reshape(-1)}
    assert 0.8 < took < 10, took          # SLACK x 0.2 s after layer 0, not sooner
    assert held, "the stall was never reached"
    remote.close()
    assert remote_threads() == []


def test_the_fail_loads_hook_fails_the_first_load_of_the_requests_it_names(srv):
    """For tests: the requests named fail their first load (layer-wise and async alike),
    reported as a store fault's; other loads in the step land; a later load of the same
    request is not failed again, so an engine that recomputes is not sent round in a
    loop."""
    rig = Rig(srv.address, SHAPES["kv2-fp32-page16"], pages=12, seed=23)
    for shared in (True, False):
        w = rig.worker(srv.address, shared_memory=shared, fail_loads=r"^r[12]$")
        loads = rig.specs([4, 8], is_async={2})          # r0, r1 layer-wise, r2 async
        errors = rig.step(w, loads)
        assert errors == {int(b) for b in rig.blocks[4:].reshape(-1)}
        assert w.take_failed_recving() == {"r2"}
        assert w.take_stats().load_failures == 2
        assert rig.step(w, loads) == set()                # the second loads land
        rig.expected(w)
        w.close()
    with pytest.raises(ValueError, match="fail_loads"):
        ConnectorConfig.from_mapping({"fail_loads": "(unclosed"})


def _gated_puts(worker) -> tuple[threading.Event, threading.Event, threading.Event]:
    """The worker's Puts wait for `gate` once sent (a slow link): (gate, entered, returned)."""
    gate, entered, returned = threading.Event(), threading.Event(), threading.Event()
    real = worker.client.put

    def put(ns, keys, pages):
        entered.set()
        gate.wait(30)
        try:
            return real(ns, keys, pages)
        finally:
            returned.set()

    worker.client.put = put
    return gate, entered, returned


def test_a_put_goes_out_beside_the_next_forward_and_sent_waits_for_it(srv):
    """The step boundary that finds a save's copies landed starts its Put on a thread and
    returns; the engine keeps the request's blocks until the Put has answered; the end of
    the next step's forward waits for it, and then the pages are stored and counted."""
    eng = Engine(srv.address, shared_memory=False)
    eng.blocks_of = {}
    gate, entered, returned = _gated_puts(eng.worker)
    a = prompt(3 * BLOCK, 7)
    _run(eng, {"a": (a, None)})
    try:
        # A boundary (finished) starts the Put once the copies have landed, and returns
        # while it is out.
        assert wait_for(lambda: eng.worker.finished() is not None and entered.is_set(),
                        "the Put to be sent")
        assert not returned.is_set()
        assert eng.worker.sent(["a"]) == set(), "blocks freed under a Put still out"
        assert _dram_pages(srv.address) == 0
    finally:
        gate.set()
    eng.step([])                  # its forward's end waits for the Put
    assert returned.is_set()
    assert eng.worker.sent([]) == {"a"}
    assert _dram_pages(srv.address) == 3
    assert eng.worker.take_stats().pages_saved == 3
    got = stored_pages(srv.address, eng.layout, keys_of(a, 3, eng.layout))
    assert np.array_equal(got, np.stack(expected_pages(a, 3)))
    eng.close()


def test_a_put_that_finds_the_store_gone_opens_the_breaker_on_the_engine_thread(srv):
    """A Put that fails on its thread is reported at the next step's end: the breaker
    opens (the store is not answering), nothing is counted as saved."""
    eng = Engine(srv.address, shared_memory=False)
    eng.blocks_of = {}

    def put(ns, keys, pages):
        raise KVStoreError(grpc.StatusCode.UNAVAILABLE, "the store went away")

    eng.worker.client.put = put
    _run(eng, {"a": (prompt(2 * BLOCK, 8), None)})
    eng.step([])
    eng.step([])
    assert eng.worker.breaker.open
    assert eng.worker.take_stats().pages_saved == 0
    eng.close()
