"""kvstore-bench: one entry point for the benchmarks (`kvstore-bench store --quick`)."""

from __future__ import annotations

import importlib
import sys

# name -> module under kvstore_bench with a main(argv) -> int
BENCHES = {
    "store": "store_bench",
    "fastpath": "fastpath_bench",
    "hash": "hash_bench",
    "shm": "shm_bench",
    "load": "load_bench",
    "e2e": "e2e_bench",
    "disk": "disk_bench",
    "sglang": "sglang_bench",
    "load-test": "load_test",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHES:
        print("usage: kvstore-bench {" + ",".join(BENCHES) + "} [options]\n"
              "each benchmark takes --help", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(f"kvstore_bench.{BENCHES[argv[0]]}")
    return module.main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
