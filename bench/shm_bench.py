"""Same-host data plane benchmark: shared-memory put/get against gRPC and a plain copy.

192 MiB per call in 1 MiB pages through a real kvstore-server on loopback, the same
client process measuring, in one run: (a) the shared-memory path (Reserve/Commit,
Acquire/Release, numpy copies in and out of the mapped pool), (b) the gRPC path of the
same client (`shared_memory=False`), (c) a plain numpy copy of the same bytes between
two pre-touched buffers. Every buffer is page-aligned, as the pool is. With `--gpu` and a CUDA device, also pool -> GPU copies of
the acquired pages (the mapping registered with cudaHostRegister once) against a
pinned-memory cudaMemcpy of the same size.

    python -m kvstore_bench.shm_bench [--quick] [--gpu] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from kvstore_client import KVStoreClient, PageLayout
from kvstore_client.buffers import page_aligned_empty
from kvstore_protocol.malloc import keep_freed_buffers
from kvstore_testing.serverproc import ServerProcess

from .store_bench import put_get_gbps

MiB = 1 << 20
LAYOUT = PageLayout(model="bench-shm", num_layers=32, page_tokens=16, num_kv_heads=8,
                    head_size=64)      # 1 MiB pages


def _median_gbps(nbytes: int, times: list[float]) -> float:
    return nbytes / statistics.median(times) / 1e9


def memcpy_gbps(nbytes: int, reps: int) -> float:
    # Page-aligned like the get's buffers (store_bench.put_get_gbps) and the pool, so
    # both copies meet glibc's large-copy path on equal terms (see shm.copy_pages).
    src = page_aligned_empty((nbytes,))
    dst = page_aligned_empty((nbytes,))
    src[:] = 1
    dst[:] = 1
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst[:] = src
        times.append(time.perf_counter() - t0)
    return _median_gbps(nbytes, times)


def path_gbps(client: KVStoreClient, total: int, reps: int, tag: str) -> tuple[float, float]:
    return put_get_gbps(client, client.register_layout(LAYOUT), total, reps, tag)


def gpu_gbps(client: KVStoreClient, total: int, reps: int) -> dict:
    """Acquired pool pages -> one GPU buffer, against a pinned buffer -> GPU, same size."""
    import torch

    from kvstore_connector.transfer import HostRegistration

    ns = client.register_layout(LAYOUT)
    n = total // ns.page_bytes
    keys = [f"gpu-{i}".encode().ljust(16, b".") for i in range(n)]
    client.put(ns, keys, np.ones((n, ns.page_bytes), dtype=np.uint8))
    region = client.region()
    t0 = time.perf_counter()
    registration = HostRegistration(region.mem)
    register_s = time.perf_counter() - t0
    pool = torch.from_numpy(region.mem)
    dst = torch.empty(total, dtype=torch.uint8, device="cuda")
    pinned = torch.ones(total, dtype=torch.uint8).pin_memory()
    stream = torch.cuda.Stream()
    timings = {"pool": [], "pinned": [], "pool_runs": []}
    with client.acquire(ns, keys) as acq:
        offsets = acq.offsets.tolist()
        runs = _runs(offsets, ns.page_bytes)
        for _ in range(reps + 1):
            for name in ("pinned", "pool", "pool_runs"):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(stream):
                    start.record()
                    if name == "pinned":
                        dst.copy_(pinned, non_blocking=True)
                    elif name == "pool":
                        for i, off in enumerate(offsets):   # one copy per 1 MiB page
                            dst[i * ns.page_bytes:(i + 1) * ns.page_bytes].copy_(
                                pool[off:off + ns.page_bytes], non_blocking=True)
                    else:
                        # Pages of one put sit in adjacent slots: one copy per run.
                        for first, off, nbytes in runs:
                            dst[first * ns.page_bytes:first * ns.page_bytes + nbytes].copy_(
                                pool[off:off + nbytes], non_blocking=True)
                    end.record()
                end.synchronize()
                timings[name].append(start.elapsed_time(end) / 1e3)
    registration.close()
    pool_gbps = _median_gbps(total, timings["pool"][1:])
    runs_gbps = _median_gbps(total, timings["pool_runs"][1:])
    pinned_gbps = _median_gbps(total, timings["pinned"][1:])
    return {"pool_gbps": pool_gbps, "pool_runs_gbps": runs_gbps, "runs": len(runs),
            "pinned_gbps": pinned_gbps, "pool_vs_pinned": pool_gbps / pinned_gbps,
            "pool_runs_vs_pinned": runs_gbps / pinned_gbps, "register_ms": register_s * 1e3,
            "region_bytes": region.size}


def _runs(offsets: list[int], page_bytes: int) -> list[tuple[int, int, int]]:
    """(first page index, pool offset, bytes) of each run of pages adjacent in the pool."""
    runs: list[list[int]] = []
    for i, off in enumerate(offsets):
        if runs and runs[-1][1] + runs[-1][2] == off:
            runs[-1][2] += page_bytes
        else:
            runs.append([i, off, page_bytes])
    return [tuple(r) for r in runs]


def run(quick: bool, gpu: bool, shm_dir: str = "/dev/shm") -> dict:
    keep_freed_buffers()   # this process reads pages over gRPC too (see kvstore_protocol.malloc)
    reps = 3 if quick else 7
    total = 64 * MiB if quick else 192 * MiB
    results: dict = {"memcpy_gbps": memcpy_gbps(total, reps)}
    results["shm_dir"] = shm_dir
    with ServerProcess(dram="1GiB", shm_dir=shm_dir).start(wait=120) as srv:
        with KVStoreClient(srv.address, shared_memory=True) as shm:
            put, get = path_gbps(shm, total, reps, "shm")
            results["shm"] = {"put_gbps": put, "get_gbps": get}
            if gpu:
                results["gpu"] = gpu_gbps(shm, total, reps)
        # gRPC itself: the fast path (fastpath_bench) would otherwise carry these pages.
        with KVStoreClient(srv.address, shared_memory=False, timeout=60,
                           data_plane=False) as remote:
            put, get = path_gbps(remote, total, reps, "grpc")
            results["grpc"] = {"put_gbps": put, "get_gbps": get}
    results["get_shm_vs_grpc"] = results["shm"]["get_gbps"] / results["grpc"]["get_gbps"]
    results["get_shm_vs_memcpy"] = results["shm"]["get_gbps"] / results["memcpy_gbps"]
    results["put_shm_vs_grpc"] = results["shm"]["put_gbps"] / results["grpc"]["put_gbps"]
    results["put_shm_vs_memcpy"] = results["shm"]["put_gbps"] / results["memcpy_gbps"]
    return results


def report(r: dict) -> str:
    lines = [f"pool in {r['shm_dir']}", "", "| path | put GB/s | get GB/s |", "|---|---|---|",
             f"| shared memory | {r['shm']['put_gbps']:.2f} | {r['shm']['get_gbps']:.2f} |",
             f"| gRPC | {r['grpc']['put_gbps']:.2f} | {r['grpc']['get_gbps']:.2f} |",
             f"| plain numpy copy | {r['memcpy_gbps']:.2f} | {r['memcpy_gbps']:.2f} |", "",
             f"get: shared memory / gRPC = {r['get_shm_vs_grpc']:.1f}x, "
             f"/ memcpy = {r['get_shm_vs_memcpy']:.0%}",
             f"put: shared memory / gRPC = {r['put_shm_vs_grpc']:.1f}x, "
             f"/ memcpy = {r['put_shm_vs_memcpy']:.0%}"]
    if "gpu" in r:
        g = r["gpu"]
        lines += ["", f"pinned cudaMemcpy of the same bytes: {g['pinned_gbps']:.1f} GB/s",
                  f"pool -> GPU, one copy per page: {g['pool_gbps']:.1f} GB/s "
                  f"({g['pool_vs_pinned']:.0%})",
                  f"pool -> GPU, one copy per run of adjacent pages ({g['runs']} runs): "
                  f"{g['pool_runs_gbps']:.1f} GB/s ({g['pool_runs_vs_pinned']:.0%})",
                  f"cudaHostRegister of {g['region_bytes'] >> 20} MiB: "
                  f"{g['register_ms']:.0f} ms, once"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvstore-bench shm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--gpu", action="store_true", help="also pool -> GPU (needs CUDA)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--shm-dir", default="/dev/shm",
                   help="where the server puts its pool (a huge-page tmpfs or hugetlbfs "
                        "mount avoids 4 KiB TLB misses)")
    args = p.parse_args(argv)
    r = run(args.quick, args.gpu, args.shm_dir)
    print(json.dumps(r, indent=2) if args.json else report(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
