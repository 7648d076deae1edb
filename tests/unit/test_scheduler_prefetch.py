"""The scheduler half's prefetched lookups (LookupMode.PREFETCH) over a fake client on an
in-process store (kvstore_testing.fakeclient): no server, no torch, a second or so.

Checked, from what the store itself holds: answers equal the store's; every lookup lease
is dropped on every path (taken and not loaded, finished before the answer was taken,
finished while the lookup was in flight, asked again, tokens changed, too short a hit,
closed); a hung store costs one ask at most one lookup timeout, after which asks cost
nothing; a store that fails opens the breaker and hears no hit. The same logic against a
real server: tests/integration/test_prefetch.py.
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from kvstore_client import KVStoreError, PageLayout
from kvstore_connector.config import ConnectorConfig
from kvstore_connector.scheduler import SchedulerHalf
from kvstore_connector.scheduler.hashing import page_keys
from kvstore_testing.fakeclient import FakeClient
from tests.waiting import wait_for

LAYOUT = PageLayout(model="prefetch-unit", dtype="bfloat16", num_layers=2, page_tokens=16,
                    num_kv_heads=1, head_size=16)


@pytest.fixture
def client():
    with FakeClient() as c:
        yield c


def prompt(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 32000, n).astype(np.int32)


def store(client: FakeClient, tokens: np.ndarray) -> int:
    """Put the full pages of tokens; returns how many."""
    keys = page_keys(tokens[:len(tokens) // 16 * 16], 16, LAYOUT.chain_seed)
    ns = client.register_layout(LAYOUT)
    client.put(ns, keys, np.zeros((len(keys), ns.page_bytes), np.uint8))
    return len(keys)


def sched_of(client: FakeClient, **config) -> SchedulerHalf:
    config.setdefault("lookup_timeout", 5.0)
    config.setdefault("lookup_wait_ms", 0)
    return SchedulerHalf(ConnectorConfig(server="127.0.0.1:1", **config), [LAYOUT], 16,
                         client=client)


def answer(sched: SchedulerHalf, req_id: str, tokens, local: int = 0):
    """Ask as consecutive steps would (build() between asks) until answered."""
    for _ in range(200):
        got = sched.hit(req_id, tokens, local)
        if got is not None:
            return got
        sched.build()
        time.sleep(0.005)
    raise AssertionError(f"{req_id}: no answer after 200 asks")


def leases_drop_to(client: FakeClient, n: int) -> bool:
    return wait_for(lambda: client.leases == n, f"{n} leases in the store", timeout=5)


def test_a_burst_is_answered_by_the_store_and_each_answer_holds_its_pages(client):
    system = prompt(160, 1)
    store(client, system)
    sched = sched_of(client)
    prompts = {f"r{i}": np.concatenate([system, prompt(40, 100 + i)]) for i in range(8)}
    try:
        first = [sched.hit(r, t, 0) for r, t in prompts.items()]
        assert set(first) <= {None, 160}, first
        sched.build()
        assert {r: answer(sched, r, t) for r, t in prompts.items()} == dict.fromkeys(prompts, 160)
        assert client.calls["Lookup"] == 8            # one lookup each, no more
        assert client.leases == 8                     # each answer holds its pages
        for r in prompts:                             # the engine loads none of them
            sched.allocated(r, list(range(13)), 0)
        sched.build()
        assert leases_drop_to(client, 0)
    finally:
        sched.close()


def test_finished_before_the_answer_was_taken_releases_its_lease(client):
    store(client, prompt(100, 4))
    sched = sched_of(client)
    try:
        sched.hit("r", prompt(100, 4), 0)
        sched.finished("r")                           # answered or not, it is gone
        sched.build()
        assert leases_drop_to(client, 0)
        assert client.calls["Lookup"] <= 1
    finally:
        sched.close()


def test_finished_while_the_lookup_is_in_flight_releases_the_lease_when_it_comes(client):
    tokens = prompt(100, 5)
    store(client, tokens)
    sched = sched_of(client)
    try:
        assert answer(sched, "warm", prompt(40, 6)) == 0    # registered
        client.hung.set()                             # the next lookup waits in flight
        try:
            assert sched.hit("r", tokens, 0) in (None, 0)
            wait_for(lambda: client.calls["Lookup"] == 2, "the lookup in flight")
            sched.finished("r")
        finally:
            client.hung.clear()
        # The answer comes, leased, for a request that is gone: the lease goes back.
        wait_for(lambda: client.calls["ReleaseLease"] >= 1 or client.leases == 0,
                 "the late answer's lease released")
        sched.build()
        assert leases_drop_to(client, 0)
    finally:
        sched.close()


def test_an_answer_for_other_tokens_is_discarded(client):
    """Asked with a short prompt, then (before the answer was taken) with the request's
    tokens grown: the answer counts the new tokens' pages, and the old lease goes."""
    tokens = prompt(200, 7)
    store(client, tokens)
    sched = sched_of(client)
    try:
        assert sched.hit("r", tokens[:50], 0) is None      # 3 pages asked
        wait_for(lambda: client.calls["Lookup"] == 1, "the first lookup")
        assert answer(sched, "r", tokens) == 192           # 12 pages, not 3
        sched.build()
        assert leases_drop_to(client, 1)                   # only the taken one holds
        sched.finished("r")
        sched.build()
        assert leases_drop_to(client, 0)
    finally:
        sched.close()


def test_a_lease_not_acted_on_is_dropped_when_asked_again(client):
    tokens = prompt(100, 8)
    store(client, tokens)
    sched = sched_of(client)
    try:
        assert answer(sched, "r", tokens) == 96
        assert client.leases == 1
        assert answer(sched, "r", tokens) == 96            # asked again: a new lookup
        sched.build()
        assert leases_drop_to(client, 1)
        sched.allocated("r", list(range(7)), 96)           # the load holds the lease
        sched.build()
        assert client.leases == 1
        sched.load_finished("r")
        sched.finished("r")
        sched.build()
        assert leases_drop_to(client, 0)
    finally:
        sched.close()


def test_hits_shorter_than_min_hit_tokens_are_no_hits_and_hold_nothing(client):
    short, long_ = prompt(40, 9), prompt(300, 10)
    store(client, short)
    store(client, long_)
    sched = sched_of(client, min_hit_tokens=256)
    try:
        assert answer(sched, "short", short) == 0          # 32 tokens stored
        assert answer(sched, "long", long_) == 288
        sched.finished("short")
        sched.finished("long")
        sched.build()
        assert leases_drop_to(client, 0)
    finally:
        sched.close()


def test_close_releases_answers_never_taken(client):
    tokens = prompt(100, 11)
    store(client, tokens)
    sched = sched_of(client)
    assert sched.hit("r", tokens, 0) is None
    wait_for(lambda: client.leases == 1, "the answer's lease")
    sched.close()
    assert client.leases == 0


def test_a_hung_store_costs_one_ask_one_timeout_then_nothing(client):
    tokens = prompt(100, 12)
    store(client, tokens)
    client.timeout = timeout = 0.3
    sched = sched_of(client, lookup_timeout=timeout, probe_interval=60.0)
    try:
        assert answer(sched, "warm", prompt(40, 13)) == 0
        sched.build()                                      # a new step: 2 ms to wait
        client.hung.set()
        try:
            started = time.monotonic()
            got = sched.hit("r", tokens, 0)
            if got is None:                                # handed to the worker
                sched.build()
                got = answer(sched, "r", tokens)
            met = time.monotonic() - started
            assert got == 0 and sched.breaker.open
            asked = client.calls["Lookup"]
            started = time.monotonic()
            assert sched.hit("other", prompt(100, 14), 0) == 0    # asks nothing
            after = time.monotonic() - started
            assert client.calls["Lookup"] == asked
        finally:
            client.hung.clear()
        assert met < timeout + 0.25 and after < 0.05, (met, after)
    finally:
        sched.close()


def test_a_store_that_refuses_to_answer_is_no_hit_and_opens_the_breaker(client):
    tokens = prompt(100, 15)
    store(client, tokens)
    sched = sched_of(client, probe_interval=60.0)
    try:
        client.fail = KVStoreError(grpc.StatusCode.UNAVAILABLE, "connection refused")
        assert answer(sched, "r", tokens) == 0
        assert sched.breaker.open
        client.fail = None
        assert client.leases == 0
    finally:
        sched.close()
