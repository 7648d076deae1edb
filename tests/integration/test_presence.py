"""The presence map against a real server: a client on its host answers misses without a
round trip, the server still counts them, and a map that cannot be trusted (a tier below
DRAM, a stopped or killed server) answers nothing."""

import dataclasses
import time

import numpy as np
import pytest

from kvstore_client import KVStoreClient, KVStoreError, PageLayout
from kvstore_client.attach import PRESENCE_RETRY_S
from kvstore_client.presence import LIVE_SECONDS
from tests.waiting import wait_for, wait_value

LAYOUT = PageLayout(model="presence", num_layers=2, page_tokens=16, num_kv_heads=2,
                    head_size=64, dtype="bfloat16")
KEYS = [f"key-{i:012d}".encode() for i in range(8)]


def _layout_stats(client, ns, want_misses, within=5.0):
    """The layout's (hits, misses), once the misses sent without waiting are counted."""
    got = wait_value(lambda: next(s for s in client.stats().layouts
                                  if s.layout_id == ns.layout_id),
                     lambda got: got.misses >= want_misses, f"{want_misses} misses counted",
                     timeout=within, interval=0.05)
    return got.hits, got.misses


def _salted(salt):
    return dataclasses.replace(LAYOUT, salt=salt)


def _pages(ns, n):
    return np.full((n, ns.page_bytes), 7, dtype=np.uint8)


def test_misses_are_answered_here_and_still_counted_by_the_server(server):
    with KVStoreClient(server.address) as client:
        ns = client.register_layout(_salted("misses"))
        assert client.lookup(ns, KEYS) == 0
        assert client.presence_misses == 1
        client.put(ns, KEYS[:3], _pages(ns, 3))
        assert client.lookup(ns, KEYS) == 3                 # a hit: asked of the server
        assert client.presence_misses == 1
        lease = client.lookup_lease(ns, KEYS[3:], lease_ms=5000)
        assert (lease.count, lease.lease_id) == (0, 0)       # a miss takes no lease
        assert client.presence_misses == 2
        client.delete(ns, KEYS[:3])
        assert client.lookup(ns, KEYS) == 0                 # gone from the map too
        assert client.presence_misses == 3
        # 8 + (8 - 3) + 5 + 8 keys missed, 3 hit: the same counts as without the map.
        assert _layout_stats(client, ns, 26) == (3, 26)


def test_a_miss_told_for_a_layout_the_server_does_not_know_counts_nothing(server):
    """After a restart the server may not know a client's layout yet: the miss it is told
    of is dropped quietly, and the lane's next call is answered as usual."""
    with KVStoreClient(server.address) as client:
        ns = client.register_layout(_salted("known"))
        fast = client.fast_path()
        assert fast is not None
        assert fast.lookup_later([b"\x01" * 16, ns.layout_id], len(KEYS[0]), b"".join(KEYS))
        client.put(ns, KEYS[:1], _pages(ns, 1))
        assert client.lookup_lease(ns, KEYS, lease_ms=5000).count == 1   # the same lane
        assert _layout_stats(client, ns, 15) == (1, 15)


def test_a_lookup_over_layouts_counts_zero_when_one_lacks_the_first_key(server):
    with KVStoreClient(server.address) as client:
        a = client.register_layout(_salted("rank0"))
        b = client.register_layout(_salted("rank1"))
        client.put(a, KEYS, _pages(a, len(KEYS)))
        assert client.lookup(a, KEYS) == len(KEYS)
        assert client.lookup([a, b], KEYS) == 0
        assert client.presence_misses == 1
        client.put(b, KEYS[:2], _pages(b, 2))
        assert client.lookup([a, b], KEYS) == 2


def test_a_scheduler_style_client_uses_the_map_over_the_unix_socket(server):
    with KVStoreClient(server.address, shared_memory=False, local_socket=True) as client:
        ns = client.register_layout(_salted("scheduler"))
        assert client.lookup_lease(ns, KEYS, lease_ms=5000).count == 0
        assert client.presence_misses == 1
    with KVStoreClient(server.address, shared_memory=False) as remote:
        ns = remote.register_layout(_salted("scheduler"))
        assert remote.lookup(ns, KEYS) == 0
        assert remote.presence_misses == 0                  # as another host would


def test_no_map_where_a_disk_tier_may_hold_pages(fresh_server, tmp_path):
    srv = fresh_server(disk="64MiB", disk_dir=str(tmp_path))
    with KVStoreClient(srv.address) as client:
        ns = client.register_layout(LAYOUT)
        assert client.lookup(ns, KEYS) == 0
        client.put(ns, KEYS[:2], _pages(ns, 2))
        assert client.lookup(ns, KEYS) == 2
        assert client.presence_misses == 0


class SkewedClock:
    """time.monotonic() plus a skew a test sets: the client's clock, advanced at will."""

    def __init__(self) -> None:
        self.skew = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.skew


def test_a_map_whose_heartbeat_looks_stale_answers_nothing(server):
    """The map is trusted only while the server's heartbeat is under LIVE_SECONDS old by
    the client's clock: past that, a miss is asked of the server."""
    clock = SkewedClock()
    with KVStoreClient(server.address, clock=clock) as client:
        ns = client.register_layout(_salted("stale"))
        assert client.lookup(ns, KEYS) == 0 and client.presence_misses == 1
        clock.skew = LIVE_SECONDS + 0.5
        assert client.lookup(ns, KEYS) == 0 and client.presence_misses == 1


def test_a_stopped_or_killed_servers_map_answers_nothing(fresh_server):
    srv = fresh_server()
    clock = SkewedClock()
    client = KVStoreClient(srv.address, timeout=2.0, retries=0, clock=clock)
    try:
        ns = client.register_layout(LAYOUT)
        assert client.lookup(ns, KEYS) == 0 and client.presence_misses == 1
        srv.proc.kill()
        srv.proc.wait()
        # Killed, it beats no more: once LIVE_SECONDS pass, a lookup asks the server (and
        # meets that it is gone) instead of reading the stale map.
        clock.skew = LIVE_SECONDS + 0.5
        with pytest.raises(KVStoreError):
            client.lookup(ns, KEYS)
        assert client.presence_misses == 1
        again = fresh_server(port=srv.port)
        # The restarted server holds pages the old map never saw: counted right at once
        # (asked of the server), and its own map is found within PRESENCE_RETRY_S.
        with KVStoreClient(again.address) as other:
            other.put(other.register_layout(LAYOUT), KEYS[:4], _pages(ns, 4))

        def reached() -> bool:
            if client.fast_path() is None:
                return False                # the map is consulted on the fast path only
            try:
                assert client.lookup(ns, KEYS) == 4
            except KVStoreError:
                return False
            return True
        # Still LIVE_SECONDS on, the old client meets the new server where the map is
        # consulted, so the killed server's map is let go; only then may its clock agree
        # with the new server's heartbeat again (the old one would look live once more).
        wait_for(reached, "the old client to reach the new server", timeout=10.0, interval=0.2)
        clock.skew = 0.0
        wait_for(lambda: client.lookup(ns, KEYS[4:]) != 0 or client.presence_misses != 1,
                 "the new server's map to be used", timeout=PRESENCE_RETRY_S + 3.0,
                 interval=0.2)
        again.stop()                                     # graceful: the map is off at once
        with pytest.raises(KVStoreError):
            client.lookup(ns, KEYS[4:])
    finally:
        client.close()


def test_a_map_closed_by_another_thread_answers_nothing(server):
    """A restarted server's old map is closed by the thread that reopens it while another
    may still hold it: that one's questions are answered "unsure", never an error."""
    with KVStoreClient(server.address) as client:
        ns = client.register_layout(_salted("closed"))
        assert client.lookup(ns, KEYS) == 0
        held = client.presence_map()
        assert held is not None and held.absent([ns.layout_id], KEYS[0])
        held.close()
        assert not held.absent([ns.layout_id], KEYS[0])
