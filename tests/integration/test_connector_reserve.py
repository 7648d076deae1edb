"""The step's Reserve made beside the forward, against a real server: the engine's hooks do
not wait for its answer, the layers they owed are copied once it is in, and a Reserve that
fails or outlives its step stores nothing and leaves nothing behind."""

import dataclasses
import os
import signal
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvstore_client import KVStoreClient, KVStoreError  # noqa: E402
from kvstore_connector.config import LoadMode  # noqa: E402
from kvstore_connector.scheduler.hashing import page_keys  # noqa: E402
from kvstore_connector.worker import WorkerHalf  # noqa: E402
from kvstore_testing.serverproc import sigstop  # noqa: E402
from tests.waiting import wait_for  # noqa: E402

from .test_connector import (  # noqa: E402
    BLOCK,
    NAMES,
    Engine,
    expected_pages,
    in_store,
    kv_value,
    prompt,
    stored_pages,
    wait_leases_gone,
)

HANG = 0.4          # seconds the store is stopped around a step's bind and hooks


@pytest.fixture
def srv(fresh_server):
    # Reservations left behind would outlive every check here (never expiring in a test).
    return fresh_server(dram="64MiB", lease_ttl="60s")



def answers(address) -> bool:
    """A fresh client's call is answered."""
    try:
        with KVStoreClient(address) as client:
            client.stats()
        return True
    except KVStoreError:
        return False


def pages_match(address, e, keys, tokens) -> list[bool]:
    """For each of the prompt's first four pages: the store holds it, byte for byte."""
    same = stored_pages(address, e.layout, keys) == expected_pages(tokens, 4)
    return same.all(axis=1).tolist()

def planned(engine, req_id, tokens):
    """A step computing the whole prompt (no hit): its meta and the request's blocks."""
    assert engine.sched.hit(req_id, tokens, 0) == 0
    blocks = engine.alloc(len(tokens))
    engine.sched.allocated(req_id, blocks, 0)
    engine.sched.scheduled(req_id, tokens, 0, len(tokens), block_ids=blocks)
    meta = engine.sched.build()
    assert len(meta.saves) == 1
    return meta, blocks


def compute(engine, layer, blocks, tokens):
    """The forward's write of one layer's KV, then its save hook."""
    pos = torch.arange(len(tokens))
    engine.caches[NAMES[layer]][:, torch.as_tensor(blocks)[pos // BLOCK], pos % BLOCK] = \
        kv_value(layer, pos, torch.as_tensor(tokens))
    engine.worker.save_layer(NAMES[layer])


def keys_of(engine, tokens, pages):
    """The keys of the first `pages` pages of tokens, as connector.scheduler.hashing
    derives them."""
    lay = engine.layout
    return page_keys(np.asarray(tokens[:pages * lay.page_tokens]), lay.page_tokens,
                     lay.chain_seed)


def leases(address):
    with KVStoreClient(address) as client:
        return client.stats().leases


def warm(engine):
    """One step stored: the pool is mapped, the layout registered, connections open."""
    engine.run_prompt("warm", prompt(32, 99))


def test_the_hooks_do_not_wait_for_the_reserve_and_owed_layers_are_stored_exact(srv):
    e = Engine(srv.address, timeout=5.0)
    warm(e)
    tokens = prompt(64, 1)
    meta, blocks = planned(e, "r", tokens)
    sigstop(srv.proc.pid)
    resume = threading.Timer(HANG, os.kill, (srv.proc.pid, signal.SIGCONT))
    resume.start()
    try:
        start = time.monotonic()
        e.worker.bind(meta)
        e.worker.start_load(meta)
        for layer in range(len(NAMES)):
            compute(e, layer, blocks, tokens)
        hooks = time.monotonic() - start
        e.worker.wait_for_save()               # waits for the answer, copies every layer
        step = time.monotonic() - start
    finally:
        resume.join()
        os.kill(srv.proc.pid, signal.SIGCONT)
    assert hooks < HANG / 2, hooks             # bind and every hook ran while it was stopped
    assert step >= HANG * 0.9, step            # the step's end waited for the answer
    e.worker.finished()
    assert pages_match(srv.address, e, keys_of(e, tokens, 4), tokens) == [True] * 4
    assert e.worker.sent({"r"}) == {"r"}
    with KVStoreClient(srv.address) as client:
        assert wait_leases_gone(client)
    e.close()


def test_a_hook_that_finds_the_answer_in_copies_the_layers_owed_first(srv):
    e = Engine(srv.address, timeout=5.0)
    warm(e)
    tokens = prompt(64, 2)
    meta, blocks = planned(e, "r", tokens)
    sigstop(srv.proc.pid)
    try:
        e.worker.bind(meta)
        compute(e, 0, blocks, tokens)           # owed: the store has not answered
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)
    wait_for(e.worker.step_reserve.ready, "the step's Reserve answered", timeout=5,
             interval=0.01)
    # Layer 0's blocks are reused after its hook: an owed copy made from the blocks as
    # they are at the next hook must still read layer 0's own KV, which a layer's KV is
    # (the engine never rewrites a layer within a step), so only later layers change here.
    compute(e, 1, blocks, tokens)               # takes the answer: copies 0, then 1
    assert not e.worker.step_reserve.pending
    compute(e, 2, blocks, tokens)
    e.worker.wait_for_save()
    e.worker.finished()
    assert pages_match(srv.address, e, keys_of(e, tokens, 4), tokens) == [True] * 4
    e.close()


@pytest.mark.parametrize("how", ["sigstop", "sigkill"])
def test_a_reserve_that_fails_saves_nothing_raises_nothing_and_costs_one_timeout(srv, how):
    timeout = 0.3
    e = Engine(srv.address, timeout=timeout, probe_interval=0.2)
    warm(e)
    tokens = prompt(64, 3)
    meta, blocks = planned(e, "r", tokens)
    keys = keys_of(e, tokens, 4)
    if how == "sigstop":
        sigstop(srv.proc.pid)
    else:
        srv.stop(signal.SIGKILL)
    try:
        start = time.monotonic()
        e.worker.bind(meta)
        e.worker.start_load(meta)
        for layer in range(len(NAMES)):
            compute(e, layer, blocks, tokens)
        e.worker.wait_for_save()               # the Reserve's failure is met here
        e.worker.finished()
        step = time.monotonic() - start
        assert e.worker.breaker.open           # as an inline Reserve's failure did
        # No call until a probe answers: the next step's bind and end wait for nothing.
        start = time.monotonic()
        e.run(e.sched.build(), [])
        assert time.monotonic() - start < 0.1
    finally:
        if how == "sigstop":
            os.kill(srv.proc.pid, signal.SIGCONT)
        else:
            srv.start()
            # A new client shares the killed server's connection and its reconnect
            # backoff (up to 1 s: kvstore_protocol.grpc_frames), longer than its own retries.
            wait_for(lambda: answers(srv.address), "the restarted store to answer",
                     timeout=5)
    # One timeout; a killed store also the client's retries on UNAVAILABLE (backoff
    # 0.1 + 0.2 + 0.4 s), as when the Reserve was made inline.
    assert step < timeout + (1.5 if how == "sigkill" else 0.5), step
    assert in_store(srv.address, e.layout, keys) == [False] * 4
    assert e.worker.sent({"r"}) == {"r"}       # nothing copies its blocks: they may go
    # The stopped store took the Reserve when it resumed, from a connection the client
    # had closed: the server ends that reservation with it, nothing waits for its ttl.
    with KVStoreClient(srv.address) as client:
        assert wait_leases_gone(client)
    # Once a probe finds the store answering, a step's pages are stored again.
    wait_for(lambda: not e.worker.breaker.open, "a probe to find the store answering",
             timeout=5, interval=0.05)
    again = prompt(64, 4)
    e.run_prompt("again", again)
    assert pages_match(srv.address, e, keys_of(e, again, 4), again) == [True] * 4
    e.close()


@pytest.mark.parametrize("end", ["next-bind", "close"])
def test_a_reserve_whose_step_never_reached_wait_for_save_is_given_back(srv, end):
    e = Engine(srv.address, timeout=5.0)
    # Reserves over gRPC: a fast-path reservation would also end with its connection at
    # close, and this checks that the worker itself gives it back.
    e.worker.close()
    e.worker = WorkerHalf(e.config, e.layout, e.caches,
                          client=KVStoreClient(srv.address, timeout=5.0, data_plane=False))
    warm(e)
    tokens = prompt(64, 5)
    meta, _ = planned(e, "r", tokens)
    keys = keys_of(e, tokens, 4)
    e.worker.bind(meta)                        # the step fails before any save hook
    wait_for(e.worker.step_reserve.ready, "the step's Reserve answered", timeout=5,
             interval=0.01)
    assert leases(srv.address) == 1            # the reservation, answered, not taken
    if end == "next-bind":
        e.worker.bind(e.sched.build())
    else:
        e.close()
    assert leases(srv.address) == 0            # aborted at once, not left to its ttl
    assert in_store(srv.address, e.layout, keys) == [False] * 4
    if end == "next-bind":
        e.close()


def lease_calls(client) -> list[str]:
    """The names of the client's Acquire and Reserve calls, in order, as they are made
    (the calls themselves go to the server as ever)."""
    calls: list[str] = []
    for name in ("acquire", "reserve"):
        def spy(*args, _name=name, _call=getattr(client, name), **kwargs):  # noqa: B008 - bound now
            calls.append(_name)
            return _call(*args, **kwargs)
        setattr(client, name, spy)
    return calls


def load_and_save(engine, cached, fresh):
    """A step that loads the last page of `cached` (its first three are stored) and
    computes all of `fresh`, saving both: its meta and each request's blocks."""
    assert engine.sched.hit("load", cached, 0) == 48
    blocks = {"load": engine.alloc(64), "save": engine.alloc(64)}
    engine.sched.allocated("load", blocks["load"], 48)
    engine.sched.scheduled("load", cached, 48, 16, block_ids=blocks["load"])
    engine.sched.allocated("save", blocks["save"], 0)
    engine.sched.scheduled("save", fresh, 0, 64, block_ids=blocks["save"])
    meta = engine.sched.build()
    assert len(meta.loads) == 1 and len(meta.saves) == 2
    return meta, blocks


def test_a_step_that_loads_asks_its_reserve_at_bind_and_takes_it_before_its_forward(srv):
    """The Reserve is asked for at bind; start_load takes its answer once the loads are
    launched (from the lookup's pins: no Acquire), before the forward's hooks; loaded and
    saved pages are exact."""
    seed = Engine(srv.address)
    cached, fresh = prompt(64, 16), prompt(64, 17)
    seed.run_prompt("seed", cached[:49])            # pages 0-2 stored
    e = Engine(srv.address)
    warm(e)
    calls, hooks, bound = lease_calls(e.worker.client), [], []

    def bind(meta, _bind=e.worker.bind):
        _bind(meta)
        bound.append(e.worker.step_reserve.pending)
    e.worker.bind = bind

    def hook(name, _save_layer=e.worker.save_layer):
        hooks.append((tuple(sorted(calls)), e.worker.step_reserve.pending))
        _save_layer(name)
    e.worker.save_layer = hook
    meta, blocks = load_and_save(e, cached, fresh)
    _, _, errors = e.run(meta, [(blocks["load"], cached, 48, 64),
                                (blocks["save"], fresh, 0, 64)])
    assert bound == [True]                               # asked for at bind
    assert hooks[0] == (("reserve",), False)             # made, the answer taken
    assert e.worker.take_stats().loads_pinned == 1
    assert errors == set()
    e.expect_kv(blocks["load"], cached, 64)
    saved = keys_of(e, fresh, 4)
    wait_for(lambda: e.step([]) and all(in_store(srv.address, e.layout, saved)),
             "the saved pages committed")
    assert pages_match(srv.address, e, saved, fresh) == [True] * 4
    for x in (seed, e):
        x.close()


def test_a_step_whose_loads_are_async_reserves_at_bind(srv):
    """Async loads start after the forward (vLLM's model runner), whose save hooks need
    the reservation: the Reserve is asked for at bind."""
    seed = Engine(srv.address)
    cached, fresh = prompt(64, 18), prompt(64, 19)
    seed.run_prompt("seed", cached[:49])            # pages 0-2 stored
    e = Engine(srv.address, mode=LoadMode.ASYNC)
    warm(e)
    calls = lease_calls(e.worker.client)
    assert e.sched.hit("load", cached, 0) == 48
    blocks = {"load": e.alloc(64), "save": e.alloc(64)}
    e.sched.allocated("load", blocks["load"], 48)
    e.sched.allocated("save", blocks["save"], 0)
    e.sched.scheduled("save", fresh, 0, 64, block_ids=blocks["save"])
    meta = e.sched.build()
    assert [spec.is_async for spec in meta.loads] == [True] and len(meta.saves) == 1
    e.worker.bind(meta)
    assert e.worker.step_reserve.pending          # asked for at bind
    for layer in range(len(NAMES)):
        compute(e, layer, blocks["save"], fresh)
    e.worker.start_load(meta)                   # after the forward, as vLLM does
    assert sorted(calls) == ["acquire", "reserve"]
    assert not e.worker.step_reserve.pending
    e.worker.wait_for_save()
    wait_for(lambda: "load" in e.worker.finished(), "the async load landed")
    assert e.worker.load_errors() == set()
    e.expect_kv(blocks["load"], cached, 48)
    for x in (seed, e):
        x.close()


@pytest.mark.parametrize("pins", [False, True])
def test_a_hung_store_costs_a_step_that_loads_and_saves_one_timeout(srv, pins):
    """The step's Acquire and its Reserve (asked for at bind) wait for the store side by
    side, on two connections: one timeout for the step, not two. The Acquire's opens
    the breaker. A load the lookup's pins serve needs no call: its pages, pinned by the
    lookup's lease, are read from the pool although the store hangs; the Reserve alone
    waits."""
    timeout = 0.3
    seed = Engine(srv.address)
    cached = prompt(64, 6)
    seed.run_prompt("seed", cached[:49])            # pages 0-2 stored
    e = Engine(srv.address, timeout=timeout, probe_interval=60.0)
    warm(e)
    fresh = prompt(64, 7)
    meta, blocks = load_and_save(e, cached, fresh)
    assert all(spec.pins is not None for spec in meta.loads)
    if not pins:
        meta = dataclasses.replace(meta, loads=tuple(
            dataclasses.replace(spec, pins=None) for spec in meta.loads))
    sigstop(srv.proc.pid)
    try:
        start = time.monotonic()
        _, _, errors = e.run(meta, [(blocks["load"], cached, 48, 64),
                                    (blocks["save"], fresh, 0, 64)])
        step = time.monotonic() - start
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)
    assert step < 2 * timeout, step
    if pins:
        assert errors == set()
        e.expect_kv(blocks["load"], cached, 48)
    else:
        assert errors == set(blocks["load"][:3])   # the engine recomputes those pages
        assert e.worker.breaker.open
    assert in_store(srv.address, e.layout, keys_of(e, fresh, 4)) == [False] * 4
    for x in (seed, e):
        x.close()
