"""A store "on another host": the fast path across two network namespaces joined by a veth
pair, with and without added latency, beside a raw socket over the same link.

The server (and a raw TCP peer, bench/rawpeer.py) run in a namespace of their own
(bench/netns.py); this process is the client, in its own namespace, so every byte
crosses the veth pair as it would cross a network: 1500-byte MTU, the full TCP path on
both ends, and `tc netem` delay on both ends where the kernel has it (`--delay-ms` each
way, so the round trip grows by twice that). Each condition (no added delay, then the
delay) measures, per run:

- get and put of 1 MiB pages (`--mib` MiB a call, byte-checked): fast path over one
  connection and striped over `--connections`, gRPC, and the raw peer moving the same
  bytes over one connection and over as many as the striped get;
- one 64 KiB page get, p50 and p99: fast path, gRPC, and a raw 64 KiB request/answer.

What it should show: with latency, one connection's throughput falls as its window
waits on acknowledgements, and striping over several connections wins it back, for the
fast path as for the raw socket. Where namespaces or netem are not allowed (no root, no
iproute2, a kernel without sch_netem) it prints what it skipped and why.

    kvstore-bench fastpath-netns [--delay-ms 0.5] [--runs 3] [--mib 128] [--connections 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

import numpy as np

from kvstore_client import KVStoreClient
from kvstore_client.buffers import page_aligned_empty
from kvstore_protocol.malloc import keep_freed_buffers
from kvstore_testing.serverproc import ServerProcess

from .fastpath_pages import PAGE_1M, PAGE_64K, percentile_us, timed
from .netns import NetPair, NetUnavailable
from .rawpeer import RawClient
from .store_bench import put_get_gbps

MiB = 1 << 20


def _raw(host: str, port: int, total: int, reps: int, iters: int, connections: int) -> dict:
    out = page_aligned_empty((total,))
    data = memoryview(np.ones(total, dtype=np.uint8)).cast("B")
    one, many = RawClient(host, port, 1), RawClient(host, port, connections)
    try:
        view = memoryview(out).cast("B")
        one.get(view)
        many.get(view)
        r = {"get_gbps": total / statistics.median(timed(lambda: one.get(view), reps)) / 1e9,
             "getN_gbps": total / statistics.median(timed(lambda: many.get(view), reps)) / 1e9,
             "put_gbps": total / statistics.median(timed(lambda: one.put(data), reps)) / 1e9}
        small = view[:PAGE_64K.page_bytes]
        times = timed(lambda: one.get(small), iters)
        r["get64k_p50_us"], r["get64k_p99_us"] = percentile_us(times, .5), percentile_us(times, .99)
        return r
    finally:
        one.close()
        many.close()


def _page_64k(address: str, data_plane: bool, iters: int, tag: str) -> tuple[float, float]:
    with KVStoreClient(address, shared_memory=False, data_plane=data_plane) as c:
        ns = c.register_layout(PAGE_64K)
        key = [tag.encode().ljust(16, b".")]
        page = np.random.default_rng(1).integers(0, 256, (1, ns.page_bytes), dtype=np.uint8)
        c.put(ns, key, page)
        out = page_aligned_empty((1, ns.page_bytes))
        c.get_into(ns, key, out)
        if not np.array_equal(out, page):
            raise SystemExit(f"{tag}: the 64 KiB page came back different")
        times = timed(lambda: c.get_into(ns, key, out), iters)
        c.delete(ns, key)
    return percentile_us(times, .5), percentile_us(times, .99)


def one_run(address: str, raw_host: str, raw_port: int, total: int, reps: int, iters: int,
            connections: int, tag: str) -> dict:
    r = {"raw": _raw(raw_host, raw_port, total, reps, iters, connections)}
    kinds = {"fast": dict(data_plane=True, data_connections=1),
             "fast xN": dict(data_plane=True, data_connections=connections),
             "grpc": dict(data_plane=False)}
    for kind, flags in kinds.items():
        with KVStoreClient(address, timeout=300, shared_memory=False, **flags) as c:
            if flags["data_plane"] and c._data.fast() is None:
                raise SystemExit("the fast path could not be reached across the namespaces")
            put, get = put_get_gbps(c, c.register_layout(PAGE_1M), total, reps, f"{kind}-{tag}")
            r[kind] = {"get_gbps": get, "put_gbps": put}
    r["fast"]["getN_gbps"] = r.pop("fast xN")["get_gbps"]
    for kind, data_plane in (("fast", True), ("grpc", False)):
        r[kind]["get64k_p50_us"], r[kind]["get64k_p99_us"] = _page_64k(
            address, data_plane, iters, f"p64-{kind}-{tag}")
    return r


ROWS = [("get_gbps", "get 1 MiB pages, 1 connection, GB/s"),
        ("getN_gbps", "get 1 MiB pages, {n} connections, GB/s"),
        ("put_gbps", "put 1 MiB pages, 1 connection, GB/s"),
        ("get64k_p50_us", "one 64 KiB page p50 us"),
        ("get64k_p99_us", "one 64 KiB page p99 us")]


def _median(runs: list[dict], kind: str, field: str) -> float | None:
    values = [r[kind][field] for r in runs if field in r[kind]]
    return statistics.median(values) if values else None


def report(result: dict) -> str:
    n = result["connections"]
    lines = [(f"client and server in two network namespaces joined by a veth pair; "
              f"{result['total_mib']} MiB a call, medians of {result['runs']} runs; raw = a "
              "plain TCP peer in the server's namespace, same link, same run")]
    for cond in result["conditions"]:
        runs = cond["runs"]
        lines += ["", f"### {cond['name']}", "",
                  "| | fast path | raw socket | gRPC | fast / raw |", "|---|---|---|---|---|"]
        for field, label in ROWS:
            cells, values = [], {}
            for kind in ("fast", "raw", "grpc"):
                value = _median(runs, kind, field)
                values[kind] = value
                cells.append("-" if value is None else
                             f"{value:.2f}" if field.endswith("gbps") else f"{value:.0f}")
            ratio = (values["fast"] / values["raw"] if field.endswith("gbps")
                     else values["raw"] / values["fast"])
            lines.append(f"| {label.format(n=n)} | " + " | ".join(cells) + f" | {ratio:.2f} |")
        per_run = [r["fast"]["getN_gbps"] / r["fast"]["get_gbps"] for r in runs]
        lines.append(f"\nstriped get over {n} connections / one connection, per run: "
                     + ", ".join(f"{v:.2f}" for v in per_run))
    if len(result["conditions"]) == 2:
        base, slow = (c["runs"] for c in result["conditions"])
        for kind, field, what in (("fast", "getN_gbps", f"fast path striped x{n}"),
                                  ("fast", "get_gbps", "fast path, 1 connection"),
                                  ("raw", "getN_gbps", f"raw x{n}")):
            held = _median(slow, kind, field) / _median(base, kind, field)
            lines.append(f"with the delay / without, {what} get: {held:.2f}")
    for skipped in result["skipped"]:
        lines.append(f"\nSKIPPED: {skipped}")
    return "\n".join(lines)


def run(delay_ms: float, runs: int, total: int, reps: int, iters: int,
        connections: int) -> dict:
    keep_freed_buffers()    # gRPC gets land in fresh buffers (kvstore_protocol.malloc)
    result = {"runs": runs, "total_mib": total // MiB, "connections": connections,
              "conditions": [], "skipped": []}
    with NetPair() as net:
        peer = subprocess.Popen([*net.exec_prefix, sys.executable, "-m", "kvstore_bench.rawpeer",
                                 net.far_ip], stdout=subprocess.PIPE, text=True)
        try:
            raw_port = int(peer.stdout.readline())
            dram = f"{max(256, 3 * total // MiB)}MiB"
            with ServerProcess("--insecure-listen", host=net.far_ip, prefix=net.exec_prefix,
                               dram=dram, data_socket="false").start(wait=120) as srv:
                conditions = [("no added delay", 0.0)]
                if delay_ms:
                    name = (f"+{delay_ms:g} ms each way (tc netem on both veth ends: "
                            f"round trip +{2 * delay_ms:g} ms)")
                    conditions.append((name, delay_ms))
                for name, ms in conditions:
                    try:
                        net.set_delay(ms)
                    except NetUnavailable as exc:
                        result["skipped"].append(f"{name}: {exc}")
                        continue
                    out = [one_run(srv.address, net.far_ip, raw_port, total, reps, iters,
                                   connections, f"{ms}-{i}") for i in range(runs)]
                    result["conditions"].append({"name": name, "delay_ms": ms, "runs": out})
        finally:
            peer.kill()
            peer.wait(10)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvstore-bench fastpath-netns", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--delay-ms", type=float, default=0.5,
                   help="added delay each way with tc netem (0 = none)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--mib", type=int, default=128, help="MiB a get or put")
    p.add_argument("--connections", type=int, default=4, help="connections of a striped get")
    p.add_argument("--iters", type=int, default=300, help="64 KiB gets timed per run")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        result = run(args.delay_ms, args.runs, args.mib * MiB, 3, args.iters,
                     args.connections)
    except NetUnavailable as exc:
        print(f"SKIPPED: a store on another host needs two network namespaces: {exc}")
        return 0
    print(json.dumps(result, indent=2) if args.json else report(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
