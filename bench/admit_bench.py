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

--retain, --events: each case runs twice, alternated, plain and with the engine's extras on
(rows marked "+"), and the ratio of their loop ms is printed. --retain: every request asks
for session retention as it ends (request i of each burst the next turn of session i,
5 s), as a vLLM request's
`kv_transfer_params` would (connector.scheduler.retention): its stored keys are handed to the
retention thread inside "release ms", and that thread's RetainMany calls (one per step's
asks) run beside the next burst of the same case, between its steps (they wait for the
scheduler half's step under way to end, as in an engine): every timed burst follows an untimed
one of its own case, as an engine's admissions follow the ends of the requests before,
and a case's retention calls are waited for before the next case starts. --events: the connector's KV-event feed runs
(connector.events): each finished request's stored pages are queued for it inside
"release ms", and it polls the store every 0.5 s beside the bursts, between their steps
(the steps of whichever case runs: the cases share one connector.scheduler.quiet.StepGate,
as one engine's threads share its scheduler's).

    kvstore-bench admit [--mode sync,prefetch] [--gap-ms 1,10] [--requests 64]
        [--system-len 2048] [--user-len 128] [--reps 7] [--retain] [--events]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
import time
from collections.abc import Sequence

import numpy as np

from kvstore_client import KVStoreClient, PageLayout
from kvstore_connector.config import ConnectorConfig, LookupMode
from kvstore_connector.events import EventFeed, SavedRun
from kvstore_connector.scheduler import SchedulerHalf
from kvstore_connector.scheduler.hashing import page_keys
from kvstore_connector.scheduler.quiet import StepGate
from kvstore_connector.scheduler.retention import RetainAsk, Retainer
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
    extras: bool = False    # retention and/or events on (--retain, --events)

    @property
    def name(self) -> str:
        path = "" if self.fast else ", gRPC"
        return f"{self.mode.value}{path}{' +' if self.extras else ''}"

    @property
    def plain(self) -> Case:
        return dataclasses.replace(self, extras=False)


@dataclasses.dataclass(frozen=True, slots=True)
class Burst:
    loop_s: float           # inside the scheduler half, every step until all answered
    steps: int              # schedule() calls it took
    release_s: float        # finished() of every request + the build that releases
    hit_tokens: int


@dataclasses.dataclass(frozen=True, slots=True)
class Extras:
    """What the engine runs beside its lookups (None: off)."""

    retainer: Retainer | None = None
    events: EventFeed | None = None

    def settle(self, timeout: float = 10.0) -> None:
        """Wait for the retention thread to send what it holds (not timed)."""
        deadline = time.monotonic() + timeout
        while (self.retainer is not None and not self.retainer.idle()
               and time.monotonic() < deadline):
            time.sleep(0.001)

    def close(self) -> None:
        if self.retainer is not None:
            self.retainer.close(10.0)
        if self.events is not None:
            self.events.close()


def _burst(sched: SchedulerHalf, prompts: list[np.ndarray], gap_s: float,
           extras: Extras = Extras(), hashes: Sequence[bytes] = ()) -> Burst:
    """Ask every request as consecutive schedule() calls would until all are answered."""
    ids = [f"r{next(_ids)}" for _ in prompts]
    # What vLLM's requests hold: token ids as a list (Request.all_token_ids), made for
    # every case, plain too: the engine holds them whatever the connector does, and a
    # burst that alone made its 140k ints before its loop ran that loop measurably
    # slower: a cost of this bench, not of the events feed that reads them.
    token_lists = [tokens.tolist() for tokens in prompts]
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
    for slot, req_id in enumerate(ids):
        # As the vLLM adapter's request_finished does. Request i of every burst is the
        # next turn of agent session i: a tenant holds at most 1,024 sessions.
        # One list of its stored keys for both; its token ids as the scheduler half
        # holds them (the engine's list stays the engine's).
        keys = (sched.stored_keys(req_id)
                if extras.retainer is not None or extras.events is not None else [])
        if extras.retainer is not None:
            extras.retainer.submit(RetainAsk(f"agent-{slot}", 5.0), keys)
        if extras.events is not None:
            extras.events.saved(SavedRun(keys, hashes, sched.stored_tokens(req_id), 1, 16))
        sched.finished(req_id)
    sched.build()                       # sends (or hands over) the lease releases
    release = time.perf_counter() - started
    del token_lists                     # the engine's lists end with its requests
    return Burst(loop, steps, release, hit)


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
                   help="beside each case, the same with every request asking for session "
                        "retention as it ends")
    p.add_argument("--events", action="store_true",
                   help="beside each case, the same with the connector's KV-event feed on "
                        "(with --retain: both on)")
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
    if args.retain or args.events:
        cases = [c for case in cases for c in (case, dataclasses.replace(case, extras=True))]
    hashes = [i.to_bytes(32, "big") for i in range(len(prompts[0]) // 16)]
    with ServerProcess(dram="256MiB").start() as srv:
        with KVStoreClient(srv.address, shared_memory=False) as filler:
            ns = filler.register_layout(LAYOUT)
            keys = page_keys(system, LAYOUT.page_tokens, LAYOUT.chain_seed)
            filler.put(ns, keys, np.zeros((len(keys), ns.page_bytes), np.uint8))
        scheds = {}
        # One engine's scheduler marks its steps for every background thread of it: here
        # each case's threads wait for the steps of whichever case runs (the event feeds
        # poll all along), not only their own, so that no case's loop meets another's.
        gate = StepGate()
        for case in cases:
            config = ConnectorConfig(server=srv.address, lookup_timeout=5.0, lookups=case.mode)
            scheds[case] = SchedulerHalf(config, [LAYOUT], 16, client=KVStoreClient(
                srv.address, shared_memory=False, retries=0, timeout=5.0,
                data_plane=case.fast), gate=gate)
        extras = {case: Extras(
            Retainer(sched.store, sched.gate) if args.retain else None,
            EventFeed(KVStoreClient(srv.address, shared_memory=False, retries=0,
                                    timeout=5.0), [LAYOUT], gate=sched.gate)
            if args.events else None)
            for case, sched in scheds.items() if case.extras}
        runs: dict[Case, list[Burst]] = {case: [] for case in cases}
        for rep in range(args.reps + 1):                # the first burst warms up
            # A case runs faster second in a row (the server's caches warm from its
            # twin): plain and "+" take turns going first.
            order = cases
            if (args.retain or args.events) and rep % 2 == 0:     # cases are (plain, +) pairs
                order = [c for i in range(0, len(cases), 2) for c in (cases[i + 1], cases[i])]
            for case in order:
                extra = extras.get(case, Extras())
                # An engine's steady state: the requests before end (their retention,
                # their events) as these arrive. So each timed burst follows an untimed
                # one of its own case, and what its extras leave running is waited for
                # before the next case: every case's threads run beside its own loop,
                # never beside another case's.
                _burst(scheds[case], prompts, case.gap_s, extra, hashes)
                burst = _burst(scheds[case], prompts, case.gap_s, extra, hashes)
                extra.settle()
                if rep:
                    runs[case].append(burst)
        hashing = []
        for _ in range(args.reps):
            started = time.perf_counter()
            for tokens in prompts:
                page_keys(tokens[:(len(tokens) - 1) // 16 * 16], 16, LAYOUT.chain_seed)
            hashing.append(time.perf_counter() - started)
        for extra in extras.values():
            extra.close()
        for sched in scheds.values():
            sched.close()
    n = args.requests
    print(f"{n} new requests, {args.system_len}-token shared system prompt stored + "
          f"{args.user_len} own tokens each; median of {args.reps} bursts"
          + (f"; + : {' and '.join(on)} on" if (on := [name for name, flag in (
              ("retention asked by every request", args.retain),
              ("KV events", args.events)) if flag]) else ""))
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
    counts = [e.retainer.counts for e in extras.values() if e.retainer is not None]
    if counts:
        print(f"retention asks: {sum(c.asked for c in counts)}, retained "
              f"{sum(c.retained for c in counts)}, refused {sum(c.refused for c in counts)}, "
              f"failed {sum(c.failed for c in counts)}, dropped "
              f"{sum(c.dropped for c in counts)}")
    feeds = [e.events.counts for e in extras.values() if e.events is not None]
    if feeds:
        print(f"KV events: {sum(f.stored for f in feeds)} pages announced stored, "
              f"{sum(f.polls for f in feeds)} polls, {sum(f.failed for f in feeds)} failed")
    for case in cases:
        if case.extras:
            print(f"loop ms, {case.name} / {case.plain.name}"
                  f"{'' if case.mode is LookupMode.SYNC else f' at a {case.gap_s * 1e3:g} ms step'}: "
                  f"{loop[case] / loop[case.plain]:.2f}x")
    if counts or feeds:
        print()
    sync = next((c for c in cases if c.mode is LookupMode.SYNC and c.fast and not c.extras),
                None)
    grpc_ = next((c for c in cases if c.mode is LookupMode.SYNC and not c.fast
                  and not c.extras), None)
    if sync and grpc_:
        print(f"sync, fast path / gRPC: {loop[grpc_] / loop[sync]:.1f}x faster")
    for case in cases:
        if sync and case.mode is LookupMode.PREFETCH and not case.extras:
            print(f"loop ms, sync / prefetch at a {case.gap_s * 1e3:g} ms step: "
                  f"{loop[sync] / loop[case]:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
