"""Load test: K client processes put, get, look up and probe pages for a fixed time, and
every byte that comes back is compared with what its key says it must hold.

Each client process has its own KVStoreClient and loops over a mix of operations on one
key space shared by all clients, so clients read each other's pages:

    put      a run of 1..batch consecutive keys, their pages made from the keys
    get      Lookup, then Get the leading pages found, each compared byte for byte with
             the page its key makes (a page evicted in between is a miss, not an error)
    lookup   Lookup of a run
    exists   Exists of a run

A page's bytes are a splitmix64 stream seeded by its key, so any process can rebuild
the page of any key (several times faster than numpy's PCG64) and a page
served under the wrong key, stale or torn, differs. Runs start at a skewed position
(the square of a uniform number), so the low keys are hot and hit while the key space
is larger than the pool, which keeps eviction busy. With `--shared-memory mixed` (the
default) half the clients move bytes through the server's shared pool, half over gRPC.

The parent samples the server's RSS every second (/proc/PID/status: VmRSS, and RssAnon,
which leaves out the pre-faulted pool) and compares the end with the end of the warm-up.
It prints ops/s, p50/p99 per RPC, errors, mismatches and the RSS series, and exits 1
when a call failed, a byte differed, or a lease was left behind.

    kvstore-bench load-test [--clients 8] [--seconds 60] [--server ADDR --server-pid PID]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import queue as queue_mod
import tempfile
import time
import traceback

import numpy as np
import xxhash

from kvstore_client import KVStoreClient, PageLayout
from kvstore_protocol.units import parse_size
from kvstore_testing.serverproc import ServerProcess

__all__ = ["LoadConfig", "key_of", "main", "page_of", "report", "run"]

OPS = ("put", "get", "lookup", "exists")
# The client calls timed; "get" also times the Lookup before it under "lookup".
RPCS = ("put", "get", "lookup", "exists")


@dataclasses.dataclass(frozen=True, slots=True)
class LoadConfig:
    clients: int = 8
    seconds: float = 60.0
    warmup: float = 10.0            # RSS growth is measured from here to the end
    server: str = ""                # "" = start an embedded server
    server_pid: int = 0             # for RSS when --server is given; 0 = no RSS
    dram: str = "96MiB"             # embedded server's pool: well under the key space
    disk: str = "0"                 # embedded server's disk tier (in a temporary folder)
    page_kib: int = 64
    keys: int = 4096                # key space shared by every client
    batch: int = 16                 # a run is 1..batch consecutive keys
    mix: tuple[tuple[str, float], ...] = (("put", 3), ("get", 4), ("lookup", 2), ("exists", 1))
    shared_memory: str = "mixed"    # auto | off | mixed (half the clients gRPC only)
    seed: int = 0

    def layout(self) -> PageLayout:
        # 8 layers x 2 (K, V) x 16 tokens x 1 head x head_size x 2 bytes = page_kib KiB
        return PageLayout(model="load-test", num_layers=8, page_tokens=16, num_kv_heads=1,
                          head_size=2 * self.page_kib, dtype="bfloat16")


# -- pages made from keys ------------------------------------------------------------------
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def key_of(i: int) -> bytes:
    return xxhash.xxh3_128_digest(b"load-test:%d" % i)


def page_of(key: bytes, page_bytes: int, out: np.ndarray | None = None) -> np.ndarray:
    """The page that key names: splitmix64 of (key's first 8 bytes + i * golden), i = 1.."""
    z = np.arange(1, page_bytes // 8 + 1, dtype=np.uint64) if out is None else out.view(np.uint64)
    if out is not None:
        z[:] = np.arange(1, page_bytes // 8 + 1, dtype=np.uint64)
    z *= _GOLDEN
    z += np.uint64(int.from_bytes(key[:8], "little"))
    z ^= z >> _S30
    z *= _MIX1
    z ^= z >> _S27
    z *= _MIX2
    z ^= z >> _S31
    return z.view(np.uint8)


# -- one client process ----------------------------------------------------------------------
def _client(idx: int, cfg: LoadConfig, address: str, go, results) -> None:
    """Run the mix until the deadline; put one result dict (or an "crash" one) on results."""
    try:
        results.put(_client_loop(idx, cfg, address, go, results))
    except BaseException:  # noqa: BLE001 - the parent must hear about it
        results.put({"client": idx, "crash": traceback.format_exc()})


def _client_loop(idx: int, cfg: LoadConfig, address: str, go, results) -> dict:
    shm = {"auto": None, "off": False, "mixed": None if idx % 2 == 0 else False}[
        cfg.shared_memory]
    rng = np.random.default_rng(cfg.seed * 1000 + idx)
    keys = [key_of(i) for i in range(cfg.keys)]
    ops = [op for op, _ in cfg.mix]
    weights = np.array([w for _, w in cfg.mix], dtype=float)
    weights /= weights.sum()
    lat: dict[str, list[float]] = {rpc: [] for rpc in RPCS}
    counts = {"pages_put": 0, "pages_stored": 0, "pages_checked": 0, "misses": 0,
              "errors": 0, "mismatches": 0}
    messages: list[str] = []
    with KVStoreClient(address, shared_memory=shm, timeout=30) as client:
        ns = client.register_layout(cfg.layout())
        pb = ns.page_bytes
        scratch = np.empty((cfg.batch, pb), dtype=np.uint8)
        path = "shm" if client.region() is not None else "grpc"
        results.put({"client": idx, "ready": True})
        go.wait()
        deadline = time.perf_counter() + cfg.seconds

        def timed(rpc, fn, *a):
            t0 = time.perf_counter()
            try:
                return fn(*a)
            finally:
                lat[rpc].append(time.perf_counter() - t0)

        def fail(what: str) -> None:
            if len(messages) < 10:
                messages.append(what)

        while time.perf_counter() < deadline:
            op = ops[int(rng.choice(len(ops), p=weights))]
            start = int(cfg.keys * rng.random() ** 2)
            n = int(rng.integers(1, cfg.batch + 1))
            run = [keys[(start + j) % cfg.keys] for j in range(n)]
            try:
                if op == "put":
                    for j, key in enumerate(run):
                        page_of(key, pb, scratch[j])
                    res = timed("put", client.put, ns, run, scratch[:n])
                    counts["pages_put"] += n
                    counts["pages_stored"] += res.stored
                elif op == "lookup":
                    found = timed("lookup", client.lookup, ns, run)
                    if not 0 <= found <= n:
                        counts["errors"] += 1
                        fail(f"lookup of {n} keys answered {found}")
                elif op == "exists":
                    bits = timed("exists", client.exists, ns, run)
                    if len(bits) != n:
                        counts["errors"] += 1
                        fail(f"exists of {n} keys answered {len(bits)} bits")
                else:
                    found = timed("lookup", client.lookup, ns, run)
                    if found == 0:
                        counts["misses"] += 1
                        continue
                    try:
                        got = timed("get", client.get, ns, run[:found])
                    except KeyError:
                        counts["misses"] += 1       # evicted since the lookup: normal
                        continue
                    for j in range(found):
                        want = page_of(run[j], pb, scratch[j])
                        counts["pages_checked"] += 1
                        if not np.array_equal(got[j], want):
                            counts["mismatches"] += 1
                            at = int(np.flatnonzero(got[j] != want)[0])
                            fail(f"page {run[j].hex()} differs from byte {at} ({path})")
            except Exception as exc:  # noqa: BLE001 - counted, and the load goes on
                counts["errors"] += 1
                fail(f"{op} ({path}): {type(exc).__name__}: {exc}")
    return {"client": idx, "path": path, "latency": {k: np.array(v) for k, v in lat.items()},
            "counts": counts, "messages": messages, "seconds": cfg.seconds}


# -- the parent --------------------------------------------------------------------------------
def _rss(pid: int) -> tuple[int, int] | None:
    """(VmRSS, RssAnon) in bytes, or None when the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return None
    def kib(name: str) -> int:
        return int(fields.get(name, "0 kB").split()[0]) * 1024
    return kib("VmRSS"), kib("RssAnon")


def run(cfg: LoadConfig) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvstore-load-") as tmp:
        if cfg.server:
            return _run(cfg, cfg.server, cfg.server_pid)
        flags = {"dram": cfg.dram}
        if parse_size(cfg.disk):
            flags.update(disk=cfg.disk, disk_dir=os.path.join(tmp, "disk"))
        with ServerProcess(**flags).start(wait=120) as srv:
            out = _run(cfg, srv.address, srv.proc.pid)
            out["server_alive"] = srv.proc.poll() is None
            return out


def _run(cfg: LoadConfig, address: str, pid: int) -> dict:
    ctx = mp.get_context("spawn")
    go = ctx.Event()
    results = ctx.Queue()
    procs = [ctx.Process(target=_client, args=(i, cfg, address, go, results), daemon=True)
             for i in range(cfg.clients)]
    for p in procs:
        p.start()
    done: list[dict] = []
    ready = 0
    while ready < cfg.clients:
        msg = results.get(timeout=120)
        if "crash" in msg:
            done.append(msg)
            ready += 1
        elif msg.get("ready"):
            ready += 1
    rss: list[tuple[float, int, int]] = []
    t0 = time.monotonic()
    go.set()
    while len(done) < cfg.clients:
        sample = _rss(pid) if pid else None
        if sample:
            rss.append((time.monotonic() - t0, *sample))
        try:
            while True:
                msg = results.get(timeout=1.0 if len(done) < cfg.clients else 0)
                done.append(msg)
                if len(done) == cfg.clients:
                    break
        except queue_mod.Empty:
            pass
        if time.monotonic() - t0 > cfg.seconds + 300:
            raise RuntimeError("load-test clients did not finish 5 minutes after the end")
    for p in procs:
        p.join(10)
    wall = time.monotonic() - t0
    with KVStoreClient(address, shared_memory=False) as c:
        deadline = time.monotonic() + 5          # shared-memory releases are sent async
        while c.stats().leases and time.monotonic() < deadline:
            time.sleep(0.1)
        stats = c.stats()
    return _summary(cfg, done, rss, stats, wall)


def _summary(cfg: LoadConfig, done: list[dict], rss, stats, wall: float) -> dict:
    crashes = [d["crash"] for d in done if "crash" in d]
    ok = [d for d in done if "crash" not in d]
    counts = {k: sum(d["counts"][k] for d in ok) for k in ok[0]["counts"]} if ok else {}
    rpcs = {}
    for rpc in RPCS:
        lat = np.concatenate([d["latency"][rpc] for d in ok]) if ok else np.zeros(0)
        rpcs[rpc] = {"calls": int(lat.size), "per_s": lat.size / cfg.seconds,
                     "p50_ms": float(np.percentile(lat, 50) * 1e3) if lat.size else 0.0,
                     "p99_ms": float(np.percentile(lat, 99) * 1e3) if lat.size else 0.0}
    dram = stats.tiers[0]
    out = {
        "config": {**dataclasses.asdict(cfg), "mix": dict(cfg.mix)},
        "paths": sorted(d["path"] for d in ok),
        "wall_seconds": wall,
        "ops_per_s": sum(r["calls"] for r in rpcs.values()) / cfg.seconds,
        "rpcs": rpcs,
        **counts,
        "errors": counts.get("errors", 0) + len(crashes),
        "crashes": crashes,
        "messages": [m for d in ok for m in d["messages"]][:20],
        "put_mb_s": counts.get("pages_put", 0) * cfg.page_kib * 1024 / cfg.seconds / 1e6,
        "checked_mb_s": counts.get("pages_checked", 0) * cfg.page_kib * 1024 / cfg.seconds / 1e6,
        "server": {"evictions": dram.evictions, "pages": dram.pages, "hits": dram.hits,
                   "misses": dram.misses, "leases_left": stats.leases,
                   "leased_pages_left": stats.leased_pages},
        "rss": _rss_summary(rss, cfg.warmup),
    }
    return out


def _rss_summary(rss: list[tuple[float, int, int]], warmup: float) -> dict:
    if not rss:
        return {"samples": []}
    after = [s for s in rss if s[0] >= warmup] or rss[-1:]
    warm, end = after[0], rss[-1]
    return {
        "samples": [(round(t, 1), r, a) for t, r, a in rss],
        "start_mib": rss[0][1] / 2**20,
        "warm_mib": warm[1] / 2**20, "end_mib": end[1] / 2**20,
        "max_after_warmup_mib": max(s[1] for s in after) / 2**20,
        "growth_pct": 100.0 * (end[1] - warm[1]) / warm[1],
        "anon_warm_mib": warm[2] / 2**20, "anon_end_mib": end[2] / 2**20,
        "anon_growth_pct": 100.0 * (end[2] - warm[2]) / max(warm[2], 1),
    }


def failed(r: dict) -> bool:
    return bool(r["errors"] or r.get("mismatches", 0) or r["server"]["leases_left"]
                or not r.get("server_alive", True))


def report(r: dict) -> str:
    c = r["config"]
    lines = [(f"load test: {c['clients']} clients ({', '.join(r['paths'])}), "
              f"{c['seconds']:.0f} s, {c['keys']} keys of {c['page_kib']} KiB, "
              f"batch 1-{c['batch']}, mix {c['mix']}"),
             "", "| rpc | calls | per s | p50 ms | p99 ms |", "|---|---|---|---|---|"]
    for rpc, s in r["rpcs"].items():
        lines.append(f"| {rpc} | {s['calls']:,} | {s['per_s']:.0f} | {s['p50_ms']:.2f} | "
                     f"{s['p99_ms']:.2f} |")
    s = r["server"]
    lines += ["",
              (f"ops/s {r['ops_per_s']:.0f}; put {r['put_mb_s']:.0f} MB/s; pages checked "
               f"{r.get('pages_checked', 0):,} ({r['checked_mb_s']:.0f} MB/s); misses "
               f"{r.get('misses', 0):,}"),
              (f"errors {r['errors']}, mismatches {r.get('mismatches', 0)}, leases left "
               f"{s['leases_left']}; server: {s['evictions']:,} evictions, {s['pages']:,} "
               "pages in DRAM at the end")]
    rss = r["rss"]
    if rss.get("samples"):
        lines.append(f"server RSS: {rss['start_mib']:.0f} MiB at start, {rss['warm_mib']:.0f} "
                     f"after warm-up ({c['warmup']:.0f} s), {rss['end_mib']:.0f} at the end "
                     f"({rss['growth_pct']:+.1f}%), max {rss['max_after_warmup_mib']:.0f}; "
                     f"anonymous {rss['anon_warm_mib']:.0f} -> {rss['anon_end_mib']:.0f} MiB "
                     f"({rss['anon_growth_pct']:+.1f}%)")
        step = max(1, len(rss["samples"]) // 12)
        lines.append("RSS MiB over time (s: total/anon): " + ", ".join(
            f"{t:.0f}: {t_rss / 2**20:.0f}/{a / 2**20:.0f}"
            for t, t_rss, a in rss["samples"][::step]))
    for m in r["messages"]:
        lines.append("  " + m)
    for crash in r["crashes"]:
        lines.append("client crashed:\n" + crash)
    lines.append("FAILED" if failed(r) else "OK")
    return "\n".join(lines)


def _mix(text: str) -> tuple[tuple[str, float], ...]:
    out = []
    for part in text.split(","):
        name, _, weight = part.partition("=")
        if name.strip() not in OPS or not weight:
            raise argparse.ArgumentTypeError(f"mix entries are OP=WEIGHT with OP in {OPS}, "
                                             f"got {part!r}")
        out.append((name.strip(), float(weight)))
    if sum(w for _, w in out) <= 0:
        raise argparse.ArgumentTypeError("mix weights must add up to more than 0")
    return tuple(out)


def main(argv: list[str] | None = None) -> int:
    d = LoadConfig()
    p = argparse.ArgumentParser(prog="kvstore-bench load-test", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=d.clients, help="client processes (8)")
    p.add_argument("--seconds", type=float, default=d.seconds, help="length of the run (60)")
    p.add_argument("--warmup", type=float, default=None,
                   help="RSS growth is measured after this (default: min(10, seconds / 3))")
    p.add_argument("--server", default="", metavar="ADDR",
                   help="a running server; default: start one with --dram/--disk")
    p.add_argument("--server-pid", type=int, default=0, metavar="PID",
                   help="the --server's pid, to sample its RSS (same host)")
    p.add_argument("--dram", default=d.dram, help=f"embedded server's pool ({d.dram})")
    p.add_argument("--disk", default=d.disk, help="embedded server's disk tier; 0 = none")
    p.add_argument("--page-kib", type=int, default=d.page_kib, help="page size in KiB (64)")
    p.add_argument("--keys", type=int, default=d.keys, help="key space (4096)")
    p.add_argument("--batch", type=int, default=d.batch, help="most keys a call (16)")
    p.add_argument("--mix", type=_mix, default=d.mix,
                   help="op weights, e.g. put=3,get=4,lookup=2,exists=1 (the default)")
    p.add_argument("--shared-memory", choices=("auto", "off", "mixed"), default=d.shared_memory,
                   help="auto: the shared pool where mappable; off: gRPC only; mixed "
                        "(default): every other client gRPC only")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    a = p.parse_args(argv)
    if a.clients < 1 or a.seconds <= 0 or a.keys < 1 or a.batch < 1 or a.page_kib < 1:
        p.error("clients, seconds, keys, batch and page-kib must be positive")
    cfg = LoadConfig(clients=a.clients, seconds=a.seconds,
                     warmup=min(10.0, a.seconds / 3) if a.warmup is None else a.warmup,
                     server=a.server, server_pid=a.server_pid, dram=a.dram, disk=a.disk,
                     page_kib=a.page_kib, keys=a.keys, batch=a.batch, mix=a.mix,
                     shared_memory=a.shared_memory, seed=a.seed)
    r = run(cfg)
    print(json.dumps(r, indent=2, default=str) if a.json else report(r))
    return 1 if failed(r) else 0


if __name__ == "__main__":
    raise SystemExit(main())
