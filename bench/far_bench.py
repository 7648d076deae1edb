"""Far-tier clients side by side on one real cluster: redis-py, valkey-glide, and ours.

    kvstore-bench far [--quick] [--runs 3] [--far redis://HOST:PORT,...]

Without --far it starts its own 3-master cluster on loopback (valkey-server or
redis-server on PATH). For pages of 1 MiB and 64 KiB it times a pipelined GET per page
and an MGET per hash-tag bucket (kvstore_server.far.keys), and for a lookup of 4,096
keys one EXISTS per key against one EVAL_RO per bucket, each through redis-py's cluster
pipeline (hiredis parser) and glide's batch; then FarClient (glide + the value codec,
what the server uses) beside glide's own MGET of the same bytes; then the same through
kvstore servers: server A writes pages through to the cluster, and server B, its DRAM
emptied before every timed call, serves them to a client over gRPC, over the fast path
and from shared memory on the same host (a Get that misses B's DRAM: read from the
cluster, promoted, sent), beside glide's MGET of the same values (one pipelined batch,
and the same cut into the parts B fetches in parallel), and times B's Lookup
of the keys, all missing from its DRAM. Contenders run in interleaved rounds, so load
from other work on the machine falls on all of them alike;
figures are medians. The last lines are the ratios docs/far.md quotes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import glide_sync as glide

from kvstore_server.far.client import EXISTS_SCRIPT, FarClient
from kvstore_server.far.codec import encode
from kvstore_server.far.keys import group_by_bucket
from kvstore_server.far.reads import PARALLEL, PART_BYTES, split
from kvstore_server.far.settings import parse_far

try:
    import redis.cluster as redis_cluster
except ImportError:         # redis-py is in the test extra; without it, glide and ours only
    redis_cluster = None

__all__ = ["main"]

NAMESPACE = "bench"


def _median_times(calls: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            t = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(t) for name, t in times.items()}


class Contenders:
    """The same operations through each client, on names from keys.py."""

    def __init__(self, nodes: list[tuple[str, int]]) -> None:
        self.glide = glide.GlideClusterClient.create(glide.GlideClusterClientConfiguration(
            [glide.NodeAddress(h, p) for h, p in nodes], request_timeout=30_000))
        self.redis = (redis_cluster.RedisCluster(startup_nodes=[
            redis_cluster.ClusterNode(h, p) for h, p in nodes]) if redis_cluster else None)

    def glide_batch(self, commands: list[list]) -> list:
        batch = glide.ClusterBatch(False)
        for args in commands:
            batch.custom_command(args)
        return self.glide.exec(batch, raise_on_error=True)

    def redis_pipeline(self, commands: list[list]) -> list:
        pipe = self.redis.pipeline(transaction=False)
        for args in commands:
            pipe.execute_command(*args)
        return pipe.execute()

    def close(self) -> None:
        self.glide.close()
        if self.redis is not None:
            self.redis.close()


def _pages(c: Contenders, ours: FarClient, size: int, n: int, rounds: int) -> dict:
    layout = os.urandom(16)
    keys = [os.urandom(16) for _ in range(n)]
    page = os.urandom(size)
    ours.put(layout, [(k, page) for k in keys], timeout=60)
    groups = list(group_by_bucket(NAMESPACE, layout, keys).values())
    names = [name for g in groups for _, name in g]
    gets = [["GET", name] for name in names]
    mgets = [["MGET", *(name for _, name in g)] for g in groups]
    calls = {"glide GET": lambda: c.glide_batch(gets),
             "glide MGET": lambda: c.glide_batch(mgets),
             "ours get": lambda: ours.get(layout, keys, timeout=60)}
    if c.redis is not None:
        calls["redis-py GET"] = lambda: c.redis_pipeline(gets)
        calls["redis-py MGET"] = lambda: c.redis_pipeline(mgets)
    assert c.glide_batch(gets[:1])[0] == encode(layout, keys[0], page)
    got = ours.get(layout, keys, timeout=60)
    assert all(p is not None and bytes(p) == page for p in got), "ours: wrong or missing"
    return _median_times(calls, rounds)


def _exists(c: Contenders, ours: FarClient, n: int, rounds: int) -> dict:
    layout = os.urandom(16)
    keys = [os.urandom(16) for _ in range(n)]
    ours.put(layout, [(k, b"p") for k in keys[::2]], timeout=60)
    groups = list(group_by_bucket(NAMESPACE, layout, keys).values())
    per_key = [["EXISTS", name] for g in groups for _, name in g]
    per_bucket = [["EVAL_RO", EXISTS_SCRIPT, str(len(g)), *(name for _, name in g)]
                  for g in groups]
    calls = {"glide EXISTS/key": lambda: c.glide_batch(per_key),
             "glide EVAL_RO/bucket": lambda: c.glide_batch(per_bucket),
             "ours exists": lambda: ours.exists(layout, keys, timeout=60)}
    if c.redis is not None:
        calls["redis-py EXISTS/key"] = lambda: c.redis_pipeline(per_key)
        calls["redis-py EVAL_RO/bucket"] = lambda: c.redis_pipeline(per_bucket)
    assert sum(ours.exists(layout, keys, timeout=60)) == len(keys[::2])
    return _median_times(calls, rounds)


def _through_servers(c: Contenders, nodes: list[tuple[str, int]], size: int, n: int,
                     rounds: int) -> dict:
    """Medians of: glide MGET of the pages' values, server B's Get over gRPC and over the
    fast path (B's DRAM emptied, untimed, before each), B's Lookup of the keys."""
    import numpy as np

    from kvstore_client import KVStoreClient, PageLayout
    from kvstore_server.far.keys import page_key
    from kvstore_testing.serverproc import ServerProcess

    layout = PageLayout(model=f"bench-far-{size}", num_layers=1, page_tokens=1,
                        num_kv_heads=1, head_size=size // 4)        # float16 K and V
    urls = ",".join(f"redis://{h}:{p}" for h, p in nodes)
    # 512 MiB holds the largest set (64 pages of 1 MiB) eight times over, and two such
    # pools start in a few seconds on a busy 2-core machine (larger ones took far longer).
    flags = dict(far=urls, far_namespace=NAMESPACE, far_timeout="5s", dram="512MiB")
    keys = [os.urandom(16) for _ in range(n)]
    pages = np.frombuffer(os.urandom(size), np.uint8)[None, :].repeat(n, 0)
    with ServerProcess(far_write="through", **flags) as a, \
            ServerProcess(far_write="off", **flags) as b, \
            KVStoreClient(a.address) as ca, \
            KVStoreClient(b.address, data_plane=False, shared_memory=False) as grpc_b, \
            KVStoreClient(b.address, data_plane=True, shared_memory=False) as fast_b, \
            KVStoreClient(b.address, shared_memory=True) as shm_b:
        assert layout.page_bytes == size, layout.page_bytes
        ca.put(ca.register_layout(layout), keys, pages)
        ns, ns_fast = grpc_b.register_layout(layout), fast_b.register_layout(layout)
        ns_shm = shm_b.register_layout(layout)
        deadline = time.monotonic() + 60
        while grpc_b.lookup(ns, keys) < n and time.monotonic() < deadline:
            time.sleep(0.1)                     # A writes behind
        groups = list(group_by_bucket(NAMESPACE, ns.layout_id, keys).values())
        mgets = [["MGET", *(name for _, name in g)] for g in groups]
        # glide with the server's own trick (far/reads.py): parts in parallel threads
        parts = [[["MGET", *(name for _, name in g)] for g in group_by_bucket(
            NAMESPACE, ns.layout_id, keys[s:e]).values()]
            for s, e in split([size] * n, PART_BYTES)]
        pool = ThreadPoolExecutor(PARALLEL)
        parallel = lambda: list(pool.map(c.glide_batch, parts))  # noqa: E731
        assert c.glide_batch([["GET", page_key(NAMESPACE, ns.layout_id, keys[0])]])[0]
        empty = lambda: grpc_b.evict(everything=True, tier="dram")  # noqa: E731
        calls = {"glide MGET": (lambda: None, lambda: c.glide_batch(mgets)),
                 "glide MGET, parts in parallel": (lambda: None, parallel),
                 "kvstore get (gRPC)": (empty, lambda: grpc_b.get(ns, keys)),
                 "kvstore get (fast path)": (empty, lambda: fast_b.get(ns_fast, keys)),
                 "kvstore get (shm)": (empty, lambda: shm_b.get(ns_shm, keys)),
                 "kvstore lookup": (empty, lambda: grpc_b.lookup(ns, keys))}
        for name in ("kvstore get (gRPC)", "kvstore get (fast path)", "kvstore get (shm)"):
            calls[name][0]()
            assert np.array_equal(calls[name][1](), pages), f"{name}: wrong pages"
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(rounds):
            for name, (setup, call) in calls.items():
                setup()
                t = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - t)
        pool.shutdown()
        return {name: statistics.median(t) for name, t in times.items()}


def run(nodes: list[tuple[str, int]], quick: bool, runs: int = 1) -> None:
    rounds = 3 if quick else 9
    urls = ",".join(f"redis://{h}:{p}" for h, p in nodes)
    ours = FarClient(parse_far(urls, namespace=NAMESPACE, timeout=10))
    c = Contenders(nodes)
    try:
        print(f"cluster {urls}; medians of {rounds} interleaved rounds")
        ratios = []
        for size, n in (((1 << 20, 16), (64 << 10, 64)) if quick
                        else ((1 << 20, 64), (64 << 10, 512))):
            m = _pages(c, ours, size, n, rounds)
            print(f"\nget {n} pages of {size >> 10} KiB ({n * size >> 20} MiB):")
            for name, t in sorted(m.items(), key=lambda kv: kv[1]):
                print(f"  {name:<16} {t * 1e3:8.2f} ms {n * size / t / 1e9:6.2f} GB/s")
            ratios.append((f"{size >> 10} KiB get", m["glide MGET"] / m["ours get"]))
            if "redis-py MGET" in m:
                ratios.append((f"{size >> 10} KiB redis-py MGET vs glide MGET",
                               m["glide MGET"] / m["redis-py MGET"]))
        across: dict[str, list[float]] = {}         # through-server ratios, per run
        for run_no in range(1, runs + 1):
            for size, n in (((1 << 20, 16),) if quick else ((1 << 20, 64), (64 << 10, 512))):
                m = _through_servers(c, nodes, size, n, rounds)
                print(f"\nthrough kvstore servers{f' (run {run_no} of {runs})' if runs > 1 else ''}"
                      f": B gets {n} pages of {size >> 10} KiB that A wrote "
                      f"({n * size >> 20} MiB), B's DRAM empty:")
                for name, t in sorted(m.items(), key=lambda kv: kv[1]):
                    print(f"  {name:<30} {t * 1e3:8.2f} ms")
                for how in ("gRPC", "fast path", "shm"):
                    across.setdefault(f"{size >> 10} KiB get through kvstore ({how}) vs glide "
                                      "MGET", []).append(m["glide MGET"]
                                                         / m[f"kvstore get ({how})"])
                for how in ("fast path", "shm"):
                    across.setdefault(f"{size >> 10} KiB get through kvstore ({how}) vs glide "
                                      "MGET in parallel parts", []).append(
                        m["glide MGET, parts in parallel"] / m[f"kvstore get ({how})"])
        for name, values in across.items():
            ratios.append((name, statistics.median(values)))
        n = 1024 if quick else 4096
        m = _exists(c, ours, n, rounds)
        print(f"\nlookup of {n} keys (half present):")
        for name, t in sorted(m.items(), key=lambda kv: kv[1]):
            print(f"  {name:<24} {t * 1e3:8.2f} ms")
        if "redis-py EVAL_RO/bucket" in m:
            ratios.append((f"{n}-key lookup redis-py EVAL_RO vs glide EVAL_RO",
                           m["glide EVAL_RO/bucket"] / m["redis-py EVAL_RO/bucket"]))
        ratios.append((f"{n}-key lookup glide EXISTS/key vs EVAL_RO/bucket",
                       m["glide EVAL_RO/bucket"] / m["glide EXISTS/key"]))
        ratios.append((f"{n}-key lookup ours", m["glide EVAL_RO/bucket"] / m["ours exists"]))
        print("\nspeed ratios (> 1: the first named is faster; 'ours': against glide's own):")
        for name, r in ratios:
            print(f"  {name:<72} {r:5.2f}x")
        if runs > 1:
            print(f"\nthrough-server ratios above: medians of {runs} runs; each run's:")
            for name, values in across.items():
                print(f"  {name:<72} " + " ".join(f"{v:5.2f}x" for v in values))
    finally:
        c.close()
        ours.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvstore-bench far", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer, smaller pages: a smoke run")
    p.add_argument("--runs", type=int, default=1,
                   help="times the through-server comparison runs (fresh servers each); "
                        "its ratios are then the medians of the runs (default 1)")
    p.add_argument("--far", metavar="URL[,URL...]",
                   help="an existing cluster (default: start a 3-master one on loopback)")
    args = p.parse_args(argv)
    if args.far:
        run(list(parse_far(args.far).nodes), args.quick, args.runs)
        return 0
    from kvstore_testing.clusterproc import ClusterProcess
    with ClusterProcess(masters=3) as cluster:
        run([("127.0.0.1", node.port) for node in cluster.nodes], args.quick, args.runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
