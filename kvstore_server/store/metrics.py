"""The DRAM store's `kvstore_*` metrics, made from its stats when Prometheus scrapes.

The store keeps plain integer counters; this collector turns them into families only
when scraped, so the request path pays nothing for them. DRAM's capacity, use and pages
are the same three gauges every tier registers (tier_metrics.py); the tiers below
register their own (Store.register_metrics hands them the registry).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

from prometheus_client.core import HistogramMetricFamily, Metric

from ..tier import TierName
from ..tier_metrics import counter, gauge, tier_gauges
from .stats import StoreStats
from .timed_lock import BUCKETS

__all__ = ["StoreCollector"]


class StoreCollector:
    """DRAM's gauges and counters, the store's leases and pins, its lock's holds."""

    def __init__(self, stats: Callable[[], StoreStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        tier: str = TierName.DRAM
        yield from tier_gauges(tier, s.capacity_bytes, s.used_bytes, s.pages)
        yield gauge("kvstore_leases", "Live leases", None, s.leases)
        # Pins as pages, each page once however many leases pin it (StoreStats).
        yield gauge("kvstore_leased_pages", "Pages pinned by a live lease", None,
                    s.leased_pages)
        yield gauge("kvstore_held_back_pages", "Pages pinned a while after their lease "
                    "expired, in case its client is only slow", None, s.held_back_pages)
        yield gauge("kvstore_held_back_leases", "Expired leases whose pages are held back",
                    None, s.held_back_leases)
        yield gauge("kvstore_pinned_pages", "Pages pinned by a live lease, held back "
                    "after one, or retained by a session: eviction cannot take them", None,
                    s.pinned_pages)
        # Sessions' retention (retention.py)
        yield gauge("kvstore_retained_pages", "Pages a session keeps in DRAM for its TTL",
                    None, s.retained_pages)
        yield gauge("kvstore_retention_sessions", "Retention sessions held", None,
                    s.retention_sessions)
        yield counter("kvstore_retention_refused", "Retains refused: over a tenant's "
                      "retention quota or session cap, or retention off", None,
                      s.retention_refused)
        # Lookups count a page each time it is looked up (an engine asks again for a
        # waiting request at every step); pages served count what was read.
        yield counter("kvstore_hits", "Pages found by lookups (a page looked up again "
                      "counts again; pages served: kvstore_served_pages)", tier, s.hits)
        yield counter("kvstore_misses", "Pages a lookup asked for and did not find", tier,
                      s.misses)
        yield counter("kvstore_served_pages", "Pages served from the store: handed out by "
                      "Acquire or Get, or read under a lookup's pins", tier, s.served)
        yield counter("kvstore_evictions", "Pages evicted", tier, s.evictions)
        yield counter("kvstore_bytes_in", "Page bytes stored", tier, s.bytes_in)
        yield counter("kvstore_bytes_out", "Page bytes served", tier, s.bytes_out)
        holds = s.lock
        if holds is not None:
            h = HistogramMetricFamily("kvstore_store_lock_hold_seconds",
                                      "How long each hold of the store's lock lasted")
            # counts has one more entry than BUCKETS: the holds past the last, as +Inf.
            cumulative = list(itertools.accumulate(holds.counts))
            h.add_metric([], [(str(b), c) for b, c in zip(BUCKETS, cumulative, strict=False)]
                         + [("+Inf", cumulative[-1])], holds.total_seconds)
            yield h
            yield gauge("kvstore_store_lock_hold_max_seconds",
                        "Longest hold of the store's lock since start", None,
                        holds.max_seconds)
