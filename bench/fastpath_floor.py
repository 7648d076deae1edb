"""Which end a small fast-path call's time is spent at: `kvstore-bench fastpath --floor`.

The sweep (bench/fastpath_sweep.py) puts a call of our client and server beside a raw TCP
peer's; the split (bench/fastpath_split.py) says how much CPU each end spends, in ticks of
10 ms. Neither says how much of a call's time each end adds, which is what there is to cut.
Here two stand-ins of the same protocol take the place of one end at a time:

- the floor (bench/floorpeer.py): a server of the fast path's framing in the least Python it
  can be, with nothing looked up or checked;
- the lean client: a frame built once, one send and one receive (two for a get's rest), the
  least a client of the protocol can do.

Each pattern (a lookup of 16 keys; a get of 1 and of 8 pages of 64 KiB, what an engine
calls per layer) runs, in alternating blocks, p50 of each:

    raw      the raw peer (bench/rawpeer.py): the same bytes with no protocol
    floor    lean client -> floor: the protocol's own cost, both ends at their least
    client   our client (FastPath) -> floor: what our client library adds
    server   lean client -> our server: what our server adds
    both     our client (FastPath) -> our server
    store    KVStoreClient -> our server: the call an engine makes

So `client - floor` is our client's part, `server - floor` our server's, and `both - floor`
minus those two is what the two cost each other: with both ends on one CPU (--one-cpu, as
the sweep; its `_pinned` says why) the code and data of one end's call are evicted by the
other's, and a larger end makes the other slower.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import statistics
import time
from collections.abc import Callable

import numpy as np

from kvstore_client import KVStoreClient
from kvstore_client.buffers import page_aligned_empty
from kvstore_client.fastpath import FastPath
from kvstore_protocol import fastwire as fw
from kvstore_testing.serverproc import ServerProcess

from .fastpath_sweep import _layout, _pinned, _RawPeer
from .rawpeer import RawClient, connect

__all__ = ["Floor", "floor", "floor_report", "main_floor"]

KiB = 1 << 10
PAGE = 64 * KiB
SIDES = ("raw", "floor", "client", "server", "both", "store")


@dataclasses.dataclass(frozen=True, slots=True)
class Floor:
    """rounds: medians over this many; calls: of each side a round, in _BLOCKS blocks."""

    rounds: int = 5
    calls: int = 800
    one_cpu: bool = False

    @staticmethod
    def quick() -> Floor:
        return Floor(rounds=1, calls=40)


def _floor_peer(page_bytes: int) -> _RawPeer:
    """bench/floorpeer.py in a process of its own."""
    return _RawPeer("floorpeer", str(page_bytes))


class _Lean:
    """The least a client of the protocol does: frames built once, one send a call, the
    answer received straight into the caller's buffer."""

    def __init__(self, port: int) -> None:
        self.sock = connect("127.0.0.1", port)
        self.sock.sendall(fw.encode_header(fw.Op.HELLO, 0, flags=fw.QUIET | fw.ALIGNED))
        head = self.sock.recv(4096)
        if fw.decode_header(head[:fw.HEADER.size], request=False).flags & fw.ALIGNED == 0:
            raise RuntimeError("the server did not grant aligned answers")
        self._pre = memoryview(bytearray(fw.HEADER.size + fw.ALIGN_PAD))
        self._answer = memoryview(bytearray(4096))

    def lookup(self, layout_id: bytes, keys: bytes) -> Callable[[], int]:
        body = fw.ONE_LAYOUT_LOOKUP.pack(0, 1, layout_id, 16, len(keys) // 16) + keys
        frame = fw.encode_header(fw.Op.LOOKUP, len(body)) + body
        want = fw.HEADER.size + fw.COUNT_LEASE.size
        sock, answer = self.sock, self._answer

        def call() -> int:
            sock.sendall(frame)
            got = sock.recv_into(answer)
            while got < want:
                got += sock.recv_into(answer[got:])
            return fw.COUNT_LEASE.unpack_from(answer, fw.HEADER.size)[0]
        return call

    def get(self, layout_id: bytes, keys: bytes, out: memoryview) -> Callable[[], None]:
        body = fw.LAYOUT_KEYS_HEAD.pack(layout_id, 16, len(keys) // 16) + keys
        frame = fw.encode_header(fw.Op.GET, len(body), flags=fw.PAGE_MAJOR) + body
        sock, pre = self.sock, self._pre
        whole = len(pre) + out.nbytes

        def call() -> None:
            sock.sendall(frame)
            got = sock.recvmsg_into([pre, out])[0]
            if got < len(pre):
                raise RuntimeError("a GET answer's header came in pieces")
            while got < whole:
                got += sock.recv_into(out[got - len(pre):], whole - got, socket.MSG_WAITALL)
        return call

    def close(self) -> None:
        self.sock.close()


def floor(spec: Floor) -> list[dict[str, dict[str, float]]]:
    """Per round: pattern -> side -> p50 seconds."""
    peer, floor_peer = _RawPeer(), _floor_peer(PAGE)
    closers: list[Callable[[], object]] = [peer.close, floor_peer.close]
    rounds = []
    try:
        srv = ServerProcess(dram="512MiB").start(wait=300)
        closers.append(srv.stop)
        c = KVStoreClient(srv.address, timeout=120, shared_memory=False, data_plane=True,
                          data_connections=1)
        closers.append(c.close)
        ns = c.register_layout(_layout(PAGE))
        keys = [f"f{i}".encode().ljust(16, b".") for i in range(16)]
        c.put(ns, keys, np.random.default_rng(7).integers(0, 256, (16, PAGE), dtype=np.uint8))
        raw = RawClient("127.0.0.1", peer.port)
        closers.append(raw.close)
        fast = {}
        for name, port in (("floor", floor_peer.port), ("server", srv.port + 1)):
            fast[name] = FastPath(f"127.0.0.1:{port}", timeout=120)
            fast[name].check()
            closers.append(fast[name].close)
        lean = {"floor": _Lean(floor_peer.port), "server": _Lean(srv.port + 1)}
        closers += [lean["floor"].close, lean["server"].close]
        out = page_aligned_empty((8, PAGE))
        sixteen = memoryview(bytearray(16))
        packed = b"".join(keys)
        lid = ns.layout_id
        patterns: dict[str, dict[str, Callable[[], object]]] = {
            "lookup of 16 keys": {"raw": lambda: raw.get(sixteen)},
        }
        lookup = patterns["lookup of 16 keys"]
        for side, to in (("floor", "floor"), ("server", "server")):
            lookup[side] = lean[to].lookup(lid, packed)
        for side, to in (("client", "floor"), ("both", "server")):
            lookup[side] = (lambda f=fast[to]: f.lookup([lid], 16, packed))
        lookup["store"] = lambda: c.lookup(ns, keys)
        for n in (1, 8):
            dst = out[:n]
            view = dst.reshape(-1).data
            some = packed[:16 * n]
            get: dict[str, Callable[[], object]] = {"raw": lambda v=view: raw.get(v)}
            for side, to in (("floor", "floor"), ("server", "server")):
                get[side] = lean[to].get(lid, some, view)
            for side, to in (("client", "floor"), ("both", "server")):
                get[side] = (lambda f=fast[to], s=some, v=view:
                             f.get_into(lid, 16, s, v, PAGE))
            get["store"] = lambda d=dst, n=n: c.get_into(ns, keys[:n], d)
            patterns[f"get {n} x 64 KiB"] = get
        _check(patterns, out, np.asarray(c.get(ns, keys[:8])))
        pids = (srv.proc.pid, peer.proc.pid, floor_peer.proc.pid)
        with _pinned(pids) if spec.one_cpu else contextlib.nullcontext():
            for _ in range(spec.rounds):
                rounds.append({name: _sides(sides, spec.calls)
                               for name, sides in patterns.items()})
    finally:
        for close in reversed(closers):
            with contextlib.suppress(Exception):    # the rest still close
                close()
    return rounds


def _check(patterns: dict[str, dict[str, Callable[[], object]]], out: np.ndarray,
           stored: np.ndarray) -> None:
    """Every side does its call, before anything is timed: each lookup counts the 16
    keys, and each get fills its pages with what its server holds (the peers send ones,
    our server the pages stored)."""
    for name, sides in patterns.items():
        for side, fn in sides.items():
            if name.startswith("lookup"):
                got = fn()
                count = got[0] if isinstance(got, tuple) else got
                if side != "raw" and count != 16:
                    raise SystemExit(f"{name}, {side}: counted {count} of 16 keys")
                continue
            n = int(name.split()[1])
            out[:n] = 0
            fn()
            want = stored[:n] if side in ("server", "both", "store") else 1
            if not np.array_equal(out[:n], np.broadcast_to(want, out[:n].shape)):
                raise SystemExit(f"{name}, {side}: the pages came back different")


# Blocks a side a round, of calls // _BLOCKS calls each. More than the sweep's BLOCKS: on
# the dev VM a get of 8 pages of 64 KiB took 84 us a call for a second or two and 125 for
# the next, on every connection alike (bench/floorpeer.py's, six connections, one CPU),
# and with 4 blocks of 200 calls a side such a swing fell on some sides of a round and
# not others, moving a side's median by 50-100 us in one run of three.
_BLOCKS = 16


def _sides(sides: dict[str, Callable[[], object]], calls: int) -> dict[str, float]:
    """Each side's p50 over `calls` calls, the sides in _BLOCKS alternating blocks."""
    times: dict[str, list[float]] = {side: [] for side in sides}
    per = max(1, -(-calls // _BLOCKS))
    for fn in sides.values():
        fn()                                  # warm: the first call of a side is not it
    for _ in range(_BLOCKS):
        for side, fn in sides.items():
            got = times[side]
            for _ in range(per):
                t0 = time.perf_counter()
                fn()
                got.append(time.perf_counter() - t0)
    return {side: statistics.median(t) for side, t in times.items()}


def floor_report(spec: Floor, rounds: list[dict[str, dict[str, float]]]) -> str:
    lines = [f"medians of {len(rounds)} rounds of {spec.calls} calls a side (p50 us); "
             "floor = a lean client against a server of the same protocol with nothing "
             "behind it (bench/floorpeer.py); raw = bench/rawpeer.py; "
             + ("every thread of both ends on one CPU (--one-cpu)" if spec.one_cpu
                else "threads where the scheduler puts them"), "",
             "| call | raw | floor | our client -> floor | lean -> our server | "
             "our client -> our server | KVStoreClient -> our server |",
             "|---|---|---|---|---|---|---|"]
    parts = ["", "What each end adds to a call over the floor (us, p50s of the same round):",
             "", "| call | our client | our server | the two on each other | "
             "KVStoreClient's own | store / raw |", "|---|---|---|---|---|---|"]
    for name in rounds[0]:
        def med(side: str, name: str = name) -> float:
            return statistics.median(r[name][side] for r in rounds) * 1e6

        def part(fn: Callable[[dict[str, float]], float], name: str = name) -> float:
            return statistics.median(fn(r[name]) for r in rounds)

        lines.append(f"| {name} | " + " | ".join(f"{med(s):.1f}" for s in SIDES) + " |")
        client = part(lambda s: (s["client"] - s["floor"]) * 1e6)
        server = part(lambda s: (s["server"] - s["floor"]) * 1e6)
        each = part(lambda s: (s["both"] - s["client"] - s["server"] + s["floor"]) * 1e6)
        own = part(lambda s: (s["store"] - s["both"]) * 1e6)
        ratio = part(lambda s: s["store"] / s["raw"])
        parts.append(f"| {name} | {client:+.1f} | {server:+.1f} | {each:+.1f} | {own:+.1f} "
                     f"| {ratio:.2f} |")
    return "\n".join(lines + parts)


def main_floor(quick: bool, rounds: int, one_cpu: bool = False) -> str:
    spec = Floor.quick() if quick else Floor()
    spec = dataclasses.replace(spec, rounds=rounds or spec.rounds, one_cpu=one_cpu)
    return floor_report(spec, floor(spec))
