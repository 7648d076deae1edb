"""Two checkouts of the client side by side: what a client change saves a call.

`kvstore-bench fastpath --client-ab DIR` loads the `kvstore_client` package of another
checkout (DIR holds it: `git archive main | tar -x -C DIR` makes one) beside this one's,
in one process, and drives both against one server over TCP (shared_memory=False, one
connection each, as the sweep does): the patterns of a remote engine, in blocks of calls,
the two clients alternated block by block (which goes first alternates too). The server,
the keys and the buffers are the same for both, so what differs is the client's code.

On a shared machine the round trip of a small call moves by tens of percent from one
minute to the next, far more than a client's own share of it; two sweeps run one after
the other cannot show that share. Alternated blocks can: each ratio is taken between
neighbouring blocks, and the report gives its median and how many blocks each side won,
with the client's own CPU a call (this thread's, CPU seconds the kernel counts). The raw
TCP peer (bench/rawpeer.py) gives the floor.

The other checkout's client must import as a package of its own: it may import this
checkout's kvstore_protocol, but not kvstore_client by its absolute name.

The two places are not quite alike: with this checkout against itself (an A/A run, 40
blocks), the client loaded as this one's spent 1-8 us less CPU a call than the same
code loaded from DIR, and the waited leased lookup's ratio came out 1.25. So run it
both ways round, and believe what wins in both: the other checkout as this one's by
PYTHONPATH=OTHER:$PYTHONPATH (kvstore-bench finds kvstore_client there first), with
DIR this checkout.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import os
import statistics
import sys
import time
import types
from collections.abc import Callable

import numpy as np

import kvstore_client
from kvstore_client.buffers import page_aligned_empty
from kvstore_testing.serverproc import ServerProcess

from .fastpath_sweep import _layout, _RawPeer
from .rawpeer import RawClient

__all__ = ["ClientAB", "client_ab", "load_client"]

KiB, MiB = 1 << 10, 1 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class ClientAB:
    """blocks: of each pattern, for each client; calls: a block's calls."""

    blocks: int = 20
    calls: int = 200

    @staticmethod
    def quick() -> ClientAB:
        return ClientAB(blocks=2, calls=10)


def load_client(folder: str) -> types.ModuleType:
    """The kvstore_client package in folder (a checkout, or its kvstore_client folder),
    imported under a name of its own."""
    pkg = folder if os.path.basename(os.path.normpath(folder)) == "kvstore_client" else \
        os.path.join(folder, "kvstore_client")
    init = os.path.join(pkg, "__init__.py")
    if not os.path.exists(init):
        raise SystemExit(f"no kvstore_client package in {folder}")
    name = "kvstore_client_other"
    spec = importlib.util.spec_from_file_location(name, init,
                                                  submodule_search_locations=[pkg])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class _TimedItself:
    """A pattern that returns its own time: a Put, whose untimed Delete makes room for
    the next."""

    def __init__(self, fn: Callable[[], float]) -> None:
        self.fn = fn

    def __call__(self) -> float:
        return self.fn()


def _patterns(c, src: np.ndarray, tag: str) -> dict[str, Callable[[], object]]:
    """What a remote engine calls, on client c."""
    n64 = c.register_layout(_layout(64 * KiB))
    n1m = c.register_layout(_layout(MiB))
    keys = [f"ab-{i}".encode().ljust(16, b".") for i in range(16)]
    c.put(n64, keys, src.reshape(-1)[:16 * 64 * KiB].reshape(16, 64 * KiB))
    c.put(n1m, keys[:1], src.reshape(-1)[:MiB].reshape(1, MiB))
    d64, d1m = page_aligned_empty((8, 64 * KiB)), page_aligned_empty((1, MiB))
    page = src.reshape(-1)[:64 * KiB].reshape(1, 64 * KiB)
    seq = itertools.count()

    def put_fresh() -> float:
        fresh = [f"ab-{tag}-{next(seq)}".encode().ljust(32, b".")]
        t0 = time.perf_counter()
        c.put(n64, fresh, page)
        took = time.perf_counter() - t0
        c.delete(n64, fresh)
        return took

    return {
        "get 64 KiB x1": lambda: c.get_into(n64, keys[:1], d64[:1]),
        "get 64 KiB x8": lambda: c.get_into(n64, keys[:8], d64),
        "get 1 MiB x1": lambda: c.get_into(n1m, keys[:1], d1m),
        "put 64 KiB x1": _TimedItself(put_fresh),
        "lookup of 16 keys": lambda: c.lookup(n64, keys),
        "leased lookup + release": lambda: c.release_lease(c.lookup_lease(n64, keys, 10_000)),
        "leased lookup + release later": lambda: c.release_lease_later(
            c.lookup_lease(n64, keys, 10_000)),
    }


def _block(fn: Callable[[], object], calls: int) -> tuple[float, float]:
    """(p50 seconds, this thread's CPU seconds a call) of calls calls, after one warm."""
    fn()
    times = []
    cpu = time.thread_time()
    if isinstance(fn, _TimedItself):
        times = [fn() for _ in range(calls)]
    else:
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times), (time.thread_time() - cpu) / calls


def client_ab(folder: str, spec: ClientAB) -> str:
    """This checkout's client against folder's, alternated blocks, one server."""
    other = load_client(folder)
    src = np.random.default_rng(3).integers(0, 256, 16 * 64 * KiB, dtype=np.uint8)
    peer = _RawPeer()
    got: dict[tuple[str, str], list[tuple[float, float]]] = {}
    try:
        with ServerProcess(dram="512MiB").start(wait=300) as srv:
            raw = RawClient("127.0.0.1", peer.port)
            try:
                out64 = memoryview(page_aligned_empty((64 * KiB,)))
                out16 = memoryview(bytearray(16))
                floors = {"raw get 64 KiB": lambda: raw.get(out64),
                          "raw round trip, 16 bytes": lambda: raw.get(out16)}
                for b in range(spec.blocks):
                    # Fresh clients each block, so fresh connections and server threads:
                    # a connection whose server thread the scheduler keeps on the other
                    # core (or on the same one) is faster or slower by itself, by more
                    # than a client change saves; two identical clients kept on their
                    # connections differed by 5-8% in the median ratio.
                    clients = {who: mod.KVStoreClient(
                        srv.address, timeout=120, shared_memory=False, data_plane=True,
                        data_connections=1)
                        for who, mod in (("this", kvstore_client), ("other", other))}
                    try:
                        pats = {who: _patterns(c, src, f"{who}{b}")
                                for who, c in clients.items()}
                        order = ("this", "other") if b % 2 else ("other", "this")
                        for name in pats["this"]:
                            for who in order:
                                got.setdefault((name, who), []).append(
                                    _block(pats[who][name], spec.calls))
                    finally:
                        for c in clients.values():
                            c.close()
                    for name, fn in floors.items():
                        got.setdefault((name, "raw"), []).append(_block(fn, spec.calls))
            finally:
                raw.close()
    finally:
        peer.close()
    names = list(dict.fromkeys(name for name, who in got if who == "this"))
    return _report(spec, folder, names, list(floors), got)


def _report(spec: ClientAB, folder: str, names: list[str], floors: list[str],
            got: dict[tuple[str, str], list[tuple[float, float]]]) -> str:
    lines = [f"this checkout's client against {folder}'s: {spec.blocks} blocks of "
             f"{spec.calls} calls a pattern, the two alternated; one server, one connection "
             "each; ratio = this / other between neighbouring blocks, then the median; a "
             "put's CPU counts the delete after it", "",
             "| pattern | this p50 us | other p50 us | this / other | blocks this won | "
             "this: client CPU us a call | other: client CPU us a call |",
             "|---|---|---|---|---|---|---|"]
    for name in names:
        this, other = got[(name, "this")], got[(name, "other")]
        ratios = [a[0] / b[0] for a, b in zip(this, other, strict=True)]
        lines.append(
            f"| {name} | {statistics.median(t for t, _ in this) * 1e6:.0f} | "
            f"{statistics.median(t for t, _ in other) * 1e6:.0f} | "
            f"{statistics.median(ratios):.2f} | {sum(r < 1 for r in ratios)}/{len(ratios)} | "
            f"{statistics.median(c for _, c in this) * 1e6:.1f} | "
            f"{statistics.median(c for _, c in other) * 1e6:.1f} |")
    lines += ["", "| floor | p50 us | client CPU us a call |", "|---|---|---|"]
    for name in floors:
        rows = got[(name, "raw")]
        lines.append(f"| {name} | {statistics.median(t for t, _ in rows) * 1e6:.0f} | "
                     f"{statistics.median(c for _, c in rows) * 1e6:.1f} |")
    return "\n".join(lines)
