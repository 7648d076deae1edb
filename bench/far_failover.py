"""A master of the far tier's cluster killed under a mixed load through two servers.

    kvstore-bench far-failover [--seconds 60] [--kill-at 5] [--pages 96]

Starts a 3-master cluster with one replica each on loopback (valkey-server or
redis-server on PATH, `cluster-node-timeout` 1 s, `cluster-require-full-coverage no` as
docs/far.md advises) and two kvstore servers on it, both `--far-write through`: A is
the host that computes pages, B the host that reuses them. For --seconds, one loop puts
new pages on A, and asks B for a random batch of A's pages (Lookup, then Get of the run
it counted), B's DRAM emptied after each round so every read goes to the cluster;
--kill-at seconds in, the master holding most of the pages' slots is killed (SIGKILL).
It prints what clients saw: errors (any exception but a miss), wrong pages (compared
byte for byte with what A put), pages served, misses, and how long after the kill every
page was a hit again. The promise it checks: 0 errors, 0 wrong pages.

The short form of it runs in the test suite (tests/integration/test_far_server.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np
import xxhash

__all__ = ["Outcome", "main", "run"]

RECOVER_WAIT = 30.0         # seconds after the load that the pages get to come back


@dataclasses.dataclass(frozen=True, slots=True)
class Outcome:
    """What the clients of the two servers saw."""

    seconds: float          # the load's length
    rounds: int             # loop rounds (a put on A, a lookup and a get on B)
    errors: int             # calls that raised anything but a miss
    wrong_pages: int        # pages served with other bytes than A put
    hits: int               # pages B served
    misses: int             # pages B did not count or could not serve
    puts: int               # pages put on A during the load
    recovered_s: float      # from the kill until every page was a hit again; -1: never
    first_errors: tuple[str, ...] = ()


def run(cluster, seconds: float, kill_at: float, n_pages: int = 96) -> Outcome:
    """The load on a running ClusterProcess (masters with replicas)."""
    from kvstore_client import KVStoreClient, PageLayout
    from kvstore_testing.serverproc import ServerProcess

    layout = PageLayout(model="far-failover", num_layers=4, page_tokens=16, num_kv_heads=8,
                        head_size=64)                           # 128 KiB pages
    keys = [xxhash.xxh3_128_digest(f"f:{i}".encode()) for i in range(n_pages)]
    data = np.random.default_rng(7).integers(0, 256, (n_pages, layout.page_bytes),
                                             dtype=np.uint8)
    expected = dict(zip(keys, data))
    flags = dict(far=",".join(cluster.urls), far_write="through", far_timeout="200ms")
    with ServerProcess(**flags) as a, ServerProcess(**flags) as b, \
            KVStoreClient(a.address) as ca, KVStoreClient(b.address) as cb:
        na, nb = ca.register_layout(layout), cb.register_layout(layout)
        ca.put(na, keys, data)
        _wait(lambda: _far(ca).writes >= n_pages, 30)
        for node in cluster.master_nodes():     # replicas hold every page before the kill
            cluster.cli_call(node, "wait", "1", "2000")
        victim = max(cluster.master_nodes(), key=lambda n: len(cluster.slots_of(n)))
        rng = np.random.default_rng(0)
        errors: list[str] = []
        rounds = wrong = hits = misses = puts = 0
        killed_at = last_miss = None
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            if killed_at is None and time.monotonic() - start >= kill_at:
                cluster.kill(victim)
                killed_at = time.monotonic()
            batch = [keys[i] for i in rng.choice(n_pages, 8, replace=False)]
            try:
                ca.put(na, [xxhash.xxh3_128_digest(f"new:{rounds}:{j}".encode())
                            for j in range(2)], data[:2])
                puts += 2
                n = cb.lookup(nb, batch)
                got = cb.get(nb, batch[:n]) if n else []
                wrong += sum(not np.array_equal(p, expected[k]) for k, p in zip(batch, got))
                hits += n
                misses += len(batch) - n
                if n < len(batch):
                    last_miss = time.monotonic()
            except KeyError:                    # PAGES_MISSING: gone between two calls
                misses += 1
                last_miss = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - anything else is an error to a client
                errors.append(repr(exc))
            cb.evict(everything=True, tier="dram")
            rounds += 1
        elapsed = time.monotonic() - start

        def all_back() -> bool:
            cb.evict(everything=True, tier="dram")
            return cb.lookup(nb, keys) == n_pages and np.array_equal(cb.get(nb, keys), data)

        # Recovered: the last miss after the kill, if rounds after it all hit; else the
        # moment every page was a hit in the check after the load.
        last_round = time.monotonic()
        back = killed_at is not None and _wait(all_back, RECOVER_WAIT)
        if not back:
            recovered = -1.0
        elif last_miss is None or last_miss < killed_at:
            recovered = 0.0
        elif last_round - last_miss > 1.0:
            recovered = last_miss - killed_at
        else:
            recovered = time.monotonic() - killed_at
    return Outcome(elapsed, rounds, len(errors), wrong, hits, misses, puts, recovered,
                   tuple(errors[:5]))


def _far(client):
    return next(t for t in client.stats().tiers if t.name == "far")


def _wait(predicate, timeout: float) -> bool:
    stop = time.monotonic() + timeout
    while time.monotonic() < stop:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvstore-bench far-failover",
                                description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=60.0, help="length of the load (60)")
    p.add_argument("--kill-at", type=float, default=5.0,
                   help="seconds into the load when a master is killed (5)")
    p.add_argument("--pages", type=int, default=96, help="pages A puts first (96)")
    args = p.parse_args(argv)
    from kvstore_testing.clusterproc import ClusterProcess

    with ClusterProcess(masters=3, replicas=1) as cluster:
        out = run(cluster, args.seconds, args.kill_at, args.pages)
    print(f"far-failover: {out.seconds:.1f} s mixed load through two servers on a 3-master "
          f"cluster (1 replica each), a master killed at {args.kill_at:.0f} s")
    print(f"  rounds {out.rounds}, pages put on A {out.puts}")
    print(f"  errors returned to clients  {out.errors}")
    print(f"  wrong pages                 {out.wrong_pages}")
    print(f"  hits {out.hits}, misses {out.misses} "
          f"({out.misses / max(1, out.hits + out.misses):.1%} of pages asked for)")
    print("  every page a hit again      "
          + (f"{out.recovered_s:.1f} s after the kill" if out.recovered_s >= 0 else "never"))
    for line in out.first_errors:
        print(f"  error: {line}")
    ok = out.errors == 0 and out.wrong_pages == 0 and out.recovered_s >= 0
    print("  PASS: 0 errors, 0 wrong pages" if ok else "  FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
