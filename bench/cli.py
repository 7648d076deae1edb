"""kvstore-bench: one entry point for the benchmarks (`kvstore-bench store --quick`)."""

from __future__ import annotations

import importlib
import sys

__all__ = ["BENCHES", "main"]

# name -> module under kvstore_bench with a main(argv) -> int whose parser is named
# "kvstore-bench NAME", so its --help and its errors show the command a user typed.
BENCHES = {
    "store": "store_bench",
    "fastpath": "fastpath_bench",
    "fastpath-netns": "netns_bench",
    "hash": "hash_bench",
    "index": "index_bench",
    "pins": "pins_bench",
    "shm": "shm_bench",
    "load": "load_bench",
    "hooks": "hooks_bench",
    "remote-load": "remote_load_bench",
    "e2e": "e2e_bench",
    "hybrid": "hybrid_bench",
    "disk": "disk_bench",
    "sglang": "sglang_bench",
    "load-test": "load_test",
    "kill-test": "kill_test",
    "limits": "limits_bench",
    "admit": "admit_bench",
    "far": "far_bench",
    "far-failover": "far_failover",
    "peers": "peers_bench",
    "report": "report",         # not a bench: renders the records (see report.py)
}

USAGE = ("usage: kvstore-bench [--record DIR] {" + ",".join(BENCHES) + "} [options]\n\n"
         "Runs one benchmark; `kvstore-bench NAME --help` lists its options.\n"
         "--record DIR keeps what it printed, with the machine, date and command, as a\n"
         "record in DIR (docs/perf); `kvstore-bench report` renders the records into\n"
         "docs/performance.md.")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)                    # asked for: stdout, exit 0, as argparse does
        return 0
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    record = None
    if argv[0] == "--record":
        if len(argv) < 3:
            print("kvstore-bench: --record needs a folder and a benchmark", file=sys.stderr)
            return 2
        record, argv = argv[1], argv[2:]
    if argv[0] not in BENCHES:
        print(f"kvstore-bench: unknown benchmark {argv[0]!r} (one of: "
              f"{', '.join(BENCHES)})", file=sys.stderr)
        return 2
    module = importlib.import_module(f"kvstore_bench.{BENCHES[argv[0]]}")
    if record is not None and argv[0] != "report":
        from .record import run_recorded
        return run_recorded(record, argv[0], argv[1:], module.main)
    return module.main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
