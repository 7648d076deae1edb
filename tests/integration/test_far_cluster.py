"""The far tier's client against a real 3-master cluster: pages come back byte-exact,
read in glide's reply (inplace.py) as through exec, a 4,096-key lookup is one round trip
per shard, values that are not ours are never served, and a dead or hung cluster
answers as misses within the deadline."""

from __future__ import annotations

import os
import signal
import time
from importlib import metadata

import glide_sync as glide
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvstore_server.far import inplace
from kvstore_server.far.breaker import BreakerState, FarBreaker
from kvstore_server.far.client import FarClient, connect
from kvstore_server.far.codec import ValueVerdict, encode
from kvstore_server.far.keys import BUCKETS, page_key
from kvstore_server.far.metrics import FarCollector
from kvstore_server.far.settings import parse_far
from kvstore_server.far.writer import WriteBehind
from kvstore_testing.serverproc import sigstop

from .delayproxy import DelayProxies


def far(cluster, **kw) -> FarClient:
    kw.setdefault("timeout", 1.0)       # generous: the 2-core CI machine is busy
    return FarClient(parse_far(",".join(cluster.urls), **kw))


@pytest.fixture(scope="module")
def client(far_cluster):
    c = far(far_cluster)
    yield c
    c.close()


def raw(cluster):
    """A plain glide client, to plant values the way anyone with access could."""
    return glide.GlideClusterClient.create(glide.GlideClusterClientConfiguration(
        [glide.NodeAddress("127.0.0.1", cluster.nodes[0].port)]))


def test_pages_round_trip_byte_exact(client):
    layout = os.urandom(16)
    keys = [os.urandom(n) for n in (1, 16, 33, 64)] + [os.urandom(16) for _ in range(60)]
    pages = [os.urandom(1 << 20) for _ in range(8)] + [os.urandom(64 << 10) for _ in keys[8:]]
    assert client.put(layout, list(zip(keys, pages))) == len(keys)
    got = client.get(layout, keys)
    assert [bytes(p) for p in got] == pages
    assert client.exists(layout, keys + [b"absent"]) == [True] * len(keys) + [False]


def _read(client, layout, keys, in_place):
    """FarClient.read's pages, copied while land may look at them."""
    got = {}
    client.read(layout, keys, None, lambda i, p: got.setdefault(i, None if p is None
                                                                else bytes(p)),
                in_place=in_place)
    assert sorted(got) == list(range(len(keys)))       # each key landed once
    return [got[i] for i in range(len(keys))]


def test_a_read_in_glides_reply_serves_what_exec_serves(client):
    layout = os.urandom(16)
    keys = [os.urandom(n) for n in (1, 16, 64)] + [os.urandom(16) for _ in range(40)]
    pages = [os.urandom(1 << 20) for _ in range(3)] + [os.urandom(64 << 10) for _ in keys[3:]]
    assert client.put(layout, list(zip(keys, pages))) == len(keys)
    # The release inplace.py was written against reads in place; any other through exec.
    known = metadata.version("valkey-glide-sync").startswith(inplace._RELEASES)
    assert inplace.supported(client._node(client._slot_map().masters()[0], 5.0)) == known
    assert not inplace.supported(object())          # not glide: exec, not an error
    hits = client.counters.hits
    want = pages + [None]
    assert _read(client, layout, keys + [b"absent"], in_place=True) == want
    assert _read(client, layout, keys + [b"absent"], in_place=False) == want
    assert client.counters.hits == hits + 2 * len(keys)


def test_namespaces_and_layouts_never_meet(far_cluster, client):
    layout, key = os.urandom(16), os.urandom(16)
    client.put(layout, [(key, b"page of fleet kvstore")])
    other = far(far_cluster, namespace="fleet2")
    try:
        assert other.get(layout, [key]) == [None] and other.exists(layout, [key]) == [False]
    finally:
        other.close()
    assert client.get(os.urandom(16), [key]) == [None]


def test_4096_key_lookup_is_one_round_trip_per_shard(far_cluster):
    delay = 0.2
    proxies = DelayProxies([n.port for n in far_cluster.nodes], delay)
    c = FarClient(parse_far(",".join(far_cluster.urls), timeout=5.0),
                  connect=lambda s, node=None: connect(s, node,
                                                        address_resolver=proxies.resolve))
    try:
        layout = os.urandom(16)
        keys = [os.urandom(16) for _ in range(4096)]
        c.put(layout, [(k, b"p") for k in keys[::3]])
        before = _evals(far_cluster)
        t = time.perf_counter()
        bits = c.exists(layout, keys)
        elapsed = time.perf_counter() - t
        evals = [a - b for a, b in zip(_evals(far_cluster), before)]
    finally:
        c.close()
        proxies.close()
    assert bits == [i % 3 == 0 for i in range(4096)]
    # Every node's requests wait `delay` in the proxy: k round trips in a row cost k *
    # delay, the shards' in parallel. Two would be at least 0.4 s.
    assert delay <= elapsed < 2 * delay, f"{elapsed:.3f}s: more than one round trip"
    # one EVAL_RO per bucket, spread over all three masters, never one command per key
    assert sum(evals) == BUCKETS and all(e > 0 for e in evals), evals


def _evals(cluster) -> list[int]:
    counts = []
    for node in cluster.nodes:
        stats = cluster.cli_call(node, "info", "commandstats")
        line = next((ln for ln in stats.split() if ln.startswith("cmdstat_eval_ro:")), "")
        counts.append(int(line.split("calls=")[1].split(",")[0]) if line else 0)
    return counts


@pytest.mark.parametrize("reason", [ValueVerdict.FOREIGN, ValueVerdict.WRONG_KEY,
                                    ValueVerdict.TRUNCATED, ValueVerdict.CORRUPT])
def test_planted_values_are_never_served(far_cluster, client, reason):
    layout, key = os.urandom(16), os.urandom(16)
    good = encode(layout, key, os.urandom(4096))
    value = {ValueVerdict.FOREIGN: b"somebody else's value",
             ValueVerdict.WRONG_KEY: encode(layout, os.urandom(16), os.urandom(4096)),
             ValueVerdict.TRUNCATED: good[:-1],
             ValueVerdict.CORRUPT: good[:-1] + bytes([good[-1] ^ 1])}[reason]
    r = raw(far_cluster)
    try:
        r.set(page_key("kvstore", layout, key), value)
    finally:
        r.close()
    before = client.counters.rejected.get(reason, 0)
    assert client.exists(layout, [key]) == [True]       # a name, not yet a page
    assert client.get(layout, [key]) == [None]
    assert _read(client, layout, [key], in_place=True) == [None]
    assert client.counters.rejected[reason] == before + 2


def test_ttl_and_delete(far_cluster):
    c = far(far_cluster, ttl=60)
    try:
        layout, key = os.urandom(16), os.urandom(16)
        c.put(layout, [(key, b"page")])
        r = raw(far_cluster)
        try:
            assert 0 < r.pttl(page_key("kvstore", layout, key)) <= 60_000
        finally:
            r.close()
        assert c.delete(layout, [key, os.urandom(16)]) == 1
        assert c.exists(layout, [key]) == [False]
    finally:
        c.close()


def test_write_behind_reaches_the_cluster(client):
    writer = WriteBehind(client.put, max_bytes=64 << 20)
    layout = os.urandom(16)
    pages = {os.urandom(16): os.urandom(256 << 10) for _ in range(40)}
    for key, page in pages.items():
        assert writer.offer(layout, key, page)
    assert writer.flush(30)
    writer.close()
    assert [bytes(p) for p in client.get(layout, list(pages))] == list(pages.values())


def test_metrics_are_exported(client):
    registry = CollectorRegistry()
    registry.register(FarCollector(client.counters, lambda: (2, 4096),
                                   lambda: client.breaker.state))
    client.exists(os.urandom(16), [b"k"])
    text = generate_latest(registry).decode()
    for name in ("kvstore_far_hits_total", "kvstore_far_misses_total",
                 "kvstore_far_bytes_read_total", "kvstore_far_errors_total",
                 "kvstore_far_queue_depth 2.0", "kvstore_far_breaker_state 0.0",
                 'kvstore_far_rejected_total{reason="corrupt"}'):
        assert name in text, name


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_dead_cluster_answers_misses_in_time_and_opens_the_breaker(fresh_cluster, how):
    cluster = fresh_cluster()
    timeout = 0.1
    c = FarClient(parse_far(",".join(cluster.urls), timeout=timeout),
                  breaker=FarBreaker(threshold=3, probe_interval=60))
    layout, key = os.urandom(16), os.urandom(16)
    c.put(layout, [(key, b"page")])
    assert c.exists(layout, [key]) == [True]
    for node in cluster.nodes:
        if how == "killed":
            cluster.kill(node)
        else:
            sigstop(node.proc.pid)                    # delivered once it returns
    try:
        times = []
        for _ in range(6):
            t = time.perf_counter()
            assert c.exists(layout, [key]) == [False]
            assert c.get(layout, [key]) == [None]
            assert _read(c, layout, [key], in_place=True) == [None]
            times.append(time.perf_counter() - t)
        # three calls per round: each within its deadline, plus scheduling slack
        assert max(times) < 3 * timeout + 0.25, times
        assert c.breaker.state is BreakerState.OPEN
        assert c.counters.errors >= 3 and c.counters.skipped > 0
        t = time.perf_counter()
        assert c.exists(layout, [key]) == [False]
        assert time.perf_counter() - t < 0.01, "an open breaker still asked the cluster"
    finally:
        for node in cluster.nodes:
            if node.alive:
                node.proc.send_signal(signal.SIGCONT)
        c.close()
