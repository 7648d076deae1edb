"""Fast-path benchmark: the lean protocol beside gRPC and a raw socket, side by side.

Each run measures, against one real kvstore-server on loopback and in turn:
- get and put of 1 MiB pages (`--mib` MiB a call), byte-checked: fast path over one
  connection and striped over `--connections`, gRPC, and a raw TCP socket moving the same
  bytes between two processes (send from a buffer, recv_into another), and, where it
  is installed, iperf3's one loopback stream (bench/iperf.py: the machine's ceiling for
  a program in C);
- one 64 KiB page get, p50 and p99: fast path, gRPC, and a raw request/answer of 64 KiB;
- a lookup of 16 keys, p50: fast path (TCP and the Unix socket), gRPC (the client's
  LookupStream and unary Lookup), and a raw 64-byte request/answer;
- a same-host acquire + release of one page, p50: fast path on the Unix socket, gRPC;
- with `--send`, the server's two ways to send pages (sendfile, sendmsg) against each
  other, on a bare fast-path server in its own process.
`--sweep`, `--split` and `--floor` measure what engines call against a raw TCP peer, and
which end a small call's time goes to (bench/fastpath_sweep.py, fastpath_split.py,
fastpath_floor.py). `--tls` instead measures the fast path with and without TLS side by side
(bench/fastpath_tls.py); `kvstore-bench fastpath-netns` puts the server in another
network namespace (bench/netns_bench.py).
Ratios are per run; the report gives each figure's median over the runs. The dev VM has
2 cores shared with other work: trust the ratios of one run, and the medians, not one figure.

    python -m kvstore_bench.fastpath_bench [--runs 5] [--quick] [--send] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import socket
import statistics
import time

import numpy as np

from kvstore_client import KVStoreClient, PageLayout
from kvstore_client.buffers import page_aligned_empty
from kvstore_client.fastpath import FastPath
from kvstore_protocol.malloc import keep_freed_buffers
from kvstore_testing.serverproc import ServerProcess

from .fastpath_pages import PAGE_1M, PAGE_64K, percentile_us, timed
from .iperf import iperf3_gbps
from .store_bench import put_get_gbps, raw_socket_gbps

MiB = 1 << 20
SMALL = PageLayout(model="bench-fast-small", num_layers=1, page_tokens=1, num_kv_heads=1,
                   head_size=1024, dtype="float16")


# -- raw request/answer baseline ---------------------------------------------------------------
def _answerer(port_q, answer_bytes: int) -> None:
    answer = np.ones(answer_bytes, dtype=np.uint8)
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port_q.put(srv.getsockname()[1])
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        request = bytearray(64)
        with conn:
            while conn.recv_into(request):
                conn.sendall(answer)


def raw_request_us(answer_bytes: int, iters: int) -> list[float]:
    """Seconds of each 64-byte request answered with answer_bytes, peer in another process."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    peer = ctx.Process(target=_answerer, args=(q, answer_bytes), daemon=True)
    peer.start()
    try:
        port = q.get(timeout=30)
        buf = page_aligned_empty((answer_bytes,))
        mv = memoryview(buf)
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            request = bytes(64)

            def once():
                conn.sendall(request)
                pos = 0
                while pos < answer_bytes:
                    pos += conn.recv_into(mv[pos:])

            once()
            return timed(once, iters)
    finally:
        peer.kill()
        peer.join(10)


# -- send modes on a bare fast-path server ----------------------------------------------------
def _bare_server(q, mode: str, pages: int) -> None:
    from kvstore_server.fastpath import FastPathServer
    from kvstore_server.metrics import Metrics
    from kvstore_server.region import HEADER_BYTES, Region
    from kvstore_server.store import Store

    region = Region(-(-(pages * PAGE_1M.page_bytes + (64 << 20) + HEADER_BYTES) // (2 << 20))
                    * (2 << 20))
    region.prefault()
    store = Store(region)
    info = store.register_layout(PAGE_1M)
    keys = [i.to_bytes(16, "little") for i in range(pages)]
    res = store.reserve(info.layout_id, keys)
    store.commit(res.lease_id)
    server = FastPathServer(store, Metrics(), None, tcp=("127.0.0.1", 0), unix=False,
                            send_mode=mode)
    server.start()
    q.put(server.port)
    time.sleep(3600)


def send_mode_gbps(total: int, reps: int) -> dict[str, float]:
    """Get GB/s of `total` bytes of 1 MiB pages per send mode, one connection."""
    out = {}
    pages = total // PAGE_1M.page_bytes
    keys = b"".join(i.to_bytes(16, "little") for i in range(pages))
    buf = page_aligned_empty((total,))
    for mode in ("sendfile", "sendmsg"):
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        proc = ctx.Process(target=_bare_server, args=(q, mode, pages), daemon=True)
        proc.start()
        try:
            fast = FastPath(f"127.0.0.1:{q.get(timeout=120)}", connections=1)
            get = lambda: fast.get_into(PAGE_1M.layout_id, 16, keys, memoryview(buf),  # noqa: E731
                                        PAGE_1M.page_bytes)
            get()
            out[mode] = total / statistics.median(timed(get, reps)) / 1e9
            fast.close()
        finally:
            proc.kill()
            proc.join(10)
    return out


# -- connections: the fast path striped against as many raw sockets ----------------------------
def _raw_striped_sender(port_q, nbytes: int, conns: int, reps: int) -> None:
    import threading
    data = np.ones(nbytes, dtype=np.uint8)
    mv = memoryview(data)
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(conns)
        port_q.put(srv.getsockname()[1])
        socks = [srv.accept()[0] for _ in range(conns)]
        bounds = np.linspace(0, nbytes, conns + 1).astype(int).tolist()

        def send(i: int) -> None:
            part = mv[bounds[i]:bounds[i + 1]]
            for _ in range(reps):
                socks[i].recv(1)
                socks[i].sendall(part)

        threads = [threading.Thread(target=send, args=(i,)) for i in range(conns)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def raw_striped_gbps(nbytes: int, conns: int, reps: int, out: np.ndarray) -> float:
    """GB/s of nbytes received over `conns` sockets at once, each into its slice of out
    (threads, recv_into), the sender another process: the ceiling for a striped get."""
    import threading
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    peer = ctx.Process(target=_raw_striped_sender, args=(q, nbytes, conns, reps), daemon=True)
    peer.start()
    try:
        port = q.get(timeout=60)
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(conns)]
        bounds = np.linspace(0, nbytes, conns + 1).astype(int).tolist()
        mv = memoryview(out.reshape(-1))
        times = []
        for _ in range(reps):
            def recv(i: int) -> None:
                view = mv[bounds[i]:bounds[i + 1]]
                socks[i].sendall(b"g")
                pos = 0
                while pos < len(view):
                    pos += socks[i].recv_into(view[pos:])

            threads = [threading.Thread(target=recv, args=(i,)) for i in range(conns)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            times.append(time.perf_counter() - t0)
        for sock in socks:
            sock.close()
        return nbytes / statistics.median(times) / 1e9
    finally:
        peer.kill()
        peer.join(10)


def _out_buffer(nbytes: int, pinned: bool) -> np.ndarray:
    if pinned:
        import torch
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
    return page_aligned_empty((nbytes,))


def scaling(total: int, reps: int, conns: list[int], pinned: bool) -> list[dict]:
    """Striped fast-path get against raw sockets, per number of connections, one bare
    fast-path server (sendmsg), the receiving buffer pinned when asked (and CUDA is here)."""
    pages = total // PAGE_1M.page_bytes
    keys = b"".join(i.to_bytes(16, "little") for i in range(pages))
    out = _out_buffer(total, pinned)
    rows = []
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_bare_server, args=(q, "sendmsg", pages), daemon=True)
    proc.start()
    try:
        port = q.get(timeout=300)
        for k in conns:
            raw = raw_striped_gbps(total, k, reps, out)
            fast = FastPath(f"127.0.0.1:{port}", connections=k)
            get = lambda: fast.get_into(PAGE_1M.layout_id, 16, keys, memoryview(out),  # noqa: E731
                                        PAGE_1M.page_bytes)
            get()
            gbps = total / statistics.median(timed(get, reps)) / 1e9
            fast.close()
            rows.append({"connections": k, "fast_gbps": gbps, "raw_gbps": raw,
                         "fast_vs_raw": gbps / raw})
    finally:
        proc.kill()
        proc.join(10)
    return rows


# -- client processes: one server's aggregate --------------------------------------------------
def _client_proc(address: str, data_plane: bool, nbytes: int, reps: int, tag: str,
                 ready_q, start, done_q) -> None:
    keep_freed_buffers()
    with KVStoreClient(address, timeout=120, shared_memory=False, data_plane=data_plane,
                       data_connections=1) as c:
        ns = c.register_layout(PAGE_1M)
        n = nbytes // ns.page_bytes
        keys = [f"{tag}-{i}".encode().ljust(24, b".") for i in range(n)]
        pages = np.random.default_rng(len(tag)).integers(0, 256, (n, ns.page_bytes),
                                                          dtype=np.uint8)
        c.put(ns, keys, pages)
        out = page_aligned_empty((n, ns.page_bytes))
        c.get_into(ns, keys, out)
        ok = bool(np.array_equal(out, pages))
        ready_q.put(tag)
        start.wait()
        t0 = time.perf_counter()
        for _ in range(reps):
            c.get_into(ns, keys, out)
        done_q.put((time.perf_counter() - t0, ok))
        c.delete(ns, keys)


def aggregate_gbps(address: str, data_plane: bool, clients: int, nbytes: int,
                   reps: int) -> float:
    """GB/s of `clients` processes at once, each getting its own nbytes `reps` times."""
    ctx = mp.get_context("spawn")
    start = ctx.Event()
    ready = ctx.Queue()
    done = ctx.Queue()
    procs = [ctx.Process(target=_client_proc, args=(
        address, data_plane, nbytes, reps, f"agg-{data_plane}-{clients}-{i}", ready, start,
        done)) for i in range(clients)]
    for proc in procs:
        proc.start()
    # Each process puts and checks its pages first; the gets start together.
    for _ in procs:
        ready.get(timeout=600)
    t0 = time.perf_counter()
    start.set()
    results = [done.get(timeout=600) for _ in procs]
    wall = time.perf_counter() - t0
    for proc in procs:
        proc.join(60)
    if not all(ok for _, ok in results):
        raise SystemExit("a client process read other bytes")
    return clients * nbytes * reps / wall / 1e9


def clients_report(counts: list[int], mib: int, reps: int) -> str:
    """One server, N client processes at once (one connection each), aggregate get GB/s,
    fast path and gRPC, with each N's figure over the first N's: 8 processes reading at
    8x one would show the server's send path does not serialize (on the GIL, or a lock)."""
    lines = ["| client processes | fast path GB/s (aggregate) | x the first row | "
             "gRPC GB/s (aggregate) | fast / gRPC |", "|---|---|---|---|---|"]
    first = None
    with ServerProcess(dram=f"{max(1, (max(counts) * mib * 2) // 1024 + 1)}GiB"
                       ).start(wait=300) as srv:
        for k in counts:
            fast = aggregate_gbps(srv.address, True, k, mib * MiB, reps)
            grpc_ = aggregate_gbps(srv.address, False, k, mib * MiB, reps)
            first = first or fast
            lines.append(f"| {k} | {fast:.2f} | {fast / first:.2f} | {grpc_:.2f} | "
                         f"{fast / grpc_:.2f} |")
            print(lines[-1], flush=True)
    return "\n".join(lines)


# -- one run ------------------------------------------------------------------------------
def one_run(srv: ServerProcess, total: int, reps: int, iters: int, connections: int,
            run: int) -> dict:
    r: dict = {}
    raw_recv, raw_send = raw_socket_gbps(total, reps)
    r["raw"] = {"get_gbps": raw_recv, "put_gbps": raw_send}
    iperf = iperf3_gbps()
    if iperf is not None:
        r["iperf3"] = {"get_gbps": iperf}
    kinds = {
        "fast": dict(data_plane=True, data_connections=1),
        f"fast x{connections}": dict(data_plane=True, data_connections=connections),
        "grpc": dict(data_plane=False),
    }
    for kind, flags in kinds.items():
        with KVStoreClient(srv.address, timeout=120, shared_memory=False, **flags) as c:
            put, get = put_get_gbps(c, c.register_layout(PAGE_1M), total, reps,
                                    f"{kind}-{run}")
            r[kind] = {"get_gbps": get, "put_gbps": put}
    # One 64 KiB page.
    raw64 = raw_request_us(PAGE_64K.page_bytes, iters)
    r["raw"]["get64k_p50_us"], r["raw"]["get64k_p99_us"] = percentile_us(raw64, .5), percentile_us(raw64, .99)
    for kind, flags in (("fast", dict(data_plane=True)), ("grpc", dict(data_plane=False))):
        with KVStoreClient(srv.address, shared_memory=False, **flags) as c:
            ns = c.register_layout(PAGE_64K)
            key = [f"p64-{kind}-{run}".encode().ljust(16, b".")]
            page = np.random.default_rng(run).integers(0, 256, (1, ns.page_bytes),
                                                       dtype=np.uint8)
            c.put(ns, key, page)
            out = page_aligned_empty((1, ns.page_bytes))
            c.get_into(ns, key, out)
            if not np.array_equal(out, page):
                raise SystemExit(f"{kind}: the 64 KiB page came back different")
            times = timed(lambda: c.get_into(ns, key, out), iters)
            r[kind]["get64k_p50_us"], r[kind]["get64k_p99_us"] = percentile_us(times, .5), percentile_us(times, .99)
            c.delete(ns, key)
    # Lookup of 16 keys, and a same-host acquire + release of one page.
    raw_small = raw_request_us(64, iters)
    r["raw"]["lookup_p50_us"] = percentile_us(raw_small, .5)
    keys = [i.to_bytes(16, "little") for i in range(16)]
    lookups = {
        "fast": dict(data_plane=True, shared_memory=False),
        "fast unix": dict(data_plane=True),
        "grpc": dict(data_plane=False),
        "grpc unary": dict(data_plane=False, lookup_stream=False),
    }
    for kind, flags in lookups.items():
        with KVStoreClient(srv.address, **flags) as c:
            ns = c.register_layout(SMALL)
            c.put(ns, keys, np.zeros((16, ns.page_bytes), dtype=np.uint8))
            c.lookup(ns, keys)
            times = timed(lambda: c.lookup(ns, keys), iters)
            r.setdefault(kind, {})["lookup_p50_us"] = percentile_us(times, .5)
            if kind in ("fast unix", "grpc"):
                def acquire_release():
                    c.acquire(ns, keys[:1]).release()
                acquire_release()
                times = timed(acquire_release, iters)
                r[kind]["acquire_release_p50_us"] = percentile_us(times, .5)
    fast, grpc_ = r["fast"], r["grpc"]
    r["ratios"] = {
        "get vs raw": fast["get_gbps"] / raw_recv,
        "get vs gRPC": fast["get_gbps"] / grpc_["get_gbps"],
        f"get x{connections} vs raw": r[f"fast x{connections}"]["get_gbps"] / raw_recv,
        "put vs raw send": fast["put_gbps"] / raw_send,
        "put vs gRPC": fast["put_gbps"] / grpc_["put_gbps"],
        "64 KiB p50, raw / fast": r["raw"]["get64k_p50_us"] / fast["get64k_p50_us"],
        "64 KiB p50, gRPC / fast": grpc_["get64k_p50_us"] / fast["get64k_p50_us"],
        "lookup p50, gRPC / fast": grpc_["lookup_p50_us"] / fast["lookup_p50_us"],
    }
    if iperf is not None:
        r["ratios"]["get vs iperf3"] = fast["get_gbps"] / iperf
        r["ratios"]["gRPC x 2.5 vs iperf3"] = 2.5 * grpc_["get_gbps"] / iperf
    return r


def run(runs: int = 5, quick: bool = False, connections: int = 4, send: bool = False,
        mib: int = 0) -> dict:
    total = (mib or (32 if quick else 128)) * MiB
    reps = 3
    iters = 200 if quick else 1000
    keep_freed_buffers()    # this process receives pages over gRPC (kvstore_protocol.malloc)
    results: dict = {"runs": [], "total_mib": total // MiB, "connections": connections}
    with ServerProcess(dram="1GiB" if quick else "2GiB").start(wait=300) as srv:
        for i in range(runs):
            results["runs"].append(one_run(srv, total, reps, iters, connections, i))
    if send:
        results["send_modes"] = send_mode_gbps(total, reps)
    return results


def _median(runs: list[dict], kind: str, field: str) -> float | None:
    values = [r[kind][field] for r in runs if field in r.get(kind, {})]
    return statistics.median(values) if values else None


def report(r: dict) -> str:
    runs = r["runs"]
    n = len(runs)
    c = r["connections"]
    kinds = ["fast", f"fast x{c}", "fast unix", "grpc", "grpc unary", "raw"]
    if any("iperf3" in run_ for run_ in runs):
        kinds.append("iperf3")
    fields = [("get_gbps", "get 1 MiB pages GB/s"), ("put_gbps", "put 1 MiB pages GB/s"),
              ("get64k_p50_us", "one 64 KiB page p50 us"),
              ("get64k_p99_us", "one 64 KiB page p99 us"),
              ("lookup_p50_us", "lookup 16 keys p50 us"),
              ("acquire_release_p50_us", "acquire+release 1 page p50 us")]
    lines = [f"medians of {n} runs, {r['total_mib']} MiB a call; raw = a plain TCP socket "
             "between two processes in the same run"
             + ("; iperf3 = one loopback TCP stream of iperf3 (C, 1 MiB writes), same run"
                if "iperf3" in kinds else ""), "",
             "| | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 1) + "|"]
    for field, label in fields:
        cells = []
        for kind in kinds:
            value = _median(runs, kind, field)
            cells.append("-" if value is None else
                         (f"{value:.2f}" if field.endswith("gbps") else f"{value:.0f}"))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "| ratio (per run) | " + " | ".join(f"run {i + 1}" for i in range(n))
              + " | median |", "|---" * (n + 2) + "|"]
    for name in runs[0]["ratios"]:
        values = [run_["ratios"][name] for run_ in runs if name in run_["ratios"]]
        lines.append(f"| {name} | " + " | ".join(f"{v:.2f}" for v in values)
                     + f" | {statistics.median(values):.2f} |")
    if "send_modes" in r:
        lines += ["", "server send mode, one connection, bare fast-path server: "
                  + ", ".join(f"{k} {v:.2f} GB/s" for k, v in r["send_modes"].items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvstore-bench fastpath", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5, help="runs, each measuring everything")
    p.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    p.add_argument("--connections", type=int, default=4, help="connections of a striped get")
    p.add_argument("--mib", type=int, default=0, help="MiB a get or put (default 128)")
    p.add_argument("--send", action="store_true", help="also compare sendfile and sendmsg")
    p.add_argument("--scaling", metavar="N,N,...",
                   help="only: a striped get over these connection counts against as many "
                        "raw sockets, on a bare fast-path server")
    p.add_argument("--pinned", action="store_true", help="--scaling into pinned memory")
    p.add_argument("--clients", metavar="N,N,...",
                   help="only: the aggregate get of this many client processes at once, "
                        "each over one connection, fast path and gRPC, one server")
    p.add_argument("--tls", action="store_true",
                   help="only: the fast path with and without TLS, two servers side by side")
    p.add_argument("--sweep", action="store_true",
                   help="only: what engines call, pages a call by page size, lookups and "
                        "leases, against a raw TCP peer (bench/fastpath_sweep.py)")
    p.add_argument("--one-cpu", action="store_true",
                   help="--sweep, --split or --floor with every thread of both ends on one "
                        "CPU (bench/fastpath_sweep.py says why)")
    p.add_argument("--split", action="store_true",
                   help="only: where a call's CPU goes, Python or kernel, at each end, "
                        "against the raw peer (bench/fastpath_split.py)")
    p.add_argument("--floor", action="store_true",
                   help="only: how much of a small call's time each end adds, our client "
                        "and our server each against a least one of the same protocol "
                        "(bench/fastpath_floor.py)")
    p.add_argument("--turns", type=int, default=0, metavar="N",
                   help="--sweep: the connections each side's calls of 1 MiB or more go "
                        "round, one call each in turn (default 8; bench/fastpath_sweep.py "
                        "says why)")
    p.add_argument("--congestion", metavar="NAME", default="",
                   help="--sweep: the TCP congestion control the server (--data-congestion) "
                        "and the raw peer send under (default: the host's; "
                        "bench/fastpath_sweep.py says why it matters)")
    p.add_argument("--rounds", type=int, default=0,
                   help="--sweep's and --split's rounds (default 3), --floor's (5), "
                        "--client-ab's blocks (default 20)")
    p.add_argument("--client-ab", metavar="DIR",
                   help="only: this checkout's client against the one in DIR (another "
                        "checkout), alternated blocks of calls against one server "
                        "(bench/fastpath_clients.py)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.client_ab:
        from .fastpath_clients import ClientAB, client_ab
        spec = ClientAB.quick() if args.quick else ClientAB()
        if args.rounds:
            spec = dataclasses.replace(spec, blocks=args.rounds)
        print(client_ab(args.client_ab, spec))
        return 0
    if args.floor:
        from .fastpath_floor import main_floor
        print(main_floor(args.quick, args.rounds, args.one_cpu))
        return 0
    if args.split:
        from .fastpath_split import main_split
        print(main_split(args.quick, args.rounds, args.one_cpu))
        return 0
    if args.sweep:
        from .fastpath_sweep import main_sweep
        print(main_sweep(args.quick, args.rounds, args.one_cpu, args.turns, args.congestion))
        return 0
    if args.tls:
        from .fastpath_tls import tls_report
        print(tls_report(args.runs, args.mib or (32 if args.quick else 128)))
        return 0
    if args.clients:
        print(clients_report([int(k) for k in args.clients.split(",")], args.mib or 64, 3))
        return 0
    if args.scaling:
        total = (args.mib or 1024) * MiB
        for _ in range(args.runs):
            rows = scaling(total, 3, [int(k) for k in args.scaling.split(",")], args.pinned)
            print(json.dumps(rows) if args.json else "\n".join(
                f"{r['connections']} connections: fast {r['fast_gbps']:.2f} GB/s, raw "
                f"{r['raw_gbps']:.2f} GB/s, fast/raw {r['fast_vs_raw']:.2f}" for r in rows),
                flush=True)
        return 0
    r = run(args.runs, args.quick, args.connections, args.send, args.mib)
    print(json.dumps(r, indent=2) if args.json else report(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
