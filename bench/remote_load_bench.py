"""The connector's remote load against a raw TCP peer: what a remote hit costs the host.

An engine whose store is on another host loads a hit's pages over the fast path, layer by
layer, into a ring of pinned host slabs (connector.worker.remote, connector.worker.staging,
the client's get_layers striped over several connections: kvstore_client.layerget). This
bench runs that code, RemoteLoad as the worker starts it, against a real kvstore-server
over loopback TCP, with the copy out of each slab to the GPU left out (a stand-in transfer
takes each slab as landed): the CPU part of a remote load alone.

Beside it, in the same run, the same load from a raw TCP peer (bench/layerpeer.py, a
process of its own holding the same pages and sending them layer-major from where they lie,
as the server does): the same stripes over the same number of connections, one request a stripe,
each layer's rows received straight into the same ring's slabs, a slab handed back once
every stripe has filled its layer, and nothing else. Loads alternate, raw then connector,
`--reps` of each a round; a ratio (connector / raw, of the median loads) is taken within a
round and the table gives the median over `--rounds`, so a noisy neighbour on the shared
machine moves both sides alike. The pages are 8B-shaped (Llama-3-8B, bf16: 32 layers, 8 KV
heads, head 128, 16-token pages: 64 KiB a layer slab, 2 MiB a page), random bytes, and the
first load of each size from either side is compared byte for byte with what was stored.

    kvstore-bench remote-load [--tokens 256,1024,4096] [--connections 8] [--rounds 5]
                              [--reps 5] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import queue
import socket
import statistics
import subprocess
import sys
import threading
import time

import numpy as np
import torch

from kvstore_client import KVStoreClient, PageLayout
from kvstore_client.layerget import stripe_bounds
from kvstore_connector.worker.deadline import Pace
from kvstore_connector.worker.remote import RemoteLoad
from kvstore_connector.worker.staging import StagingRing
from kvstore_testing.serverproc import ServerProcess

from .layerpeer import REQUEST, pages as peer_pages
from .rawpeer import connect

__all__ = ["LAYOUT", "main"]

LAYOUT = PageLayout(model="bench-remote-8b", num_layers=32, page_tokens=16, num_kv_heads=8,
                    head_size=128, dtype="bfloat16")
MiB = 1 << 20
SEED = 3
STAGING_BYTES = 512 * MiB       # the connector's default remote_staging_bytes
CONNECTIONS = 8                 # the connector's default remote_connections


class HostOnly:
    """What RemoteLoad calls of connector.transfer.KVTransfer, with the copy to the device
    left out: a slab counts as copied once handed over. With `check`, a (pages, layers,
    layer_bytes) array, each slab's rows are copied into it first (block id = page)."""

    device = torch.device("cpu")

    def __init__(self, check: np.ndarray | None = None) -> None:
        self._check = check

    def order_loads(self) -> None:
        pass

    def load_blocks(self, block_ids: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.asarray(block_ids, dtype=np.int64))

    def load_layer(self, layer: int, slab: np.ndarray, blocks: torch.Tensor) -> None:
        if self._check is not None:
            self._check[blocks[:, 0].numpy(), layer] = slab
        return None


class RawLoad:
    """The same load from the raw peer: LayerGet's stripes over as many connections, one
    request a stripe, one receive a layer a stripe into the ring's slab for that layer
    (taken by the first stripe to reach it), the slab given back once the layer is whole."""

    def __init__(self, port: int, connections: int, ring: StagingRing) -> None:
        self._ring = ring
        self._socks = []
        for _ in range(connections):
            self._socks.append(connect("127.0.0.1", port))

    def load(self, pages: int, layers: int, layer_bytes: int,
             check: np.ndarray | None = None) -> None:
        """pages' layers into the ring's slabs; with `check` ((pages, layers, layer_bytes)),
        each whole layer is copied into it before its slab goes back."""
        bounds = stripe_bounds(pages, layers, layer_bytes, len(self._socks))
        stripes = len(bounds) - 1
        slabs: list[np.ndarray | None] = [None] * layers
        index = [0] * layers                        # the ring's slab of each layer
        claimed = [False] * layers                  # a stripe takes the layer's slab
        left = [stripes] * layers                   # stripes yet to fill a layer
        ready = [threading.Event() for _ in range(layers)]
        lock = threading.Lock()
        done: queue.Queue = queue.Queue()
        stop = threading.Event()

        def stripe(sock: socket.socket, lo: int, hi: int) -> None:
            sock.sendall(REQUEST.pack(lo, hi))
            for layer in range(layers):
                with lock:
                    first = not claimed[layer]
                    claimed[layer] = True
                if first:
                    index[layer] = self._ring.take(stop)
                    slabs[layer] = self._ring.mem(index[layer], pages, layer_bytes)
                    ready[layer].set()
                ready[layer].wait()
                rows = slabs[layer][lo:hi]              # type: ignore[index]
                view = memoryview(rows.reshape(-1))
                pos = 0
                while pos < len(view):
                    got = sock.recv_into(view[pos:], len(view) - pos, socket.MSG_WAITALL)
                    if not got:
                        raise ConnectionError("the raw peer closed the connection")
                    pos += got
                with lock:
                    left[layer] -= 1
                    whole = not left[layer]
                if whole:
                    done.put(layer)

        threads = [threading.Thread(target=stripe, args=(s, lo, hi), daemon=True)
                   for s, lo, hi in zip(self._socks, bounds[:-1], bounds[1:])]
        for t in threads:
            t.start()
        for _ in range(layers):
            layer = done.get(timeout=60)
            if check is not None:
                check[:, layer] = slabs[layer]
            self._ring.give(index[layer])
        for t in threads:
            t.join()

    def close(self) -> None:
        for sock in self._socks:
            sock.close()


@dataclasses.dataclass(frozen=True, slots=True)
class Spec:
    """What one run measures."""

    tokens: tuple[int, ...] = (256, 1024, 4096)
    connections: int = CONNECTIONS
    rounds: int = 5
    reps: int = 5

    @staticmethod
    def quick() -> Spec:
        return Spec(tokens=(256, 1024), rounds=3, reps=2)


class _LayerPeer:
    """bench/layerpeer.py in a process of its own, as the server is, holding the pages."""

    def __init__(self, pages: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "kvstore_bench.layerpeer",
                                      str(pages), str(LAYOUT.page_bytes),
                                      str(LAYOUT.num_layers), str(SEED)],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _connector_load(client: KVStoreClient, ns, keys: list[bytes], transfer: HostOnly,
                    ring: StagingRing, pace: Pace) -> None:
    """One load as the worker runs it: started, each layer waited for, synchronized."""
    load = RemoteLoad(client, ns, keys, np.arange(len(keys)).reshape(-1, 1), transfer,
                      ring, (), pace)
    for layer in range(ns.layout.num_layers):
        load.wait_layer(layer)
    load.synchronize()


def run(spec: Spec) -> tuple[list[dict[int, float]], dict[int, tuple[float, float]]]:
    """Per round, token count -> connector / raw; and token count -> (connector GB/s,
    raw GB/s), the medians over every round's loads."""
    pages = max(spec.tokens) // LAYOUT.page_tokens
    dram = -(-(pages * LAYOUT.page_bytes * 2 + 256 * MiB) // (256 * MiB)) * 256
    peer = _LayerPeer(pages)
    ratios: list[dict[int, float]] = []
    times: dict[int, tuple[list[float], list[float]]] = {t: ([], []) for t in spec.tokens}
    try:
        with ServerProcess(dram=f"{dram}MiB").start(wait=300) as srv, \
                KVStoreClient(srv.address, timeout=60, shared_memory=False, data_plane=True,
                              data_connections=spec.connections) as client:
            ns = client.register_layout(LAYOUT)
            keys = [f"remote-load-{i}".encode().ljust(32, b".") for i in range(pages)]
            stored = peer_pages(pages, ns.page_bytes, SEED)
            for lo in range(0, pages, 64):
                client.put(ns, keys[lo:lo + 64], stored[lo:lo + 64])
            ring = StagingRing(STAGING_BYTES, ns.layer_bytes, torch.device("cpu"))
            if pages * ns.layer_bytes > ring.slab_bytes:
                raise SystemExit(f"{pages} pages' layer is past a slab ({ring.slab_bytes} B)")
            pace = Pace(client.timeout)
            raw = RawLoad(peer.port, spec.connections, ring)
            transfer = HostOnly()
            for tokens in spec.tokens:
                n = tokens // LAYOUT.page_tokens
                got = np.zeros((n, LAYOUT.num_layers, ns.layer_bytes), dtype=np.uint8)
                _connector_load(client, ns, keys[:n], HostOnly(got), ring, pace)
                if not np.array_equal(got.reshape(n, -1), stored[:n]):
                    raise SystemExit(f"the connector's load of {n} pages came back different")
                got[:] = 0
                raw.load(n, LAYOUT.num_layers, ns.layer_bytes, got)
                if not np.array_equal(got.reshape(n, -1), stored[:n]):
                    raise SystemExit(f"the raw peer's load of {n} pages came back different")
            for _ in range(spec.rounds):
                fig = {}
                for tokens in spec.tokens:
                    n = tokens // LAYOUT.page_tokens
                    t_raw, t_conn = [], []
                    for _ in range(spec.reps):
                        t0 = time.perf_counter()
                        raw.load(n, LAYOUT.num_layers, ns.layer_bytes)
                        t1 = time.perf_counter()
                        _connector_load(client, ns, keys[:n], transfer, ring, pace)
                        t2 = time.perf_counter()
                        t_raw.append(t1 - t0)
                        t_conn.append(t2 - t1)
                    fig[tokens] = statistics.median(t_raw) / statistics.median(t_conn)
                    times[tokens][0].extend(t_conn)
                    times[tokens][1].extend(t_raw)
                ratios.append(fig)
            raw.close()
    finally:
        peer.close()
    rates = {t: (_gbps(t, c), _gbps(t, r)) for t, (c, r) in times.items()}
    return ratios, rates


def _gbps(tokens: int, seconds: list[float]) -> float:
    return tokens // LAYOUT.page_tokens * LAYOUT.page_bytes / statistics.median(seconds) / 1e9


def report(spec: Spec, ratios: list[dict[int, float]],
           rates: dict[int, tuple[float, float]], load: tuple[float, float]) -> str:
    lines = [f"8B-shaped pages ({LAYOUT.num_layers} layers, {LAYOUT.layer_bytes // 1024} KiB "
             f"a layer slab, {LAYOUT.page_bytes // MiB} MiB a page), loopback TCP, "
             f"up to {spec.connections} connections; medians of {len(ratios)} rounds of "
             f"{spec.reps} loads each; raw = bench/layerpeer.py in its own process, the "
             "same pages, stripes, slabs and receives a layer; ratio = connector / raw within a round, "
             "then the median", "",
             "| tokens | pages | connections | connector GB/s | raw GB/s | connector/raw |",
             "|---|---|---|---|---|---|"]
    for tokens in spec.tokens:
        n = tokens // LAYOUT.page_tokens
        stripes = len(stripe_bounds(n, LAYOUT.num_layers, LAYOUT.layer_bytes,
                                    spec.connections)) - 1
        conn, raw = rates[tokens]
        lines.append(f"| {tokens} | {n} | {stripes} | {conn:.2f} | {raw:.2f} | "
                     f"{statistics.median(r[tokens] for r in ratios):.2f} |")
    lines += ["", "ratios by round: " + "; ".join(
        f"{t}: " + " ".join(f"{r[t]:.2f}" for r in ratios) for t in spec.tokens),
        f"load average (1 min) at start / end: {load[0]:.1f} / {load[1]:.1f}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvstore-bench remote-load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="", help="comma-separated prompt lengths "
                   "(default 256,1024,4096)")
    p.add_argument("--connections", type=int, default=CONNECTIONS,
                   help="the client's connections (the connector's remote_connections)")
    p.add_argument("--rounds", type=int, default=0, help="rounds (default 5)")
    p.add_argument("--reps", type=int, default=0, help="loads of each side a round "
                   "(default 5)")
    p.add_argument("--quick", action="store_true", help="256 and 1024 tokens, 3 rounds of 2")
    args = p.parse_args(argv)
    spec = Spec.quick() if args.quick else Spec()
    if args.tokens:
        spec = dataclasses.replace(spec, tokens=tuple(int(t) for t in args.tokens.split(",")))
    spec = dataclasses.replace(spec, connections=args.connections,
                               rounds=args.rounds or spec.rounds, reps=args.reps or spec.reps)
    if spec.rounds < 1 or spec.reps < 1 or spec.connections < 1 or \
            any(t < LAYOUT.page_tokens or t % LAYOUT.page_tokens for t in spec.tokens):
        p.error(f"rounds, reps and connections >= 1; tokens multiples of "
                f"{LAYOUT.page_tokens}")
    before = os.getloadavg()[0]
    ratios, rates = run(spec)
    print(report(spec, ratios, rates, (before, os.getloadavg()[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
