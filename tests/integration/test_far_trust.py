"""What anyone who can write the cluster can and cannot do to a fleet's servers: a value
planted under a page's name, however large, is refused without being fetched whole; a
value forged without the fleet's secret is a miss with a counted reason, never a page.
Real servers, a real 3-master cluster, values planted with a plain cluster client."""

from __future__ import annotations

import os
import re
import struct
import time
import urllib.request

import glide_sync as glide
import numpy as np
import pytest
import xxhash

from kvstore_client import KVStoreClient, PageLayout
from kvstore_server.far.codec import encode
from kvstore_server.far.keys import is_record
from kvstore_server.far.secret import Keyring
from kvstore_testing.serverproc import ServerProcess, free_port
from tests.waiting import wait_for

LAYOUT = PageLayout(model="trust", num_layers=2, page_tokens=16, num_kv_heads=4,
                    head_size=64)                               # 32 KiB pages


def keys(n, tag="t"):
    return [xxhash.xxh3_128_digest(f"{tag}:{i}".encode()) for i in range(n)]


def pages(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, LAYOUT.page_bytes),
                                                dtype=np.uint8)


def far_tier(client):
    return next(t for t in client.stats().tiers if t.name == "far")


def rejected(server, reason: str) -> float:
    """kvstore_far_rejected_total{reason=...} of a server: values refused, never served."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics",
                                  timeout=5).read().decode()
    found = re.search(rf'^kvstore_far_rejected_total{{reason="{reason}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class Cluster:
    """A plain glide client: what anyone holding the cluster's password can do."""

    def __init__(self, cluster) -> None:
        self.client = glide.GlideClusterClient.create(glide.GlideClusterClientConfiguration(
            [glide.NodeAddress("127.0.0.1", cluster.nodes[0].port)], request_timeout=30_000))

    def names(self, namespace: str) -> list[bytes]:
        """The names of the namespace's pages (not the layout records beside them)."""
        cursor, found = glide.ClusterScanCursor(), []
        while True:
            cursor, names = self.client.scan(cursor, match=f"{namespace}:*", count=1000)
            found += [name for name in names if not is_record(name)]
            if cursor.is_finished():
                return sorted(found)

    def close(self) -> None:
        self.client.close()


@pytest.fixture
def fleet(fresh_cluster):
    """(start, raw, namespace): start(write) -> a server of one fleet, on a cluster of 3
    masters with a replica each, as a fleet's would be; raw plants values in it."""
    far_cluster = fresh_cluster(3, 1)
    namespace = "t" + os.urandom(4).hex()
    servers = []
    raw = Cluster(far_cluster)

    def start(write="through", **flags):
        flags.setdefault("far_timeout", "2s")
        port = free_port()
        srv = ServerProcess(far=",".join(far_cluster.urls), far_namespace=namespace,
                            far_write=write, metrics_port=port, **flags).start()
        srv.metrics_port = port
        servers.append(srv)
        return srv

    yield start, raw, namespace
    raw.close()
    for srv in servers:
        srv.stop()


def test_an_oversized_planted_value_is_refused_unfetched(fleet):
    start, raw, namespace = fleet
    a, b = start("through"), start("off")
    ks, data = keys(4, "big"), pages(4)
    with KVStoreClient(a.address) as ca, KVStoreClient(b.address) as cb:
        ca.put(ca.register_layout(LAYOUT), ks, data)
        assert wait_for(lambda: far_tier(ca).writes == 4)
        names = raw.names(namespace)
        assert len(names) == 4
        for name in names:                  # 48 MiB under each 32 KiB page's name
            raw.client.set(name, os.urandom(48 << 20))
        nb = cb.register_layout(LAYOUT)
        before = rss_bytes(b.proc.pid)
        for _ in range(3):
            with pytest.raises(KeyError):
                cb.get(nb, ks)
        grown = rss_bytes(b.proc.pid) - before
        # Fetched whole, the four values were 192 MiB a Get; refused in the cluster,
        # none of their bytes cross. 32 MiB is room for the allocator's own noise.
        assert grown < 32 << 20, f"server grew {grown >> 20} MiB"
        assert rejected(b, "oversized") == 12                   # refused, counted
        assert far_tier(cb).reads == 0


def _forge_v1(value: bytes, page: bytes) -> bytes:
    """What anyone could write before the MAC: the page's own header (layout id, key)
    with the attacker's payload and its unkeyed xxh3_64 (format version 1)."""
    klen, lid = value[5], value[8:24]
    start = 40 if value[4] == 1 else 72
    key = value[start:start + klen]
    h = xxhash.xxh3_64(key)
    h.update(page)
    return struct.pack("<4sBBH16sQQ", b"KVFP", 1, klen, 0, lid, len(page),
                       h.intdigest()) + key + page


def _forge_v2(value: bytes, page: bytes) -> bytes:
    """A value in the current format signed with a secret the fleet does not hold."""
    klen, lid = value[5], value[8:24]
    return encode(lid, value[72:72 + klen], page, Keyring.of([b"attacker" * 8]))


@pytest.mark.parametrize("forge, reason", [(_forge_v1, "unsigned"),
                                           (_forge_v2, "unknown_key")])
def test_a_forged_value_is_a_miss_with_a_counted_reason(fleet, forge, reason):
    start, raw, namespace = fleet
    a, b = start("through"), start("off")
    ks, data = keys(4, "forged"), pages(4, 1)
    evil = pages(4, 666)
    with KVStoreClient(a.address) as ca, KVStoreClient(b.address) as cb:
        ca.put(ca.register_layout(LAYOUT), ks, data)
        assert wait_for(lambda: far_tier(ca).writes == 4)
        for name in raw.names(namespace):       # every page replaced by the attacker's
            value = raw.client.get(name)
            i = next(j for j, k in enumerate(ks) if k in value[:200])
            raw.client.set(name, forge(value, evil[i].tobytes()))
        nb = cb.register_layout(LAYOUT)
        assert cb.lookup(nb, ks) == 4           # present by name: a lookup cannot tell
        with pytest.raises(KeyError):
            cb.get(nb, ks)                      # unkeyed, evil was served as a hit
        for k in ks:
            with pytest.raises(KeyError):
                cb.get(nb, [k])
        assert rejected(b, reason) == 8         # each refusal counted under its reason
        assert far_tier(cb).reads == 0


def test_a_secret_rotates_through_a_fleet_without_a_restart(fleet, tmp_path):
    start, _raw, _namespace = fleet
    old, new = os.urandom(32).hex(), os.urandom(32).hex()
    file_a, file_b = tmp_path / "a", tmp_path / "b"
    file_a.write_text(old + "\n")
    file_b.write_text(new + "\n" + old + "\n")          # step 1 on B: reads both
    a = start("through", far_secret_file=str(file_a))
    b = start("off", far_secret_file=str(file_b))
    by_old, by_new = keys(4, "old"), keys(4, "new")
    with KVStoreClient(a.address) as ca, KVStoreClient(b.address) as cb:
        na, nb = ca.register_layout(LAYOUT), cb.register_layout(LAYOUT)
        ca.put(na, by_old, pages(4, 10))
        assert wait_for(lambda: far_tier(ca).writes == 4)
        assert np.array_equal(cb.get(nb, by_old), pages(4, 10))    # old, accepted
        replace(file_a, new + "\n" + old + "\n")                   # step 2 on A: signs new
        time.sleep(1.5)                                             # looked at once a second
        ca.put(na, by_new, pages(4, 11))
        assert wait_for(lambda: far_tier(ca).writes == 8)
        assert np.array_equal(cb.get(nb, by_new), pages(4, 11))
        replace(file_b, new + "\n")                                # step 3 on B: old gone
        time.sleep(1.5)
        cb.evict(everything=True, tier="dram")
        assert cb.lookup(nb, by_old) == 4                           # names, not pages
        with pytest.raises(KeyError):
            cb.get(nb, by_old[:1])
        assert np.array_equal(cb.get(nb, by_new), pages(4, 11))
        assert rejected(b, "unknown_key") == 1


def replace(path, text: str) -> None:
    """Write a secret file as an operator's tool would: a new file renamed over the old."""
    tmp = path.with_suffix(".new")
    tmp.write_text(text)
    os.replace(tmp, path)
