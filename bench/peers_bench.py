"""Our fast path beside other stores on loopback, one value a call: `kvstore-bench peers`.

    kvstore-bench peers [--quick] [--rounds 3] [--one-cpu] [--lmcache-python PATH]

Installs nothing. Each system runs as a server in a process of its own on 127.0.0.1,
and is read with the same pattern an engine's remote hit of one page uses: one value a
call, received into one reused page-sized buffer (page-aligned), for values of 64 KiB
(p50 of the call, µs), 1 MiB and 4 MiB (GB/s of the median call):

- raw: bench/rawpeer.py, a 9-byte request and then the bytes (no protocol: the floor);
- kvstore: kvstore-server, read by KVStoreClient.get_into over the fast path
  (shared_memory=False, a data connection a client), as a remote engine reads it;
- redis, where `redis-server` is on PATH, two ways: "redis RESP" sends GET and receives
  the bulk reply's bytes straight into the buffer (recv_into), the same work our client
  and the raw peer do; "redis glide" is valkey-glide-sync's get (already a dependency),
  which hands back a new bytes object that is then copied into the buffer. The first is
  the fair comparison of the servers; the second shows what a stock client adds;
- lmcache: LMCache's standalone server (`python -m lmcache.v1.server`, CPU storage), run
  by the Python --lmcache-python names (by default this one, where `lmcache` is installed
  for it; otherwise the line says it was skipped and how to run it). The package wants
  torch, so it usually lives in an environment of its own; this side needs neither:
  bench/lmcache_peer.py speaks the server's wire format, and a GET's bytes are received
  straight into the buffer, as for "redis RESP". Its wire format is that of LMCache 0.5.x.

A round measures every system at every size, in an order that rotates each round, so
load from other work on the machine falls on all of them alike; figures are medians
over rounds (>= 3 by default), ratios are taken within a round and then the median.
Values of 1 MiB or more are read over 8 connections to each system, one call each in
turn, the 64 KiB one over one connection: one loopback connection's large copies keep a
speed of their own (bench/fastpath_sweep.py's _Turns says why, and why not below 1 MiB).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np

from kvstore_client import KVStoreClient
from kvstore_client.buffers import page_aligned_empty
from kvstore_testing.serverproc import ServerProcess

from .fastpath_sweep import (
    CONNECTIONS,
    TURNS_FROM,
    _layout,
    _pinned,
    _RawPeer,
    _times,
    congestion_control,
)
from .lmcache_peer import LMCacheClient, LMCacheServer, cache_key, lmcache_imports
from .rawpeer import RawClient, connect

__all__ = ["RespClient", "main"]

KiB, MiB = 1 << 10, 1 << 20
SIZES = (64 * KiB, 1 * MiB, 4 * MiB)
KEY = b"peers-page"

# A reader: receives the value of `size` bytes into the buffer given.
Reader = Callable[[memoryview], object]


def _reader(per_connection: list[Reader], size: int) -> Reader:
    """The reader of a value of `size` bytes: the first connection's below TURNS_FROM,
    else one connection's after another, a call each (fastpath_sweep._Turns says why)."""
    if size < TURNS_FROM or len(per_connection) == 1:
        return per_connection[0]
    take = itertools.cycle(per_connection).__next__

    def read(out: memoryview) -> object:
        return take()(out)
    return read


def _recv_into_all(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill every view in order: one recvmsg_into for all, then the rest with WAITALL."""
    got = sock.recvmsg_into(views)[0]
    for view in views:
        if got >= view.nbytes:
            got -= view.nbytes
            continue
        pos = got
        got = 0
        while pos < view.nbytes:
            n = sock.recv_into(view[pos:], view.nbytes - pos, socket.MSG_WAITALL)
            if not n:
                raise ConnectionError("the server closed the connection")
            pos += n


class RespClient:
    """GET and SET over RESP on one socket; GET's bulk reply lands in the caller's buffer."""

    def __init__(self, port: int) -> None:
        self.sock = connect("127.0.0.1", port)
        self._crlf = memoryview(bytearray(2))

    @staticmethod
    def _command(*parts: bytes) -> bytes:
        return (b"*%d\r\n" % len(parts)
                + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts))

    def call(self, *parts: bytes) -> bytes:
        """A command whose reply is one line (+OK, :1, -ERR ...)."""
        self.sock.sendall(self._command(*parts))
        line = b""
        while not line.endswith(b"\r\n"):
            chunk = self.sock.recv(256)
            if not chunk:
                raise ConnectionError("redis closed the connection")
            line += chunk
        if line.startswith(b"-"):
            raise RuntimeError(f"redis: {line.decode(errors='replace').strip()}")
        return line

    def set(self, key: bytes, value: memoryview) -> None:
        head = b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, value.nbytes)
        self.sock.sendall(head)
        self.sock.sendall(value)
        self.sock.sendall(b"\r\n")
        line = self.sock.recv(64)
        if not line.startswith(b"+OK"):
            raise RuntimeError(f"redis SET answered {line!r}")

    def getter(self, key: bytes, size: int) -> Reader:
        """get(out): the value of key, `size` bytes, received into out."""
        request = self._command(b"GET", key)
        expected = b"$%d\r\n" % size
        head = memoryview(bytearray(len(expected)))

        def get(out: memoryview) -> None:
            self.sock.sendall(request)
            _recv_into_all(self.sock, [head, out, self._crlf])
            if head != expected or self._crlf != b"\r\n":
                raise RuntimeError(f"redis GET answered {bytes(head)!r}, expected "
                                   f"{expected!r}")
        return get

    def close(self) -> None:
        self.sock.close()


class RedisServer:
    """redis-server on a free loopback port, persisting nothing, in a folder of its own."""

    def __init__(self, binary: str) -> None:
        self.dir = tempfile.TemporaryDirectory(prefix="kvstore-peers-redis-")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir.name, "--daemonize", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                probe = RespClient(self.port)
                probe.call(b"PING")
                probe.close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.dir.cleanup()


def _glide_client(port: int) -> tuple[Callable[[bytes], Reader], Callable[[], None]]:
    """A valkey-glide-sync client: getter(key) reads key with its get, the bytes copied
    into the buffer; and its close."""
    import glide_sync as glide
    client = glide.GlideClient.create(glide.GlideClientConfiguration(
        [glide.NodeAddress("127.0.0.1", port)], request_timeout=60_000))

    def getter(key: bytes) -> Reader:
        def get(out: memoryview) -> None:
            value = client.get(key)
            if value is None or len(value) != out.nbytes:
                raise RuntimeError("glide GET came back short")
            out[:] = value
        return get
    return getter, client.close


LMCACHE_SKIPPED = ("lmcache: the lmcache package is not installed for this Python; skipped "
                   "(--lmcache-python PATH runs LMCache's server with a Python that has it)")


def _size(size: int) -> str:
    return f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"


def _calls(size: int, quick: bool) -> int:
    if quick:
        return 5
    return {64 * KiB: 400, 1 * MiB: 150}.get(size, 50)


def run(quick: bool, rounds: int, lmcache_python: str | None = None,
        one_cpu: bool = False, turns: int = CONNECTIONS) -> str:
    """The report; lmcache_python runs LMCache's server (None: lmcache is skipped);
    one_cpu: every server's threads and this process's on one CPU while timed; turns:
    the connections to each system that values of TURNS_FROM bytes or more go round."""
    buf = page_aligned_empty((max(SIZES),))
    src = np.random.default_rng(7).integers(0, 256, max(SIZES), dtype=np.uint8)
    redis_bin = shutil.which("redis-server")
    closers: list[Callable[[], object]] = []
    peer = _RawPeer()
    closers.append(peer.close)
    pids = [peer.proc.pid]                   # the servers' processes (one_cpu)
    conns = range(turns)
    try:
        raws = [RawClient("127.0.0.1", peer.port) for _ in conns]
        closers += [raw.close for raw in raws]
        srv = ServerProcess(dram=f"{256 + 2 * sum(SIZES) // MiB}MiB").start(wait=300)
        closers.append(srv.stop)
        assert srv.proc is not None
        pids.append(srv.proc.pid)
        cs = [KVStoreClient(srv.address, timeout=120, shared_memory=False, data_plane=True,
                            data_connections=1) for _ in conns]
        closers += [c.close for c in cs]
        readers: dict[str, dict[int, Reader]] = {"raw": {}, "kvstore": {}}
        for size in SIZES:
            readers["raw"][size] = _reader([raw.get for raw in raws], size)
            ns = cs[0].register_layout(_layout(size))
            key = KEY + b"-%d" % size
            cs[0].put(ns, [key], src[:size].reshape(1, size))

            def ours(c: KVStoreClient, ns=ns, key=key, size=size) -> Reader:
                def read(out: memoryview) -> None:
                    c.get_into(ns, [key], np.frombuffer(out, dtype=np.uint8).reshape(1, size))
                return read
            readers["kvstore"][size] = _reader([ours(c) for c in cs], size)
        if redis_bin is not None:
            redis = RedisServer(redis_bin)
            closers.append(redis.close)
            pids.append(redis.proc.pid)
            resps = [RespClient(redis.port) for _ in conns]
            closers += [resp.close for resp in resps]
            glides = [_glide_client(redis.port) for _ in conns]
            closers += [close for _, close in glides]
            readers["redis RESP"], readers["redis glide"] = {}, {}
            for size in SIZES:
                key = KEY + b"-%d" % size
                resps[0].set(key, src[:size].data)
                readers["redis RESP"][size] = _reader(
                    [resp.getter(key, size) for resp in resps], size)
                readers["redis glide"][size] = _reader(
                    [getter(key) for getter, _ in glides], size)
        if lmcache_python is not None:
            try:
                lmc = LMCacheServer(lmcache_python)
            except RuntimeError as e:
                raise SystemExit(f"kvstore-bench peers: {e}") from None
            closers.append(lmc.close)
            pids.append(lmc.proc.pid)
            lmc_clients = [LMCacheClient(lmc.port) for _ in conns]
            closers += [client.close for client in lmc_clients]
            readers["lmcache"] = {}
            for i, size in enumerate(SIZES):
                lmc_key = cache_key(i)
                lmc_clients[0].put(lmc_key, src[:size].data)
                readers["lmcache"][size] = _reader(
                    [client.getter(lmc_key, size) for client in lmc_clients], size)
        # Every reader gives back what was stored (the raw peer sends ones), before
        # anything is timed.
        # A reader that goes round its connections is checked on each of them.
        for name, by_size in readers.items():
            for size, read in by_size.items():
                out = buf[:size].data
                want = np.ones(size, dtype=np.uint8) if name == "raw" else src[:size]
                for _ in range(len(conns) if size >= TURNS_FROM else 1):
                    buf[:size] = 0
                    read(out)
                    if not np.array_equal(buf[:size], want):
                        raise SystemExit(f"{name}: the {_size(size)} value came back "
                                         "different")
        names = list(readers)
        figures: list[dict[tuple[str, int], float]] = []
        with _pinned(tuple(pids)) if one_cpu else contextlib.nullcontext():
            _rounds(readers, names, buf, rounds, quick, figures)
    finally:
        for closer in reversed(closers):
            with contextlib.suppress(Exception):    # the rest still close
                closer()
    skipped = [] if redis_bin is not None else ["redis: redis-server is not on PATH; skipped"]
    if lmcache_python is None:
        skipped.append(LMCACHE_SKIPPED)
    return _report(names, figures, skipped, one_cpu, len(conns))


def _rounds(readers: dict[str, dict[int, Reader]], names: list[str], buf: np.ndarray,
            rounds: int, quick: bool, figures: list[dict[tuple[str, int], float]]) -> None:
    """Every system at every size, `rounds` times, in an order that rotates; each
    round's figures appended to figures."""
    for r in range(rounds):
        fig: dict[tuple[str, int], float] = {}
        for size in SIZES:
            out = buf[:size].data
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                read = readers[name][size]
                t = statistics.median(_times(lambda: read(out), _calls(size, quick)))
                fig[(name, size)] = t * 1e6 if size < MiB else size / t / 1e9
        figures.append(fig)


def _report(names: list[str], figures: list[dict[tuple[str, int], float]],
            skipped: list[str], one_cpu: bool = False, turns: int = 1) -> str:
    def med(name: str, size: int) -> float:
        return statistics.median(f[(name, size)] for f in figures)

    def speed(name: str, size: int) -> float:
        """kvstore's speed over name's within each round (> 1: kvstore faster)."""
        return statistics.median(
            (f[(name, size)] / f[("kvstore", size)]) if size < MiB
            else (f[("kvstore", size)] / f[(name, size)]) for f in figures)

    heads = [f"{_size(s)} {'p50 us' if s < MiB else 'GB/s'}" for s in SIZES]
    lines = [f"medians of {len(figures)} rounds; one value a call into one reused "
             "page-sized buffer; each server in its own process on 127.0.0.1; TCP "
             f"congestion control {congestion_control()}"
             + (f"; values of {TURNS_FROM // MiB} MiB or more over {turns} connections to "
                "each, one call each in turn" if turns > 1 else "")
             + ("; every thread of the servers and the client on one CPU (--one-cpu)"
                if one_cpu else ""), "",
             "| system | " + " | ".join(heads) + " |", "|---" * (len(SIZES) + 1) + "|"]
    for name in names:
        cells = [f"{med(name, s):.0f}" if s < MiB else f"{med(name, s):.2f}" for s in SIZES]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "kvstore's speed relative to each (> 1: kvstore faster; within a round, "
              "then the median)", "",
              "| against | " + " | ".join(_size(s) for s in SIZES) + " |",
              "|---" * (len(SIZES) + 1) + "|"]
    for name in names:
        if name != "kvstore":
            lines.append(f"| {name} | "
                         + " | ".join(f"{speed(name, s):.2f}" for s in SIZES) + " |")
    if skipped:
        lines += ["", *skipped]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvstore-bench peers",
                                description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="one round of a few calls: checks that it runs, measures nothing")
    p.add_argument("--rounds", type=int, default=0,
                   help="rounds to take medians over (default 3; --quick: 1)")
    p.add_argument("--one-cpu", action="store_true",
                   help="every thread of the servers and of this process on one CPU while "
                        "timed, as `fastpath --sweep --one-cpu` (bench/fastpath_sweep.py "
                        "says why): on a VM whose idle CPUs wake slowly, free threads time "
                        "the scheduler more than the servers")
    p.add_argument("--turns", type=int, default=CONNECTIONS, metavar="N",
                   help="connections to each system that values of 1 MiB or more go "
                        "round, one call each in turn (default 8; bench/fastpath_sweep.py "
                        "says why)")
    p.add_argument("--lmcache-python", metavar="PATH",
                   help="a Python with the lmcache package, to run LMCache's server with "
                        "(default: this one, where lmcache is installed for it)")
    args = p.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 3)
    if rounds < 1:
        p.error("--rounds must be at least 1")
    lmcache_python = args.lmcache_python
    if lmcache_python is None:
        if importlib.util.find_spec("lmcache") is not None:
            lmcache_python = sys.executable
    elif not lmcache_imports(lmcache_python):
        p.error(f"--lmcache-python {lmcache_python}: the lmcache package is not installed "
                "for that Python (or it does not run)")
    if args.turns < 1:
        p.error("--turns must be at least 1")
    print(run(args.quick, rounds, lmcache_python, args.one_cpu, args.turns))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
