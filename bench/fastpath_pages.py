"""The fast-path benches' shared pieces: their page layouts and their timing of a call.

fastpath_bench, fastpath_tls and netns_bench measure the same pages the same way; this
module is what they share, so none of them imports another.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvstore_client import PageLayout

__all__ = ["PAGE_1M", "PAGE_64K", "percentile_us", "timed"]

PAGE_1M = PageLayout(model="bench-fast-1m", num_layers=32, page_tokens=16, num_kv_heads=8,
                     head_size=64)
PAGE_64K = PageLayout(model="bench-fast-64k", num_layers=32, page_tokens=16, num_kv_heads=1,
                      head_size=32)


def timed(fn: Callable[[], object], iters: int) -> list[float]:
    """Seconds of each of `iters` calls of fn."""
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def percentile_us(times: list[float], q: float) -> float:
    """The q quantile of `times` (seconds), in microseconds."""
    return sorted(times)[min(len(times) - 1, int(len(times) * q))] * 1e6
