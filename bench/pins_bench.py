"""Pin counts of a leased Lookup and its release, in the store itself: SlotTable.add_pins
against np.add.at, the way it counted before.

A leased Lookup pins each page it counts and its release unpins them, under the store's
lock. A 32k-token prompt of 16-token pages is 2,048 pages; a key may repeat in a
request, so the count must add once per entry, which np.add.at does, entry by entry.
add_pins adds by fancy indexing once it has found no repeat. Both run in interleaved
rounds in one process (load on the machine falls on both alike); medians.

    kvstore-bench pins [--pages 2048,16384] [--runs 300]
"""

from __future__ import annotations

import argparse
import statistics
import time
import types

import numpy as np

from kvstore_client import PageLayout
from kvstore_protocol.keys import Packed
from kvstore_server.region import Region
from kvstore_server.store import Store
from kvstore_server.store.slots import SlotTable

# A small page, so that a store of every size here fits in a modest region.
LAYOUT = PageLayout(model="bench-pins", num_layers=2, page_tokens=16, num_kv_heads=1,
                    head_size=32)


def _add_at(self: SlotTable, slots: np.ndarray, delta: int) -> None:
    """SlotTable.add_pins as it was: np.add.at for every entry."""
    np.add.at(self.pins, slots, delta)


def run(pages: int, runs: int) -> dict[str, float]:
    """Median microseconds of lookup_pinned + release of `pages` pages, each way."""
    region = Region(max(64 << 20, 2 * pages * LAYOUT.page_bytes))
    try:
        store = Store(region)
        info = store.register_layout(LAYOUT)
        keys = Packed.of([i.to_bytes(16, "little") for i in range(1, pages + 1)])
        store.commit(store.reserve(info.layout_id, keys).lease_id)
        table = store._slots                    # this store's own: patched on it alone
        ways = {"add_pins": table.add_pins, "np.add.at": types.MethodType(_add_at, table)}
        times: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(runs):
            for name, fn in ways.items():
                table.add_pins = fn                 # type: ignore[method-assign]
                t0 = time.perf_counter()
                count, lease_id, _ = store.lookup_pinned([info.layout_id], keys, 30.0)
                store.release(lease_id)
                times[name].append(time.perf_counter() - t0)
                if count != pages or store.stats().leased_pages:
                    raise SystemExit(f"{name}: counted {count} of {pages}, or pins left")
        return {name: statistics.median(t) * 1e6 for name, t in times.items()}
    finally:
        region.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstore-bench pins",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--pages", default="2048,16384",
                        help="pages a lookup counts, comma-separated")
    parser.add_argument("--runs", type=int, default=300, help="rounds (medians)")
    args = parser.parse_args(argv)
    try:
        sizes = [int(x) for x in args.pages.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--pages takes integers, got {args.pages!r}")
    if not sizes or min(sizes) < 1 or args.runs < 1:
        parser.error("--pages and --runs must be positive")
    print("leased Lookup + release in the store, medians of "
          f"{args.runs} interleaved rounds (us):\n")
    print("| pages | add_pins | np.add.at | ratio |")
    print("|---|---|---|---|")
    for pages in sizes:
        got = run(pages, args.runs)
        print(f"| {pages} | {got['add_pins']:.0f} | {got['np.add.at']:.0f} | "
              f"{got['np.add.at'] / got['add_pins']:.1f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
