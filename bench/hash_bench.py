"""Time connector.scheduler.hashing.page_keys against naive chained loops (sha256 and xxh3).

Run from a checkout: `python bench/hash_bench.py [--page-tokens 16] [--runs 1000]`.
Prints the median of many single calls per prompt length. The contenders are measured in
interleaved rounds, so load from other work on the machine falls on all of them alike.
"""

from __future__ import annotations

import argparse
import hashlib
import pathlib
import statistics
import sys
import timeit
from collections.abc import Callable

import numpy as np
import xxhash

try:
    from kvstore_connector.scheduler.hashing import page_keys
except ModuleNotFoundError:  # run as a script from a checkout, not installed
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from kvstore_connector.scheduler.hashing import page_keys

SEED = bytes(range(16))
LENGTHS = (1024, 4096, 16384, 32768)
ROUNDS = 10  # runs are split into this many interleaved rounds


def naive_chain(ids: np.ndarray, page_tokens: int, seed: bytes, digest) -> list[bytes]:
    """The same chain, written the obvious way: slice, concatenate, hash, append."""
    data, width, key, keys = ids.tobytes(), 4 * page_tokens, seed, []
    for i in range(len(ids) // page_tokens):
        key = digest(key + data[i * width:(i + 1) * width])
        keys.append(key)
    return keys


def sha256_digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()[:16]


def medians(calls: dict[str, Callable[[], object]], runs: int) -> dict[str, float]:
    """Median seconds of one call of each, over `runs` calls (timeit turns gc off)."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(ROUNDS):
        for name, call in calls.items():
            times[name] += timeit.repeat(call, number=1, repeat=max(runs // ROUNDS, 1))
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstore-bench hash",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--page-tokens", type=int, default=16)
    parser.add_argument("--runs", type=int, default=1000, help="calls timed per contender")
    args = parser.parse_args(argv)
    p = args.page_tokens
    rng = np.random.default_rng(0)

    print(f"page_tokens={p}, median of {args.runs} calls each, int32 numpy input")
    print(f"{'tokens':>7} {'pages':>6} {'page_keys':>11} {'naive xxh3':>11} "
          f"{'naive sha256':>13} {'sha256/ours':>12}")
    for n in LENGTHS:
        ids = rng.integers(0, 152_000, n, dtype=np.int32)
        assert page_keys(ids, p, SEED) == naive_chain(ids, p, SEED, xxhash.xxh3_128_digest)
        m = medians({
            "ours": lambda: page_keys(ids, p, SEED),
            "xxh3": lambda: naive_chain(ids, p, SEED, xxhash.xxh3_128_digest),
            "sha256": lambda: naive_chain(ids, p, SEED, sha256_digest),
        }, args.runs)
        print(f"{n:>7} {n // p:>6} {m['ours'] * 1e6:>8.1f} us {m['xxh3'] * 1e6:>8.1f} us "
              f"{m['sha256'] * 1e6:>10.1f} us {m['sha256'] / m['ours']:>11.1f}x")

    n = LENGTHS[-1]
    ids = rng.integers(0, 152_000, n, dtype=np.int32)
    per_page = [b"mm:" + bytes(16) if i % 8 == 0 else None for i in range(n // p)]
    m = medians({
        "plain": lambda: page_keys(ids, p, SEED),
        "shared": lambda: page_keys(ids, p, SEED, extra=b"lora:adapter-7"),
        "per_page": lambda: page_keys(ids, p, SEED, extra=per_page),
        "list": lambda: page_keys(ids.tolist(), p, SEED),
    }, args.runs // 2)
    print(f"{n} tokens: plain {m['plain'] * 1e6:.1f} us, shared extra "
          f"{m['shared'] * 1e6:.1f} us, per-page extras {m['per_page'] * 1e6:.1f} us, "
          f"from a Python list {m['list'] * 1e6:.1f} us (mostly np.asarray)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
