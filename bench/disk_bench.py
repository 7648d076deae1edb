"""Disk tier benchmark: spill and read-back of 1 MiB pages against plain sequential I/O.

In one run, in one folder (the disk the tier would use), the same number of bytes:
(a) spill: DiskTier.offer of every page, as fast as the write-behind queue takes them
    (an offer refused because the queue is full is retried), until flush() says all are
    written; (b) read-back: DiskTier.read_into of every page, 64 pages a call, into
    page-aligned buffers (as the DRAM pool's slots are); (c) a plain sequential write of a
    file of the same size in `--chunk` calls, and (d) a plain sequential read of it.
The page cache is bypassed the same way for both: O_DIRECT where the file system allows
(the tier picks it by itself then), else fsync after the writes (inside the timing, for
both) and posix_fadvise(DONTNEED) before the reads. Each run uses fresh files; the figures
are medians over the runs, which alternate which of tier and plain goes first.

Target: read-back at least 60% of the plain sequential read.

    python -m kvstore_bench.disk_bench [--dir PATH] [--total-mib 1024] [--runs 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

from kvstore_server.disk.slotfile import aligned_buffer, probe_direct
from kvstore_server.disk.tier import DiskTier

MiB = 1 << 20
LAYOUT_ID = b"disk-bench-lay01"
READ_BATCH = 64             # pages per read_into call: a Get of 64 MiB
TARGET_READ_RATIO = 0.6


def _drop_cache(paths: list[str], direct: bool) -> None:
    """Make the next read come from the disk: nothing to do under O_DIRECT; otherwise the
    data was fsynced when written, and DONTNEED drops the clean pages."""
    if direct:
        return
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _fsync_all(paths: list[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def plain_write(path: str, src: np.ndarray, total: int, chunk: int, direct: bool) -> float:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o600)
    try:
        started = time.perf_counter()
        for off in range(0, total, chunk):
            os.pwritev(fd, [src[: min(chunk, total - off)]], off)
        if not direct:
            os.fsync(fd)
        return time.perf_counter() - started
    finally:
        os.close(fd)


def plain_read(path: str, dst: np.ndarray, total: int, chunk: int, direct: bool) -> float:
    _drop_cache([path], direct)
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        started = time.perf_counter()
        for off in range(0, total, chunk):
            os.preadv(fd, [dst[: min(chunk, total - off)]], off)
        return time.perf_counter() - started
    finally:
        os.close(fd)


def tier_spill(tier: DiskTier, pages: list[np.ndarray], keys: list[bytes], direct: bool) -> float:
    started = time.perf_counter()
    for i, key in enumerate(keys):
        while not tier.offer(LAYOUT_ID, key, pages[i % len(pages)]):
            time.sleep(0.0002)              # the queue is full: the writer is behind
    if tier.flush(600):
        raise RuntimeError("the disk tier did not write everything within 10 minutes")
    if not direct:
        _fsync_all(_slot_files(tier))
    return time.perf_counter() - started


def tier_read(tier: DiskTier, keys: list[bytes], outs: list[np.ndarray], direct: bool) -> float:
    _drop_cache(_slot_files(tier), direct)
    started = time.perf_counter()
    for first in range(0, len(keys), READ_BATCH):
        batch = keys[first:first + READ_BATCH]
        ok = tier.read_into(LAYOUT_ID, batch, outs[:len(batch)])
        if not all(ok):
            raise RuntimeError(f"read-back missed {ok.count(False)} pages")
    return time.perf_counter() - started


def _slot_files(tier: DiskTier) -> list[str]:
    return [os.path.join(tier.directory, n) for n in os.listdir(tier.directory)
            if n.endswith(".slots")]


def run(folder: str, total: int, page_bytes: int, runs: int, chunk: int) -> dict:
    direct = probe_direct(folder)
    n = total // page_bytes
    rng = np.random.default_rng(0)
    pages = [rng.integers(0, 256, page_bytes, dtype=np.uint8) for _ in range(16)]
    src = aligned_buffer(chunk)
    src[:] = rng.integers(0, 256, chunk, dtype=np.uint8)
    dst = aligned_buffer(chunk)
    outs = [aligned_buffer(page_bytes) for _ in range(READ_BATCH)]
    times: dict[str, list[float]] = {k: [] for k in ("spill", "readback", "write", "read")}
    for r in range(runs):
        work = tempfile.mkdtemp(prefix="disk-bench-", dir=folder)
        try:
            plain = os.path.join(work, "plain.bin")
            keys = [f"r{r}-{i}".encode() for i in range(n)]
            tier = DiskTier(os.path.join(work, "tier"), total + 64 * MiB, direct=direct)
            try:
                order = ("tier", "plain") if r % 2 == 0 else ("plain", "tier")
                for who in order:
                    if who == "tier":
                        times["spill"].append(tier_spill(tier, pages, keys, direct))
                    else:
                        times["write"].append(plain_write(plain, src, n * page_bytes, chunk,
                                                          direct))
                for who in order:
                    if who == "tier":
                        times["readback"].append(tier_read(tier, keys, outs, direct))
                    else:
                        times["read"].append(plain_read(plain, dst, n * page_bytes, chunk,
                                                        direct))
                stats = tier.stats()
            finally:
                tier.close()
        finally:
            shutil.rmtree(work, ignore_errors=True)
    nbytes = n * page_bytes
    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    return {
        "folder": folder, "direct_io": direct, "page_bytes": page_bytes, "pages": n,
        "bytes": nbytes, "runs": runs, "plain_chunk_bytes": chunk,
        "gbps": gbps,
        "spill_vs_write": gbps["spill"] / gbps["write"],
        "readback_vs_read": gbps["readback"] / gbps["read"],
        "target_readback_vs_read": TARGET_READ_RATIO,
        "tier_drops": stats.drops, "tier_corrupt": stats.corrupt_pages,
        "all_gbps": {k: [round(nbytes / t / 1e9, 3) for t in v] for k, v in times.items()},
    }


def report(res: dict) -> str:
    g = res["gbps"]
    ok = res["readback_vs_read"] >= res["target_readback_vs_read"]
    how = "O_DIRECT" if res["direct_io"] else "fsync + fadvise(DONTNEED)"
    return "\n".join([
        (f"disk tier vs plain sequential I/O in {res['folder']} ({how}), {res['pages']} pages "
         f"of {res['page_bytes'] // MiB} MiB, median of {res['runs']} runs"),
        (f"  write: plain {g['write']:.2f} GB/s ({res['plain_chunk_bytes'] // MiB} MiB calls), "
         f"spill {g['spill']:.2f} GB/s: {res['spill_vs_write']:.0%}"),
        (f"  read:  plain {g['read']:.2f} GB/s, read-back {g['readback']:.2f} GB/s: "
         f"{res['readback_vs_read']:.0%} (target {res['target_readback_vs_read']:.0%}: "
         f"{'met' if ok else 'MISSED'})"),
        f"  every run (GB/s): {res['all_gbps']}",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvstore-bench disk", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=".", help="folder on the disk to measure (default: .)")
    p.add_argument("--total-mib", type=int, default=1024, help="bytes per run (MiB)")
    p.add_argument("--page-mib", type=int, default=1, help="page size (MiB)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--chunk-mib", type=int, default=8, help="plain I/O call size (MiB)")
    p.add_argument("--quick", action="store_true", help="256 MiB, 3 runs: a smoke run")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    args = p.parse_args(argv)
    total, runs = (256 * MiB, 3) if args.quick else (args.total_mib * MiB, args.runs)
    res = run(os.path.abspath(args.dir), total, args.page_mib * MiB, runs, args.chunk_mib * MiB)
    print(json.dumps(res, indent=2) if args.json else report(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
