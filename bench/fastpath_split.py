"""Where a fast-path call's CPU goes, Python or kernel, at each end: `kvstore-bench fastpath --split`.

The sweep (bench/fastpath_sweep.py) counts the CPU each end spends a call, not on what.
Here the calls an engine makes most (a get of 1 and of 8 pages of 64 KiB, a lookup of
16 keys) run against the server and against the raw peer (bench/rawpeer.py), each long
enough that the kernel's clock ticks (10 ms each, /proc/PID/stat) split it into user time
(for these processes: the Python interpreter and what it calls) and system time (the
sockets, copies and wake-ups) to within a few percent:

- the far end: the server's or the raw peer's process, all its threads;
- the client: this process (os.times), all its threads.

The raw peer does the least a call can (read a 9-byte request, send the bytes), so its
user time is about the interpreter's floor a call, and the kernel's part is what the same
bytes cost the kernel over loopback. Each pattern runs the two sides in alternating
blocks (the sweep says why) for `seconds` a side a round; figures are medians over rounds.
With `--one-cpu` every thread of both ends runs on one CPU (the sweep's `_pinned` says
why): on the dev VM the same calls then cost both ends about half to two thirds of the
CPU they cost with the ends on two CPUs, user time included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import time
from collections.abc import Callable

import numpy as np

from kvstore_client import KVStoreClient
from kvstore_client.buffers import page_aligned_empty
from kvstore_testing.serverproc import ServerProcess

from .fastpath_sweep import BLOCKS, _layout, _pinned, _RawPeer
from .rawpeer import RawClient

__all__ = ["Split", "split", "split_report"]

KiB = 1 << 10
_TICK = os.sysconf("SC_CLK_TCK")


@dataclasses.dataclass(frozen=True, slots=True)
class Split:
    """rounds: medians over this many; seconds: of calls a side a round."""

    rounds: int = 3
    seconds: float = 1.5
    one_cpu: bool = False      # every thread of both ends on one CPU (fastpath_sweep._pinned)

    @staticmethod
    def quick() -> Split:
        return Split(rounds=1, seconds=0.3)


def _ticks(pid: int) -> tuple[int, int]:
    """Process pid's user and system clock ticks, all its threads (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]), int(fields[12])


@dataclasses.dataclass(slots=True)
class _Count:
    calls: int = 0
    far_user: int = 0          # ticks
    far_sys: int = 0
    client_user: float = 0.0   # seconds
    client_sys: float = 0.0

    def per_call_us(self) -> tuple[float, float, float, float]:
        """(far user, far system, client user, client system), us a call."""
        n = max(self.calls, 1)
        return (self.far_user / _TICK / n * 1e6, self.far_sys / _TICK / n * 1e6,
                self.client_user / n * 1e6, self.client_sys / n * 1e6)


def _block(fn: Callable[[], object], pid: int, seconds: float, count: _Count) -> None:
    fn()                                     # warm, outside the count
    far, mine = _ticks(pid), os.times()
    end = time.perf_counter() + seconds
    calls = 0
    while time.perf_counter() < end:
        for _ in range(16):
            fn()
        calls += 16
    far2, mine2 = _ticks(pid), os.times()
    count.calls += calls
    count.far_user += far2[0] - far[0]
    count.far_sys += far2[1] - far[1]
    count.client_user += mine2.user - mine.user
    count.client_sys += mine2.system - mine.system


def split(spec: Split) -> list[dict[str, tuple[float, float, float, float]]]:
    """Per round: pattern name -> (far user, far sys, client user, client sys) us a call,
    for 'raw <pattern>' and 'fast <pattern>'."""
    page = 64 * KiB
    peer = _RawPeer()
    rounds = []
    try:
        with ServerProcess(dram="512MiB").start(wait=300) as srv, \
                KVStoreClient(srv.address, timeout=120, shared_memory=False, data_plane=True,
                              data_connections=1) as c:
            raw = RawClient("127.0.0.1", peer.port)
            ns = c.register_layout(_layout(page))
            keys = [f"s{i}".encode().ljust(16, b".") for i in range(16)]
            c.put(ns, keys, np.random.default_rng(7).integers(0, 256, (16, page),
                                                              dtype=np.uint8))
            out = page_aligned_empty((8, page))
            one, eight = out[:1], out
            sixteen = memoryview(bytearray(16))
            patterns: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
                "get 1 x 64 KiB": (lambda: raw.get(memoryview(one.reshape(-1))),
                                   lambda: c.get_into(ns, keys[:1], one)),
                "get 8 x 64 KiB": (lambda: raw.get(memoryview(eight.reshape(-1))),
                                   lambda: c.get_into(ns, keys[:8], eight)),
                "lookup of 16 keys": (lambda: raw.get(sixteen), lambda: c.lookup(ns, keys)),
            }
            pids = (srv.proc.pid, peer.proc.pid)
            with _pinned(pids) if spec.one_cpu else contextlib.nullcontext():
                for _ in range(spec.rounds):
                    fig = {}
                    for name, (raw_fn, fast_fn) in patterns.items():
                        r, f = _Count(), _Count()
                        for _ in range(BLOCKS):
                            _block(raw_fn, peer.proc.pid, spec.seconds / BLOCKS, r)
                            _block(fast_fn, srv.proc.pid, spec.seconds / BLOCKS, f)
                        fig[f"raw {name}"] = r.per_call_us()
                        fig[f"fast {name}"] = f.per_call_us()
                    rounds.append(fig)
            raw.close()
    finally:
        peer.close()
    return rounds


def split_report(spec: Split, rounds: list[dict[str, tuple[float, float, float, float]]]
                 ) -> str:
    lines = [f"medians of {len(rounds)} rounds of {spec.seconds:g} s a side; us of CPU a "
             "call, user (Python) and system (kernel) time, from /proc/PID/stat ticks; "
             "far end = the server or the raw peer (bench/rawpeer.py), client = this "
             "process; " + ("every thread of both ends on one CPU (--one-cpu)" if spec.one_cpu
                            else "threads where the scheduler puts them"), "",
             "| call | end | raw user | raw system | fast user | fast system | "
             "fast - raw, user | fast - raw, system |",
             "|---|---|---|---|---|---|---|---|"]

    def med(key: str, i: int) -> float:
        return statistics.median(f[key][i] for f in rounds)

    for name in (k[len("raw "):] for k in rounds[0] if k.startswith("raw ")):
        for end, base in (("far end", 0), ("client", 2)):
            ru, rs = med(f"raw {name}", base), med(f"raw {name}", base + 1)
            fu, fs = med(f"fast {name}", base), med(f"fast {name}", base + 1)
            lines.append(f"| {name} | {end} | {ru:.1f} | {rs:.1f} | {fu:.1f} | {fs:.1f} | "
                         f"{fu - ru:+.1f} | {fs - rs:+.1f} |")
    return "\n".join(lines)


def main_split(quick: bool, rounds: int, one_cpu: bool = False) -> str:
    spec = Split.quick() if quick else Split()
    spec = dataclasses.replace(spec, rounds=rounds or spec.rounds, one_cpu=one_cpu)
    return split_report(spec, split(spec))
