"""What admitting a burst of new requests costs the engine's scheduler loop.

vLLM asks the connector, request by request inside one `schedule()`, how much of each
prompt the store holds (`get_num_new_matched_tokens`); every answer is a lookup (with a
lease) on the store. This times that loop for a burst of requests sharing a system prompt
whose pages are stored, as the scheduler half does it (connector.scheduler.SchedulerHalf:
hash the pages not hashed yet, one Lookup over every rank's layout, keep the lease), then
their release. The same burst is asked over the fast path and over gRPC (the lookup
stream), in interleaved repetitions; the hashing alone is timed beside them.

    kvstore-bench admit [--requests 64] [--system-len 2048] [--user-len 128] [--reps 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from kvstore_connector.config import ConnectorConfig
from kvstore_connector.hashing import page_keys
from kvstore_connector.scheduler import SchedulerHalf

from kvstore_client import KVStoreClient, PageLayout

from kvstore_testing.serverproc import ServerProcess

__all__ = ["main"]

# One small layer: a lookup's cost does not depend on the page's size, and the store then
# holds a 2,048-token prefix in a few MiB.
LAYOUT = PageLayout(model="admit-bench", dtype="bfloat16", num_layers=1, page_tokens=16,
                    num_kv_heads=1, head_size=64)


def _burst(sched: SchedulerHalf, prompts: list[np.ndarray], tag: str) -> tuple[float, int]:
    """Seconds to ask every request once, as one schedule() would, and the tokens hit."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    started = time.perf_counter()
    hit = 0
    for req_id, tokens in zip(ids, prompts):
        hit += sched.hit(req_id, tokens, 0) or 0
    took = time.perf_counter() - started
    for req_id in ids:
        sched.finished(req_id)
    sched.build()                       # sends the lease releases
    return took, hit


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvstore-bench admit",
                                description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--system-len", type=int, default=2048)
    p.add_argument("--user-len", type=int, default=128)
    p.add_argument("--reps", type=int, default=7, help="bursts per path (median)")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    system = rng.integers(0, 32000, args.system_len, dtype=np.int32)
    prompts = [np.concatenate([system, rng.integers(0, 32000, args.user_len, dtype=np.int32)])
               for _ in range(args.requests)]
    with ServerProcess(dram="256MiB").start() as srv:
        config = ConnectorConfig(server=srv.address, lookup_timeout=5.0)
        with KVStoreClient(srv.address, shared_memory=False) as filler:
            ns = filler.register_layout(LAYOUT)
            keys = page_keys(system, LAYOUT.page_tokens, LAYOUT.chain_seed)
            filler.put(ns, keys, np.zeros((len(keys), ns.page_bytes), np.uint8))
        paths = {"fast path": True, "gRPC": False}
        scheds = {name: SchedulerHalf(config, [LAYOUT], 16, client=KVStoreClient(
            srv.address, shared_memory=False, retries=0, timeout=5.0, data_plane=fast))
            for name, fast in paths.items()}
        times: dict[str, list[float]] = {name: [] for name in paths}
        hits: dict[str, int] = {}
        for rep in range(args.reps + 1):                # the first burst warms up
            for name, sched in scheds.items():
                took, hit = _burst(sched, prompts, f"{name}-{rep}")
                if rep:
                    times[name].append(took)
                    hits[name] = hit
        hashing = []
        for _ in range(args.reps):
            started = time.perf_counter()
            for tokens in prompts:
                page_keys(tokens[:(len(tokens) - 1) // 16 * 16], 16, LAYOUT.chain_seed)
            hashing.append(time.perf_counter() - started)
        for sched in scheds.values():
            sched.close()
    n = args.requests
    print(f"{n} new requests, {args.system_len}-token shared system prompt stored + "
          f"{args.user_len} own tokens each; median of {args.reps} bursts")
    print()
    print("| path | burst ms | per request us | tokens hit |")
    print("|---|---|---|---|")
    for name in paths:
        med = statistics.median(times[name])
        print(f"| {name} | {med * 1e3:.2f} | {med / n * 1e6:.0f} | {hits[name]:,} |")
    med = statistics.median(hashing)
    print(f"| hashing alone (in both) | {med * 1e3:.2f} | {med / n * 1e6:.0f} | - |")
    print()
    fast, grpc_ = (statistics.median(times[k]) for k in paths)
    print(f"fast path / gRPC: {grpc_ / fast:.1f}x faster")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
