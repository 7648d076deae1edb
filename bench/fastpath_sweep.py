"""The fast path against a raw TCP peer, call pattern by call pattern: what an engine pays.

An engine on another host calls the store per layer, per lookup, per lease: a few pages a
call, not 128 MiB. `kvstore-bench fastpath --sweep` measures each pattern an engine uses
against a raw TCP peer (bench/rawpeer.py: a 9-byte request, then the bytes, no protocol)
in its own process, in the same run, with the same destination and source buffers:

- get_into and put of N pages a call (N = 1, 8, 32, 128) of 64 KiB, 1 MiB and 4 MiB
  pages: GB/s of the median call, and the ratio to the raw peer;
- one page a call, p50 of the call in microseconds (1x1 latency);
- a lookup of 16 keys, and a leased lookup of 16 keys with its release (what a remote
  engine's hit pins and unpins), the release waited for or sent ahead of the next call
  (release_lease_later), p50, each against the raw peer's request and 16-byte answer in
  the blocks between its own;
- where iperf3 is installed, its one loopback stream: the wire's ceiling for C;
- for gets of 1 and 8 pages a call, the CPU each end spends a call (server or raw peer,
  and the client), where the kernel reports it (/proc/PID/task/*/schedstat): where a
  call's time goes. On loopback both ends share the machine's cores and a call is one
  ping-pong, so its latency is about the sum of the two (the raw peer's sum is the
  kernel's part: its sockets, copies and wake-ups).

Each round measures every pattern, the raw peer and the fast path in alternating blocks
(BLOCKS a side: see there why); a ratio is taken within a round, and the table gives the
median over rounds (>= 3 by default), so a noisy neighbour on the shared 2-core machine
moves both sides alike. The round trips of a few bytes come first in a round (_round
says why). `kvstore-bench fastpath --split` (bench/fastpath_split.py) says what the CPU
of a call is spent on at each end: Python or the kernel.
The fast path is driven through KVStoreClient (shared_memory=False), as an engine's
remote connector drives it: key packing and the client's own Python are in the figure.

Each side's gets and puts of TURNS_FROM bytes or more go round CONNECTIONS connections, one
call each in turn (_Turns says why): clients of one connection each, and as many raw
clients; smaller calls stay on one connection a side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

import numpy as np
import xxhash

from kvstore_client import KVStoreClient, PageLayout
from kvstore_client.buffers import page_aligned_empty
from kvstore_testing.serverproc import ServerProcess

from .iperf import iperf3_gbps
from .rawpeer import RawClient

__all__ = ["Sweep", "congestion_control", "report", "sweep"]

KiB, MiB = 1 << 10, 1 << 20
CPU_PAGES = (1, 8)          # pages a call of the gets whose CPU per call is counted
CONNECTIONS = 8             # each side's, its large calls taken in turn (_Turns)
TURNS_FROM = 1 * MiB        # a call of this many bytes or more goes round them (_Turns)

T = TypeVar("T")


# Why each side's large gets and puts go round several connections: on the dev VM one
# loopback connection's large copies keep a speed of their own for as long as it lives.
# Eight raw clients of one connection each, the same code and the same 1 MiB get to the
# same raw peer on one CPU, took 147, 149, 169, 181-234, 250, 305 and 309-382 us a call
# (p50 of 300), each about the same from one round to the next; the raw peer's CPU for
# the send went with it (77-197 us), the client's less. The kernel copies a send into
# memory of the sending thread's own (its page fragments), and each connection is a
# thread of its own at the far end. With one connection a side, the raw client against
# itself (A against B, alternating blocks, 5 rounds of 1 MiB gets) read A/B 0.59
# (0.49-0.97 a round); going round 8 connections a side, 0.98 (0.97-0.98). So at 1 MiB a
# call a ratio of one connection against another says which was lucky; going round
# several says what the two ends cost (a server in Python pays for it too: each call
# wakes another of its threads, which waits for the interpreter's lock; docs/fastpath.md).
# Smaller calls stay on one connection a side: at 64 and 128 KiB a call the raw client
# against itself read 0.99-1.02 on one connection a side (at 512 KiB 1.00 in three runs of
# five, 0.70 and 1.25 in the others: docs/fastpath.md), and going round cost the heavier
# side its caches: our lookup of 16 keys took 5 us more, a get of one 64 KiB page 6-12
# us more and one of 8 pages 229-322 us against 166-176, each call meeting another
# connection's objects out of the CPU's caches. Lookups and leases are on one connection
# in a client too (its reads lane).
def congestion_control() -> str:
    """The TCP congestion control new connections get on this machine ("?" where it
    cannot be read). Why a report names it: on the dev VM it is bbr, whose state of its
    own in each connection (pacing, its bandwidth probes) is what made one loopback
    connection's large gets faster or slower than another's (_Turns above). With cubic
    the raw client against itself read 1.00 on one connection a side at 512 KiB and 1
    MiB a call; with reno (--congestion) a 1 MiB get took 191-214 us from the raw peer
    against about 310 under bbr, and 274-316 from ours against about 380."""
    try:
        with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
            return f.read().strip()
    except OSError:
        return "?"


class _Turns(Generic[T]):
    """Items taken in turn, one a call (next())."""

    def __init__(self, items: Sequence[T]) -> None:
        self.items = list(items)
        self.next = itertools.cycle(self.items).__next__


def _layout(page_bytes: int) -> PageLayout:
    """A bf16 layout of exactly page_bytes: 32 layers of 16 tokens, K and V."""
    per_layer_token = page_bytes // (32 * 16 * 2 * 2)      # heads x head_size
    return PageLayout(model=f"sweep-{page_bytes // KiB}k", num_layers=32, page_tokens=16,
                      num_kv_heads=max(1, per_layer_token // 64),
                      head_size=min(64, per_layer_token))


@dataclasses.dataclass(frozen=True, slots=True)
class Sweep:
    """What one run measures. target_bytes: each pattern repeats until about this many
    bytes moved (at least min_calls calls, at most max_calls)."""

    page_sizes: tuple[int, ...] = (64 * KiB, 1 * MiB, 4 * MiB)
    pages_a_call: tuple[int, ...] = (1, 8, 32, 128)
    rounds: int = 3
    target_bytes: int = 48 * MiB
    min_calls: int = 3
    max_calls: int = 400
    small_calls: int = 400          # lookups and lease round trips a round
    one_cpu: bool = False           # both ends on one CPU (_pinned says why)
    connections: int = CONNECTIONS  # each side's large calls go round these (_Turns)
    # The TCP congestion control both ends' answers are sent under: the server's
    # --data-congestion and the raw peer's; "" = the host's (congestion_control says why)
    congestion: str = ""

    @staticmethod
    def quick() -> Sweep:
        return Sweep(page_sizes=(64 * KiB, 1 * MiB), pages_a_call=(1, 8), rounds=3,
                     target_bytes=2 * MiB, max_calls=40, small_calls=40)

    def calls(self, call_bytes: int) -> int:
        return max(self.min_calls, min(self.max_calls, -(-self.target_bytes // call_bytes)))


def _times(fn: Callable[[], object], calls: int) -> list[float]:
    fn()                                      # warm: the first call of a pattern is not it
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _cpu_s(pid: int) -> float:
    """Seconds process pid's threads have run on a CPU (schedstat counts nanoseconds;
    /proc/PID/stat's ticks of 10 ms are too coarse for a few hundred calls)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):    # a thread that just ended
            pass
    return total / 1e9


HAS_SCHEDSTAT = os.path.exists("/proc/self/schedstat")

# A call that times itself (a put times its put, not the delete after it).
Timed = Callable[[], float]


def _timed(fn: Callable[[], object]) -> Timed:
    def call() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return call


# Each pattern runs the raw peer and the fast path in alternating blocks, BLOCKS a side,
# not one block each. Why: on the dev VM the same raw round trip of 16 bytes took a
# median of 18-26 us in one half-second and 60-80 us in the next (as the scheduler moved
# its two ends between one CPU and two: _pinned), and a swing between the two blocks of
# a pattern moved its ratio by up to 3x. Alternating blocks put both sides in the same
# stretches of time.
BLOCKS = 4
WARM_S = 0.3                # of raw round trips before a round's small calls (_round)


@dataclasses.dataclass(slots=True)
class Side:
    """One side of a pattern: its calls' times, and the CPU they cost (seconds, summed
    over its blocks) the far end (server or raw peer) and this process (the client)."""

    times: list[float] = dataclasses.field(default_factory=list)
    far_cpu: float = 0.0
    client_cpu: float = 0.0

    def p50(self) -> float:
        return statistics.median(self.times)

    def cpu_a_call(self) -> tuple[float, float]:
        return self.far_cpu / len(self.times), self.client_cpu / len(self.times)


def _block(fn: Timed, calls: int, side: Side, pid: int | None) -> None:
    fn()                          # warm: the first call after the other side's is not it
    if pid is not None:
        far, client = _cpu_s(pid), time.process_time()
    side.times += [fn() for _ in range(calls)]
    if pid is not None:
        side.far_cpu += _cpu_s(pid) - far
        side.client_cpu += time.process_time() - client


def _paired(raw: Timed, fast: Timed, calls: int, pids: tuple[int, int] | None = None
            ) -> tuple[Side, Side]:
    """calls of each side, in BLOCKS alternating blocks (see above); pids (the server's,
    the raw peer's): also count the CPU a call costs each end, where schedstat is."""
    per = max(1, -(-calls // BLOCKS))
    server, peer = pids if pids is not None and HAS_SCHEDSTAT else (None, None)
    r, f = Side(), Side()
    for _ in range(BLOCKS):
        _block(raw, per, r, peer)
        _block(fast, per, f, server)
    return r, f


class _RawPeer:
    """bench/rawpeer.py in a process of its own, as the server is (or another peer module
    of this package that prints its port once listening: bench/floorpeer.py)."""

    def __init__(self, module: str = "rawpeer", arg: str = "0", congestion: str = "") -> None:
        """congestion: rawpeer's TCP congestion control ("" = the host's)."""
        self.proc = subprocess.Popen([sys.executable, "-m", f"kvstore_bench.{module}",
                                      "127.0.0.1", arg, *([congestion] if congestion else [])],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _round(cs: _Turns[KVStoreClient], raws: _Turns[RawClient], spec: Sweep, out: np.ndarray,
           src: np.ndarray, r: int, pids: tuple[int, int]) -> dict[str, float]:
    """One round: every pattern, raw peer and fast path in alternating blocks (_paired),
    each side's calls of TURNS_FROM bytes or more going round its connections (cs, raws),
    smaller ones on the first of them. Keys name what stored pages a get reads; a put
    writes fresh keys each call (deleted after it, untimed), so the server stores each
    page instead of skipping it. pids: the server's and the raw peer's processes, whose
    CPU a get of 1 or 8 pages is counted in."""
    fig: dict[str, float] = {}
    # Round trips of a few bytes first, before the round's large transfers, and after
    # WARM_S of the raw peer's own. Why: where the scheduler puts the two ends decides a
    # small call's time on the dev VM (_pinned); after large transfers they ran on two
    # CPUs, and the raw peer's 16 bytes took 60-80 us for the first thousand or so round
    # trips, until the scheduler had put its two ends on one CPU (18-26 us). Without the
    # warm-up a small call's ratio moved with its pattern's place in the round.
    # A lookup's answer is 16 bytes, the raw peer's too.
    one, raw_one = cs.items[0], raws.items[0]       # the smaller calls' (_Turns says why)
    small = one.register_layout(_layout(64 * KiB))
    keys16 = [f"s{64 * KiB}-{i}".encode().ljust(16, b".") for i in range(16)]
    sixteen = memoryview(bytearray(16))
    raw_rtt = _timed(lambda: raw_one.get(sixteen))
    end = time.perf_counter() + WARM_S
    while time.perf_counter() < end:
        raw_rtt()

    def lease_release() -> None:
        one.release_lease(one.lookup_lease(small, keys16, 10_000))

    def lease_release_later() -> None:
        # The release rides ahead of the next call (KVStoreClient.release_lease_later).
        one.release_lease_later(one.lookup_lease(small, keys16, 10_000))

    for key, fn in (("lookup16", lambda: one.lookup(small, keys16)),
                    ("lease+release", lease_release),
                    ("lease+release later", lease_release_later)):
        t_raw, t_fast = _paired(raw_rtt, _timed(fn), spec.small_calls)
        fig[f"{key} raw us"] = t_raw.p50() * 1e6
        fig[f"{key} fast us"] = t_fast.p50() * 1e6
    for page in spec.page_sizes:
        ns = one.register_layout(_layout(page))
        assert ns.page_bytes == page, (ns.page_bytes, page)
        stored = [f"s{page}-{i}".encode().ljust(16, b".") for i in range(max(spec.pages_a_call))]
        for n in spec.pages_a_call:
            nbytes = n * page
            calls = spec.calls(nbytes)
            dst = out.reshape(-1)[:nbytes].reshape(n, page)
            flat = memoryview(dst.reshape(-1))
            data = src.reshape(-1)[:nbytes].reshape(n, page)
            tag = f"{page // KiB}k x{n}"
            c, raw = ((cs.next, raws.next) if nbytes >= TURNS_FROM
                      else ((lambda: one), (lambda: raw_one)))
            t_raw, t_fast = _paired(_timed(lambda: raw().get(flat)),
                                    _timed(lambda: c().get_into(ns, stored[:n], dst)), calls,
                                    pids if n in CPU_PAGES else None)
            if n in CPU_PAGES and HAS_SCHEDSTAT:
                fig[f"get {tag} raw srv cpu"], fig[f"get {tag} raw cli cpu"] = \
                    t_raw.cpu_a_call()
                fig[f"get {tag} fast srv cpu"], fig[f"get {tag} fast cli cpu"] = \
                    t_fast.cpu_a_call()
            fig[f"get {tag} raw"] = nbytes / t_raw.p50() / 1e9
            fig[f"get {tag} fast"] = nbytes / t_fast.p50() / 1e9
            if n == 1:
                fig[f"get {tag} raw us"] = t_raw.p50() * 1e6
                fig[f"get {tag} fast us"] = t_fast.p50() * 1e6
            seq = iter(range(1 << 30))

            # 16-byte keys, as the connector's (chained xxh3-128 hashes), in the index the
            # gets' keys are in: the store keeps an index per key size, and 32-byte keys
            # took its general path: a reserve and commit of 8 cost about 7 µs more in one
            # process than with 16-byte keys (their delete 3 more).
            def put_fresh() -> float:
                call = next(seq)
                keys = [xxhash.xxh3_128_digest(f"p{r}.{page}.{n}.{call}.{i}".encode())
                        for i in range(n)]
                client = c()
                t0 = time.perf_counter()
                client.put(ns, keys, data)
                took = time.perf_counter() - t0
                client.delete(ns, keys)
                return took

            t_raw, t_fast = _paired(_timed(lambda: raw().put(memoryview(data.reshape(-1)))),
                                    put_fresh, calls)
            fig[f"put {tag} raw"] = nbytes / t_raw.p50() / 1e9
            fig[f"put {tag} fast"] = nbytes / t_fast.p50() / 1e9
    return fig


# `--one-cpu`: the server, the raw peer and this process on one CPU, every thread. Why:
# on the dev VM a round trip whose two ends ran on one CPU took 17-18 us (the raw peer's
# 16 bytes), and 57-92 us where they ran on two, as a woken virtual CPU is slow to start;
# free, the scheduler moves the two ends between those from one second to the next (two
# CPUs after large transfers, one after a thousand small round trips), and a small
# call's ratio with them. On one CPU a call costs what both ends' work adds up to, as on
# hosts whose wake-ups are cheap; large transfers then share the CPU's copies.
@contextlib.contextmanager
def _pinned(pids: tuple[int, ...]) -> Iterator[None]:
    """Every thread of pids and of this process on this process's first allowed CPU, for
    the block; this process's threads get their CPUs back after it."""
    mine = os.sched_getaffinity(0)
    cpu = {min(mine)}
    for pid in (*pids, os.getpid()):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(int(task), cpu)
    try:
        yield
    finally:
        for task in os.listdir("/proc/self/task"):
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(int(task), mine)


def sweep(spec: Sweep) -> list[dict[str, float]]:
    """Rounds of every pattern, one server and one raw peer for all of them."""
    biggest = max(spec.page_sizes) * max(spec.pages_a_call)
    stored = sum(spec.page_sizes) * max(spec.pages_a_call)
    dram = -(-(stored + 2 * biggest + 256 * MiB) // (256 * MiB)) * 256
    out = page_aligned_empty((biggest,))
    src = np.random.default_rng(7).integers(0, 256, biggest, dtype=np.uint8)
    peer = _RawPeer(congestion=spec.congestion)
    figures = []
    extra = {"data_congestion": spec.congestion} if spec.congestion else {}
    try:
        with ServerProcess(dram=f"{dram}MiB", **extra).start(wait=300) as srv, \
                contextlib.ExitStack() as stack:
            cs = _Turns([stack.enter_context(
                KVStoreClient(srv.address, timeout=120, shared_memory=False, data_plane=True,
                              data_connections=1)) for _ in range(spec.connections)])
            raws = _Turns([RawClient("127.0.0.1", peer.port) for _ in range(spec.connections)])
            for raw in raws.items:
                stack.callback(raw.close)
            c = cs.items[0]
            for page in spec.page_sizes:
                ns = c.register_layout(_layout(page))
                n = max(spec.pages_a_call)
                keys = [f"s{page}-{i}".encode().ljust(16, b".") for i in range(n)]
                pages = src.reshape(-1)[:n * page].reshape(n, page)
                c.put(ns, keys, pages)
                check = page_aligned_empty((n, page))
                for client in cs.items:            # every connection reads them back whole
                    check[:] = 0
                    client.get_into(ns, keys, check)
                    if not np.array_equal(check, pages):
                        raise SystemExit(f"{page} B pages came back different")
            pids = (srv.proc.pid, peer.proc.pid)
            with _pinned(pids) if spec.one_cpu else contextlib.nullcontext():
                for r in range(spec.rounds):
                    figures.append(_round(cs, raws, spec, out, src, r, pids))
    finally:
        peer.close()
    return figures


def _med(rounds: list[dict[str, float]], key: str) -> float:
    return statistics.median(f[key] for f in rounds)


def _ratio(rounds: list[dict[str, float]], num: str, den: str) -> float:
    """The median over rounds of a ratio taken within each round."""
    return statistics.median(f[num] / f[den] for f in rounds)


def report(spec: Sweep, rounds: list[dict[str, float]], iperf: float | None) -> str:
    lines = [f"medians of {len(rounds)} rounds; raw = bench/rawpeer.py, a plain TCP peer in "
             "its own process, same run, same call pattern and buffers; gets and puts of "
             f"{TURNS_FROM // MiB} MiB or more go round {spec.connections} connections a "
             "side, one call each in turn, smaller calls on one; "
             + (f"TCP congestion control {spec.congestion} at both ends (--congestion); "
                if spec.congestion else f"TCP congestion control {congestion_control()}; ")
             + "ratio = fast / raw within a round, then the median; "
             + ("every thread of both ends on one CPU (--one-cpu)" if spec.one_cpu else
                "threads where the scheduler puts them"), "",
             "| page | pages a call | get fast GB/s | get raw GB/s | get fast/raw | "
             "put fast GB/s | put raw GB/s | put fast/raw |",
             "|---|---|---|---|---|---|---|---|"]
    for page in spec.page_sizes:
        for n in spec.pages_a_call:
            tag = f"{page // KiB}k x{n}"
            size = f"{page // MiB} MiB" if page >= MiB else f"{page // KiB} KiB"
            lines.append(
                f"| {size} | {n} | {_med(rounds, f'get {tag} fast'):.2f} | "
                f"{_med(rounds, f'get {tag} raw'):.2f} | "
                f"{_ratio(rounds, f'get {tag} fast', f'get {tag} raw'):.2f} | "
                f"{_med(rounds, f'put {tag} fast'):.2f} | "
                f"{_med(rounds, f'put {tag} raw'):.2f} | "
                f"{_ratio(rounds, f'put {tag} fast', f'put {tag} raw'):.2f} |")
    lines += ["", "| one call | fast p50 us | raw p50 us | fast / raw |", "|---|---|---|---|"]
    for page in spec.page_sizes:
        tag = f"{page // KiB}k x1"
        size = f"{page // MiB} MiB" if page >= MiB else f"{page // KiB} KiB"
        lines.append(f"| get of one {size} page | {_med(rounds, f'get {tag} fast us'):.0f} | "
                     f"{_med(rounds, f'get {tag} raw us'):.0f} | "
                     f"{_ratio(rounds, f'get {tag} fast us', f'get {tag} raw us'):.2f} |")
    for key, label in (("lookup16 fast us", "lookup of 16 keys"),
                       ("lease+release fast us", "leased lookup of 16 keys + release"),
                       ("lease+release later fast us",
                        "leased lookup of 16 keys + release not waited for")):
        raw_key = key.replace(" fast ", " raw ")
        lines.append(f"| {label} | {_med(rounds, key):.0f} | {_med(rounds, raw_key):.0f} | "
                     f"{_ratio(rounds, key, raw_key):.2f} |")
    cpu = [(page, n) for page in spec.page_sizes for n in spec.pages_a_call
           if n in CPU_PAGES and f"get {page // KiB}k x{n} fast srv cpu" in rounds[0]]
    if HAS_SCHEDSTAT and cpu:
        lines += ["", "| get, CPU a call in us | fast: server | fast: client | raw: peer | "
                  "raw: client | fast / raw, both ends |", "|---|---|---|---|---|---|"]
        for page, n in cpu:
            tag = f"get {page // KiB}k x{n}"
            size = f"{page // MiB} MiB" if page >= MiB else f"{page // KiB} KiB"
            ends = [_med(rounds, f"{tag} {who} cpu") * 1e6
                    for who in ("fast srv", "fast cli", "raw srv", "raw cli")]
            both = statistics.median(
                (f[f"{tag} fast srv cpu"] + f[f"{tag} fast cli cpu"])
                / max(f[f"{tag} raw srv cpu"] + f[f"{tag} raw cli cpu"], 1e-9)
                for f in rounds)
            lines.append(f"| {n} x {size} | " + " | ".join(f"{v:.0f}" for v in ends)
                         + f" | {both:.2f} |")
    lines += ["", ("iperf3, one loopback stream (the wire's ceiling): "
                   f"{iperf:.2f} GB/s" if iperf is not None else
                   "iperf3: not installed, no ceiling measured")]
    return "\n".join(lines)


def main_sweep(quick: bool, rounds: int, one_cpu: bool = False, connections: int = 0,
               congestion: str = "") -> str:
    spec = Sweep.quick() if quick else Sweep()
    spec = dataclasses.replace(spec, rounds=rounds or spec.rounds, one_cpu=one_cpu,
                               connections=connections or spec.connections,
                               congestion=congestion)
    return report(spec, sweep(spec), iperf3_gbps())
