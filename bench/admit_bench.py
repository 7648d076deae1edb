"""What admitting a burst of new requests costs the engine's scheduler loop.

vLLM asks the connector, request by request inside one `schedule()`, how much of each
prompt the store holds (`get_num_new_matched_tokens`). This times the scheduler half
(connector.scheduler.SchedulerHalf) answering a burst of requests that share a system
prompt whose pages are stored, as a scheduler loop would see it, in both lookup modes:

    sync       every answer is hashed and looked up (with a lease) on the loop's thread
    prefetch   a request seen for the first time goes to the lookup worker; the loop
               waits for answers only within lookup_wait_ms per step, the rest hear
               "ask again" and are asked at the next step

A step is the asks of every request not yet answered, then `build()` (the step's plan);
between steps the engine computes, here a sleep of --gap-ms (1 ms is what vLLM sleeps
between steps that ran nothing, 10 ms a decode step). "loop ms" is the time spent inside
the scheduler half over every step until the whole burst is answered; "release ms" is the
loop's part of dropping the burst's leases afterwards (`finished` + one `build`). Modes
and gaps alternate within each repetition; figures are medians. Lookups go over the fast
path, and over gRPC (the lookup stream) in sync mode for reference; the hashing alone is
timed beside them.

--retain: every request also asks for session retention as it ends (a session of its own,
5 s), as a vLLM request's `kv_transfer_params` would (connector.retention): its stored keys
are handed to the retention thread inside "release ms", and that thread's Retain calls
(one a request) run beside the next burst.

    kvstore-bench admit [--mode sync,prefetch] [--gap-ms 1,10] [--requests 64]
        [--system-len 2048] [--user-len 128] [--reps 7] [--retain]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
import time

import numpy as np

from kvstore_client import KVStoreClient, PageLayout
from kvstore_connector.config import ConnectorConfig, LookupMode
from kvstore_connector.hashing import page_keys
from kvstore_connector.retention import RetainAsk, Retainer
from kvstore_connector.scheduler import SchedulerHalf
from kvstore_testing.serverproc import ServerProcess

__all__ = ["main"]

# One small layer: a lookup's cost does not depend on the page's size, and the store then
# holds a 2,048-token prefix in a few MiB.
LAYOUT = PageLayout(model="admit-bench", dtype="bfloat16", num_layers=1, page_tokens=16,
                    num_kv_heads=1, head_size=64)
_ids = itertools.count()


@dataclasses.dataclass(frozen=True, slots=True)
class Case:
    """One way of admitting the burst: a lookup mode, a path, a gap between steps."""

    mode: LookupMode
    fast: bool              # fast path; False: gRPC
    gap_s: float            # the engine's step between two schedule() calls

    @property
    def name(self) -> str:
        path = "" if self.fast else ", gRPC"
        return f"{self.mode.value}{path}"


@dataclasses.dataclass(frozen=True, slots=True)
class Burst:
    loop_s: float           # inside the scheduler half, every step until all answered
    steps: int              # schedule() calls it took
    release_s: float        # finished() of every request + the build that releases
    hit_tokens: int


def _burst(sched: SchedulerHalf, prompts: list[np.ndarray], gap_s: float,
           retainer: Retainer | None = None) -> Burst:
    """Ask every request as consecutive schedule() calls would until all are answered."""
    ids = [f"r{next(_ids)}" for _ in prompts]
    waiting = list(zip(ids, prompts))
    loop = 0.0
    hit = steps = 0
    while waiting:
        if steps:
            time.sleep(gap_s)
        steps += 1
        started = time.perf_counter()
        asked_again = []
        for req_id, tokens in waiting:
            got = sched.hit(req_id, tokens, 0)
            if got is None:
                asked_again.append((req_id, tokens))
            else:
                hit += got
        sched.build()
        loop += time.perf_counter() - started
        waiting = asked_again
    started = time.perf_counter()
    for req_id in ids:
        if retainer is not None:        # as the vLLM adapter's request_finished does
            retainer.submit(RetainAsk(req_id, 5.0), sched.stored_keys(req_id))
        sched.finished(req_id)
    sched.build()                       # sends (or hands over) the lease releases
    return Burst(loop, steps, time.perf_counter() - started, hit)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvstore-bench admit",
                                description=__doc__.splitlines()[0])
    p.add_argument("--mode", default="sync,prefetch",
                   help="lookup modes, comma-separated (sync, prefetch)")
    p.add_argument("--gap-ms", default="1,10",
                   help="the engine's step between schedule() calls, ms, comma-separated")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--system-len", type=int, default=2048)
    p.add_argument("--user-len", type=int, default=128)
    p.add_argument("--reps", type=int, default=7, help="bursts per case (median)")
    p.add_argument("--retain", action="store_true",
                   help="every request asks for session retention as it ends")
    args = p.parse_args(argv)
    modes = [LookupMode(m) for m in args.mode.split(",")]
    gaps = [float(g) / 1e3 for g in args.gap_ms.split(",")]
    rng = np.random.default_rng(0)
    system = rng.integers(0, 32000, args.system_len, dtype=np.int32)
    prompts = [np.concatenate([system, rng.integers(0, 32000, args.user_len, dtype=np.int32)])
               for _ in range(args.requests)]
    # A sync burst takes one step whatever the gap: one case per path, not per gap.
    cases = [Case(m, fast, g) for m in modes for fast in (True, False)
             for g in (gaps[:1] if m is LookupMode.SYNC else gaps)
             if fast or m is LookupMode.SYNC]
    with ServerProcess(dram="256MiB").start() as srv:
        with KVStoreClient(srv.address, shared_memory=False) as filler:
            ns = filler.register_layout(LAYOUT)
            keys = page_keys(system, LAYOUT.page_tokens, LAYOUT.chain_seed)
            filler.put(ns, keys, np.zeros((len(keys), ns.page_bytes), np.uint8))
        scheds = {}
        for case in cases:
            config = ConnectorConfig(server=srv.address, lookup_timeout=5.0, lookups=case.mode)
            scheds[case] = SchedulerHalf(config, [LAYOUT], 16, client=KVStoreClient(
                srv.address, shared_memory=False, retries=0, timeout=5.0,
                data_plane=case.fast))
        retainers = {case: Retainer(sched.store) for case, sched in scheds.items()
                     if args.retain}
        runs: dict[Case, list[Burst]] = {case: [] for case in cases}
        for rep in range(args.reps + 1):                # the first burst warms up
            for case in cases:
                burst = _burst(scheds[case], prompts, case.gap_s, retainers.get(case))
                if rep:
                    runs[case].append(burst)
        hashing = []
        for _ in range(args.reps):
            started = time.perf_counter()
            for tokens in prompts:
                page_keys(tokens[:(len(tokens) - 1) // 16 * 16], 16, LAYOUT.chain_seed)
            hashing.append(time.perf_counter() - started)
        for retainer in retainers.values():
            retainer.close(10.0)
        for sched in scheds.values():
            sched.close()
    n = args.requests
    print(f"{n} new requests, {args.system_len}-token shared system prompt stored + "
          f"{args.user_len} own tokens each; median of {args.reps} bursts"
          + ("; each request asks for retention as it ends" if args.retain else ""))
    print()
    print("| lookups | step gap ms | steps to answer all | loop ms | per request us "
          "| release ms | tokens hit |")
    print("|---|---|---|---|---|---|---|")
    loop = {}
    for case in cases:
        bursts = runs[case]
        loop[case] = statistics.median(b.loop_s for b in bursts)
        steps = statistics.median(b.steps for b in bursts)
        release = statistics.median(b.release_s for b in bursts)
        gap = "-" if case.mode is LookupMode.SYNC else f"{case.gap_s * 1e3:g}"
        print(f"| {case.name} | {gap} | {steps:g} | {loop[case] * 1e3:.2f} | "
              f"{loop[case] / n * 1e6:.0f} | {release * 1e3:.2f} | {bursts[-1].hit_tokens:,} |")
    print(f"| hashing alone | - | - | {statistics.median(hashing) * 1e3:.2f} | "
          f"{statistics.median(hashing) / n * 1e6:.0f} | - | - |")
    print()
    if retainers:
        counts = [r.counts for r in retainers.values()]
        print(f"retention asks: {sum(c.asked for c in counts)}, retained "
              f"{sum(c.retained for c in counts)}, refused {sum(c.refused for c in counts)}, "
              f"failed {sum(c.failed for c in counts)}, dropped "
              f"{sum(c.dropped for c in counts)}")
        print()
    sync = next((c for c in cases if c.mode is LookupMode.SYNC and c.fast), None)
    grpc_ = next((c for c in cases if c.mode is LookupMode.SYNC and not c.fast), None)
    if sync and grpc_:
        print(f"sync, fast path / gRPC: {loop[grpc_] / loop[sync]:.1f}x faster")
    for case in cases:
        if sync and case.mode is LookupMode.PREFETCH:
            print(f"loop ms, sync / prefetch at a {case.gap_s * 1e3:g} ms step: "
                  f"{loop[sync] / loop[case]:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
