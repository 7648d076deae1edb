"""A master of the far tier's cluster killed mid-load: no call raises, no page comes back
wrong, its slots answer as misses during the failover and as hits again after it."""

from __future__ import annotations

import os
import random
import threading
import time

import pytest
from redis.crc import key_slot

from kvstore_server.far.breaker import BreakerState
from kvstore_server.far.client import FarClient
from kvstore_server.far.keys import page_key
from kvstore_server.far.settings import parse_far
from tests.waiting import wait_for

pytestmark = pytest.mark.slow


def test_kill_a_master_under_load(fresh_cluster):
    cluster = fresh_cluster(masters=3, replicas=1)
    client = FarClient(parse_far(",".join(cluster.urls), timeout=0.5))
    layout = os.urandom(16)
    pages = {os.urandom(16): os.urandom(64 << 10) for _ in range(300)}
    keys = list(pages)
    assert client.put(layout, list(pages.items())) == len(pages)
    for node in cluster.master_nodes():         # replicas have every page before the kill
        cluster.cli_call(node, "wait", "1", "2000")

    stop = threading.Event()
    problems: list[str] = []
    rounds = {"calls": 0, "misses": 0, "foreign_misses": 0, "calls_missing_foreign": 0}
    victim = cluster.master_nodes()[0]
    victim_slots = cluster.slots_of(victim)
    on_victim = {k for k in keys if key_slot(page_key("kvstore", layout, k)) in victim_slots}
    assert 0 < len(on_victim) < len(keys)

    def load(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            batch = rng.sample(keys, 32)
            try:
                got = client.get(layout, batch)
                bits = client.exists(layout, batch)
            except Exception as exc:  # noqa: BLE001 - the client must never raise
                problems.append(repr(exc))
                return
            foreign = 0
            for key, page, _bit in zip(batch, got, bits):
                if page is not None and bytes(page) != pages[key]:
                    problems.append("wrong bytes")
                rounds["misses"] += page is None
                foreign += page is None and key not in on_victim
            rounds["foreign_misses"] += foreign
            rounds["calls_missing_foreign"] += foreign > 0
            rounds["calls"] += 1

    threads = [threading.Thread(target=load, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        cluster.kill(victim)
        killed_at = time.monotonic()
        # after the failover (node timeout 1 s, then an election) every page is a hit
        wait_for(lambda: all(p is not None for p in client.get(layout, keys)),
                 "the killed master's slots to come back", timeout=30, interval=0.2)
        recovered = time.monotonic() - killed_at
        time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        client.close()
    assert not problems, problems[:5]
    assert rounds["calls"] > 10
    assert recovered < 30, "pages of the killed master's slots did not come back"
    assert rounds["misses"] > 0, "the kill was not seen at all"
    # The other masters' pages stayed hits while the victim's slots failed over (with
    # cluster-require-full-coverage no, as docs/far.md advises), a handful of calls
    # aside: glide refreshes its slot map when a node drops, and calls that land in it
    # may fail whole. Counted in calls, not pages: one call that failed whole misses
    # ~21 other masters' pages of its 32, which was 5% of all misses in one CI run.
    assert rounds["calls_missing_foreign"] <= 5, rounds
    # Only the dead master's breaker may open (client.py keeps one per master): the
    # cluster's stays closed and the others' pages were asked throughout.
    assert client.breaker.cluster.state is BreakerState.CLOSED
    assert client.state() is not BreakerState.OPEN
