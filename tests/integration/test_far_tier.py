"""FarTier, the far tier in the storage engine's tier shape, on a real 3-master cluster:
two hosts' tiers share pages byte-exact, reads are batched by bytes, evict and clear
reach only their own namespace."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from kvstore_server.far import reads
from kvstore_server.far.client import FarClient
from kvstore_server.far.reads import ParallelReader
from kvstore_server.far.settings import parse_far
from kvstore_server.far.tier import FarTier


@pytest.fixture
def hosts(far_cluster):
    """Two hosts' far tiers of one fleet, and a third of another deployment."""
    urls = ",".join(far_cluster.urls)
    fleet, other = "fleet" + os.urandom(4).hex(), "other" + os.urandom(4).hex()
    tiers = [FarTier(FarClient(parse_far(urls, timeout=1.0, namespace=ns)))
             for ns in (fleet, fleet, other)]
    yield tiers
    for t in tiers:
        t.close()


def _pages(n, size):
    return [os.urandom(16) for _ in range(n)], np.frombuffer(os.urandom(n * size),
                                                            np.uint8).reshape(n, size)


def test_a_page_spilled_on_one_host_is_read_byte_exact_on_another(hosts):
    a, b, _ = hosts
    layout = os.urandom(16)
    keys, pages = _pages(12, 256 << 10)
    assert all(a.offer(layout, k, p) for k, p in zip(keys, pages))
    assert a.flush(30) == 0
    assert b.contains(layout, keys + [b"nope"]).tolist() == [True] * 12 + [False]
    out = np.zeros_like(pages)
    assert b.read_into(layout, keys, list(out)) == [True] * 12
    assert np.array_equal(out, pages)
    assert b.client.counters.hits >= 12 and b.client.counters.bytes_read == pages.nbytes


def test_reads_go_in_parts_of_bounded_bytes_several_in_flight(hosts, monkeypatch):
    a, b, _ = hosts
    layout = os.urandom(16)
    keys, pages = _pages(10, 64 << 10)
    a.client.put(layout, list(zip(keys, pages)))
    calls, flying, most = [], [0], [0]
    real_read = b.client.read
    lock = threading.Lock()

    def read(*args, **kw):
        with lock:
            calls.append(len(args[1]))
            flying[0] += 1
            most[0] = max(most[0], flying[0])
        time.sleep(0.05)                   # long enough for the next parts to start
        try:
            return real_read(*args, **kw)
        finally:
            with lock:
                flying[0] -= 1

    monkeypatch.setattr(b.client, "read", read)
    b.reader = ParallelReader(b.client.read, 1.0)
    monkeypatch.setattr(reads, "PART_BYTES", 3 * (64 << 10))
    monkeypatch.setattr(reads, "PARALLEL", 2)
    out = np.zeros_like(pages)
    try:
        assert b.read_into(layout, keys, list(out)) == [True] * 10
    finally:
        b.reader.close()
    assert sorted(calls) == [1, 3, 3, 3] and np.array_equal(out, pages)
    assert most[0] == 2                    # in parallel, and never more than asked


def test_a_buffer_of_another_size_is_a_miss(hosts):
    a, b, _ = hosts
    layout, key = os.urandom(16), os.urandom(16)
    a.client.put(layout, [(key, b"x" * 100)])
    assert b.read_into(layout, [key], [bytearray(99)]) == [False]


def test_evict_and_clear_reach_only_their_own(hosts):
    a, b, other = hosts
    keep, drop = os.urandom(16), os.urandom(16)
    keys = [os.urandom(16) for _ in range(20)]
    for t in (a, other):
        t.client.put(keep, [(k, b"keep") for k in keys])
        t.client.put(drop, [(k, b"drop") for k in keys])
    assert a.evict(layout_id=drop) == (20, 0)
    assert not b.contains(drop, keys).any() and b.contains(keep, keys).all()
    assert a.evict(nbytes=1 << 30) == (0, 0)            # bytes: the cluster's business
    assert a.evict(everything=True)[0] == 20
    assert not b.contains(keep, keys).any()
    assert other.contains(keep, keys).all() and other.contains(drop, keys).all()


def test_delete_forgets(hosts):
    a, b, _ = hosts
    layout, key = os.urandom(16), os.urandom(16)
    a.client.put(layout, [(key, b"page")])
    assert b.delete(layout, [key]) == 1 and not a.contains(layout, [key]).any()
