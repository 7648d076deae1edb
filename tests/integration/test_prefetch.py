"""Prefetched lookups (LookupMode.PREFETCH) against a real kvstore-server.

The scheduler half as an engine's scheduler drives it: a request seen for the first time
may hear "ask again" (None) while the worker looks it up; a later ask takes the answer.
Checked: the answers equal the store's, every lookup lease is dropped on every path
(taken and not loaded, finished before the answer was taken, finished while in flight,
tokens changed, too short a hit, closed), and a hung store costs one ask at most one lookup_timeout, after which no ask waits.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

import numpy as np
import pytest

from kvstore_client import KVStoreClient, PageLayout
from kvstore_connector.config import ConnectorConfig
from kvstore_connector.scheduler import SchedulerHalf
from kvstore_connector.scheduler.hashing import page_keys
from kvstore_testing.serverproc import sigstop
from tests.waiting import wait_for

LAYOUT = PageLayout(model="prefetch-test", dtype="bfloat16", num_layers=2, page_tokens=16,
                    num_kv_heads=1, head_size=16)


@pytest.fixture
def srv(fresh_server):
    return fresh_server(dram="32MiB", lease_ttl="30s")


def prompt(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 32000, n).astype(np.int32)


def store(srv, tokens: np.ndarray) -> int:
    """Put the full pages of tokens; returns how many."""
    keys = page_keys(tokens[:len(tokens) // 16 * 16], 16, LAYOUT.chain_seed)
    with KVStoreClient(srv.address) as c:
        ns = c.register_layout(LAYOUT)
        c.put(ns, keys, np.zeros((len(keys), ns.page_bytes), np.uint8))
    return len(keys)


def sched_of(srv, **config) -> SchedulerHalf:
    config.setdefault("lookup_timeout", 5.0)
    return SchedulerHalf(ConnectorConfig(server=srv.address, **config), [LAYOUT], 16)


def leases(srv) -> int:
    with KVStoreClient(srv.address) as c:
        return c.stats().leases


def wait_leases(srv, n: int, timeout: float = 5.0) -> bool:
    return wait_for(lambda: leases(srv) == n, f"{n} leases in the server", timeout=timeout)


def answer(sched: SchedulerHalf, req_id: str, tokens, local: int = 0):
    """Ask as consecutive steps would (build() between asks) until answered."""
    for _ in range(100):
        got = sched.hit(req_id, tokens, local)
        if got is not None:
            return got
        sched.build()
        time.sleep(0.01)
    raise AssertionError(f"{req_id}: no answer after 100 asks")


def test_a_burst_hears_ask_again_then_gets_the_stores_answers(srv):
    system = prompt(160, 1)
    store(srv, system)
    sched = sched_of(srv, lookup_wait_ms=0)
    prompts = {f"r{i}": np.concatenate([system, prompt(40, 100 + i)]) for i in range(8)}
    try:
        answer(sched, "warm", prompt(40, 99))        # connected and registered
        # Asked back to back with no wait: "ask again" (a request whose ask finds the
        # worker's call in flight past 2 ms, on a loaded machine, waits for its answer).
        first = [sched.hit(r, t, 0) for r, t in prompts.items()]
        assert None in first and set(first) <= {None, 160}, first
        sched.build()
        assert {r: answer(sched, r, t) for r, t in prompts.items()} == dict.fromkeys(prompts, 160)
        assert sched.prefetch.looked_up == 9           # one lookup each, no more
        assert leases(srv) == 8                       # each answer holds its pages
        for r in prompts:                             # the engine loads none of them
            sched.allocated(r, list(range(13)), 0)
        sched.build()
        assert wait_leases(srv, 0)
    finally:
        sched.close()


def test_a_lone_request_is_answered_in_its_own_step(srv):
    tokens = prompt(100, 2)
    store(srv, tokens)
    sched = sched_of(srv, lookup_wait_ms=2000)        # a loaded machine: generous
    try:
        assert sched.hit("warm", prompt(50, 3), 0) == 0   # connects, registers
        assert sched.hit("r", tokens, 0) == 96
    finally:
        sched.close()


def test_while_the_worker_is_idle_the_loop_asks_itself_then_hands_the_rest_over(srv):
    """A lone request costs no hand-over between threads: asked on the loop while the
    worker is idle and the step's lookup_wait_ms lasts. Past that, requests go to the
    worker and hear "ask again" (the burst's bound on the loop)."""
    system = prompt(160, 4)
    store(srv, system)
    sched = sched_of(srv, lookup_wait_ms=2000)
    try:
        assert sched.hit("warm", prompt(40, 5), 0) == 0
        assert sched.hit("lone", system, 0) == 144     # answered on the loop
        assert sched.prefetch.looked_up == 0
        sched.build()
        sched.config = dataclasses.replace(sched.config, lookup_wait_ms=0.0)
        got = [sched.hit(f"b{i}", np.concatenate([system, prompt(40, 10 + i)]), 0)
               for i in range(4)]
        assert set(got) <= {None, 160}               # the step's time is spent: handed over
        sched.build()
        assert [answer(sched, f"b{i}", np.concatenate([system, prompt(40, 10 + i)]))
                for i in range(4)] == [160] * 4
        assert sched.prefetch.looked_up == 4
    finally:
        sched.close()


def test_finished_before_the_answer_was_taken_releases_its_lease(srv):
    tokens = prompt(100, 4)
    store(srv, tokens)
    sched = sched_of(srv, lookup_wait_ms=0)
    try:
        assert sched.hit("r", tokens, 0) is None
        assert sched.lookups_pending == 1
        sched.finished("r")                           # answered or not, it is gone
        sched.build()
        assert sched.prefetch.looked_up <= 1
        # The worker is done with it (looked up and its lease released, or skipped):
        # only then does "no lease" mean the lease was released.
        wait_for(sched.prefetch.idle, "the lookup worker to be idle", timeout=5)
        assert wait_leases(srv, 0)
        assert sched.lookups_pending == 0
    finally:
        sched.close()


def test_finished_while_the_lookup_is_in_flight_releases_the_lease_when_it_comes(srv):
    tokens = prompt(100, 5)
    store(srv, tokens)
    sched = sched_of(srv, lookup_wait_ms=0)
    try:
        answer(sched, "warm", prompt(40, 6))          # connected and registered
        sigstop(srv.proc.pid)                         # the next lookup waits in flight
        try:
            # "ask again" (or, if this thread was held past 2 ms, a wait for the deadline
            # and "no hit", which abandons the answer the same way)
            assert sched.hit("r", tokens, 0) in (None, 0)
            wait_for(lambda: sched.prefetch.stalled(0.0), "the lookup in flight", timeout=5,
                     interval=0.001)
            sched.finished("r")
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        wait_for(lambda: sched.prefetch.looked_up >= 2, "the answer, leased", timeout=5)
        assert wait_leases(srv, 0)
    finally:
        sched.close()


def test_an_answer_for_other_tokens_is_discarded(srv):
    """Asked with a short prompt, then (before the answer was taken) with the request's
    tokens grown: the answer must count the new tokens' pages, and the old lease goes."""
    tokens = prompt(200, 7)
    store(srv, tokens)
    sched = sched_of(srv, lookup_wait_ms=0)
    try:
        assert sched.hit("r", tokens[:50], 0) is None      # 3 pages asked
        wait_for(lambda: sched.prefetch.looked_up >= 1, "the first lookup", timeout=5,
                 interval=0.005)
        assert answer(sched, "r", tokens) == 192           # 12 pages, not 3
        assert leases(srv) == 1                            # only the taken one holds
        sched.finished("r")
        sched.build()
        assert wait_leases(srv, 0)
    finally:
        sched.close()


def test_a_lease_not_acted_on_is_dropped_when_asked_again(srv):
    """The engine could not allocate blocks and asks again next step: the earlier
    answer's lease is dropped, and the new answer leases afresh."""
    tokens = prompt(100, 8)
    store(srv, tokens)
    sched = sched_of(srv, lookup_wait_ms=0)
    try:
        assert answer(sched, "r", tokens) == 96
        assert leases(srv) == 1
        assert answer(sched, "r", tokens) == 96            # asked again: a new lookup
        sched.build()
        assert wait_leases(srv, 1)
        sched.allocated("r", list(range(7)), 96)           # the load holds the lease
        sched.build()
        sched.load_finished("r")
        sched.finished("r")
        sched.build()
        assert wait_leases(srv, 0)
    finally:
        sched.close()


def test_hits_shorter_than_min_hit_tokens_are_no_hits(srv):
    short, long_ = prompt(40, 9), prompt(300, 10)
    store(srv, short)
    store(srv, long_)
    sched = sched_of(srv, lookup_wait_ms=0, min_hit_tokens=256)
    try:
        assert answer(sched, "short", short) == 0          # 32 tokens stored
        assert answer(sched, "long", long_) == 288
        sched.finished("short")
        sched.finished("long")
        sched.build()
        assert wait_leases(srv, 0)
    finally:
        sched.close()


def test_close_releases_answers_never_taken(srv):
    tokens = prompt(100, 11)
    store(srv, tokens)
    sched = sched_of(srv, lookup_wait_ms=0)
    assert sched.hit("r", tokens, 0) is None
    wait_for(lambda: sched.prefetch.looked_up >= 1, "the lookup", timeout=5, interval=0.005)
    sched.close()
    assert wait_leases(srv, 0)


def test_a_hung_store_costs_one_ask_one_timeout_then_nothing(srv):
    tokens = prompt(100, 12)
    store(srv, tokens)
    timeout = 0.5
    sched = sched_of(srv, lookup_timeout=timeout, probe_interval=60.0)
    try:
        answer(sched, "warm", prompt(40, 13))
        sched.build()                                      # a new step: 2 ms to wait
        sigstop(srv.proc.pid)
        try:
            # The call is in flight past 2 ms: the first ask (or, if it returned before
            # that, the second) waits out the lookup's deadline and answers "no hit".
            started = time.monotonic()
            got = sched.hit("r", tokens, 0)
            if got is None:
                sched.build()
                time.sleep(0.01)                           # the engine's step
                got = sched.hit("r", tokens, 0)
            met = time.monotonic() - started
            assert got == 0 and sched.breaker.open
            started = time.monotonic()
            assert sched.hit("other", prompt(100, 14), 0) == 0    # asks nothing
            after = time.monotonic() - started
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        assert met < timeout + 0.25 and after < 0.05, (met, after)
    finally:
        sched.close()


def test_a_release_in_flight_keeps_the_loop_from_asking_the_store_itself(srv):
    """A release the lookup thread sends to a hung store holds the client's lease lane for
    its timeout: the loop must not ask the store itself then (it would wait for the lane,
    then for its own call's timeout: two timeouts in one step). The request goes to the
    thread and hears "ask again"."""
    tokens = prompt(100, 15)
    store(srv, tokens)
    timeout = 0.5
    sched = sched_of(srv, lookup_timeout=timeout, probe_interval=60.0)
    calling = threading.Event()                           # a release is in its call
    release_lease = sched.client.release_lease

    def releasing(*args):
        calling.set()
        return release_lease(*args)
    try:
        assert answer(sched, "a", tokens) == 96           # its answer holds a lease
        sched.finished("a")
        sched.client.release_lease = releasing
        sigstop(srv.proc.pid)
        try:
            sched.build()                                 # the release goes to the thread
            assert calling.wait(2)                        # in its call, meeting the hang
            started = time.monotonic()
            got = sched.hit("b", prompt(100, 16), 0)
            took = time.monotonic() - started
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        assert got is None and took < 0.25, (got, took)
    finally:
        sched.close()
