"""Time kvstore_server.store.index.KeyIndex against a dict of bytes -> int, the index it replaces.

Run from a checkout: `python bench/index_bench.py [--entries 1000000] [--runs 500]`.
Prints medians. Lookups are measured in interleaved rounds, so load from other work on
the machine falls on both contenders alike; each run looks up a random contiguous range
of the stored keys, as a prompt's prefix would. The dict side includes splitting the
packed keys into bytes objects, as the server must; "probe only" leaves that out.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import numpy as np

try:
    from kvstore_server.store.index import KeyIndex
except ModuleNotFoundError:  # run as a script from a checkout, not installed
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from kvstore_server.store.index import KeyIndex

KEY_SIZE = 16
BATCH = 10_000


def make_keys(n: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    """(n, 16) uint8: random bytes (real keys are xxh3 digests) or b"good-key%08d"."""
    if kind == "random":
        return rng.integers(0, 256, (n, KEY_SIZE), dtype=np.uint8)
    digits = np.char.zfill(np.arange(n).astype("U8"), 8).astype("S8")
    keys = np.empty((n, KEY_SIZE), dtype=np.uint8)
    keys[:, :8] = np.frombuffer(b"good-key", dtype=np.uint8)
    keys[:, 8:] = digits.view(np.uint8).reshape(n, 8)
    return keys


def split(packed: bytes) -> list[bytes]:
    return [packed[i:i + KEY_SIZE] for i in range(0, len(packed), KEY_SIZE)]


def us(seconds: list[float]) -> str:
    return f"{statistics.median(seconds) * 1e6:9.1f} us"


def bench(kind: str, entries: int, runs: int, lookup: int) -> None:
    rng = np.random.default_rng(1)
    keys = make_keys(entries, kind, rng)
    packed = keys.tobytes()
    print(f"\n{kind} keys, {entries:,} entries, {lookup} keys per lookup")

    index, table = KeyIndex(KEY_SIZE), {}
    t_index, t_dict = [], []
    for lo in range(0, entries, BATCH):
        hi = min(lo + BATCH, entries)
        t0 = time.perf_counter()
        index.insert(packed[lo * KEY_SIZE:hi * KEY_SIZE], np.arange(lo, hi))
        t1 = time.perf_counter()
        table.update(zip(split(packed[lo * KEY_SIZE:hi * KEY_SIZE]), range(lo, hi)))
        t2 = time.perf_counter()
        t_index.append(t1 - t0)
        t_dict.append(t2 - t1)
    print(f"insert, batches of {BATCH:,}: KeyIndex total {sum(t_index):.3f} s "
          f"(median batch {us(t_index)}); dict total {sum(t_dict):.3f} s "
          f"(median batch {us(t_dict)})")

    absent = make_keys(lookup, "random", np.random.default_rng(2)).tobytes()
    times: dict[str, list[float]] = {name: [] for name in
                                     ("find", "find absent", "dict", "dict probe only")}
    for _ in range(runs):
        lo = int(rng.integers(0, entries - lookup))
        query = packed[lo * KEY_SIZE:(lo + lookup) * KEY_SIZE]
        t0 = time.perf_counter()
        found = index.find(query)
        t1 = time.perf_counter()
        index.find(absent)
        t2 = time.perf_counter()
        got = list(map(table.get, split(query)))
        t3 = time.perf_counter()
        parts = split(query)
        t4 = time.perf_counter()
        list(map(table.get, parts))
        t5 = time.perf_counter()
        if found.tolist() != got:
            raise SystemExit("KeyIndex and dict disagree")
        for name, t in zip(times, (t1 - t0, t2 - t1, t3 - t2, t5 - t4)):
            times[name].append(t)
    for name, t in times.items():
        print(f"lookup of {lookup}, {name:16s} {us(t)}")

    sample = split(packed[: 10_000 * KEY_SIZE])
    per_key = sum(map(sys.getsizeof, sample)) / len(sample)  # the bytes objects
    per_int = 32                                          # an int above 256, rounded
    dict_bytes = sys.getsizeof(table) / len(table) + per_key + per_int
    print(f"memory per entry: KeyIndex {index.nbytes / len(index):.1f} B "
          f"(table {index._table.nbytes / len(index):.1f} + reverse map "
          f"{index._pos.nbytes / len(index):.1f}); dict {dict_bytes:.1f} B")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstore-bench index",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--lookup", type=int, default=4096)
    parser.add_argument("--keys", choices=("random", "structured", "both"), default="both")
    args = parser.parse_args(argv)
    for kind in ("random", "structured") if args.keys == "both" else (args.keys,):
        bench(kind, args.entries, args.runs, args.lookup)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
