"""Prometheus metrics: RPC latency histograms, plus the store's counters read at scrape time.

The store keeps plain integer counters; a custom collector turns them into `kvstore_*`
metrics only when Prometheus scrapes, so the request path pays nothing for metrics
beyond one histogram observation per RPC. Metrics live in a registry of our own (no
global state), served on 127.0.0.1:`--metrics-port`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from .rpc_tally import RpcTally
from .store.stats import StoreStats
from .store.timed_lock import BUCKETS
from .tier import TierName

__all__ = ["Metrics"]


class _StoreCollector:
    def __init__(self, stats: Callable[[], StoreStats], extra: Callable[[], dict]) -> None:
        self._stats = stats
        self._extra = extra

    def collect(self):
        s = self._stats()
        tier: str = TierName.DRAM
        yield _gauge("kvstore_capacity_bytes", "Capacity of each tier", tier, s.capacity_bytes)
        yield _gauge("kvstore_used_bytes", "Bytes of slots in use per tier", tier, s.used_bytes)
        yield _gauge("kvstore_pages", "Pages stored per tier", tier, s.pages)
        yield _gauge("kvstore_leases", "Live leases", None, s.leases)
        # Pins as pages, each page once however many leases pin it (StoreStats).
        yield _gauge("kvstore_leased_pages", "Pages pinned by a live lease", None,
                     s.leased_pages)
        yield _gauge("kvstore_held_back_pages", "Pages pinned a while after their lease "
                     "expired, in case its client is only slow", None, s.held_back_pages)
        yield _gauge("kvstore_held_back_leases", "Expired leases whose pages are held back",
                     None, s.held_back_leases)
        yield _gauge("kvstore_pinned_pages", "Pages pinned by a live lease, held back "
                     "after one, or retained by a session: eviction cannot take them", None,
                     s.pinned_pages)
        # Sessions' retention (kvstore_server.store.retention)
        yield _gauge("kvstore_retained_pages", "Pages a session keeps in DRAM for its TTL",
                     None, s.retained_pages)
        yield _gauge("kvstore_retention_sessions", "Retention sessions held", None,
                     s.retention_sessions)
        yield _counter("kvstore_retention_refused", "Retains refused: over a tenant's "
                       "retention quota or session cap, or retention off", None,
                       s.retention_refused)
        # Lookups count a page each time it is looked up (an engine asks again for a
        # waiting request at every step); pages served count what was read.
        yield _counter("kvstore_hits", "Pages found by lookups (a page looked up again "
                       "counts again; pages served: kvstore_served_pages)", tier, s.hits)
        yield _counter("kvstore_misses", "Pages a lookup asked for and did not find", tier, s.misses)
        yield _counter("kvstore_served_pages", "Pages served from the store: handed out by "
                       "Acquire or Get, or read under a lookup's pins", tier, s.served)
        yield _counter("kvstore_evictions", "Pages evicted", tier, s.evictions)
        yield _counter("kvstore_bytes_in", "Page bytes stored", tier, s.bytes_in)
        yield _counter("kvstore_bytes_out", "Page bytes served", tier, s.bytes_out)
        for lower in s.tiers:
            tier = lower.name
            yield _gauge("kvstore_capacity_bytes", "Capacity of each tier", tier,
                         lower.capacity_bytes)
            yield _gauge("kvstore_used_bytes", "Bytes of slots in use per tier", tier,
                         lower.used_bytes)
            yield _gauge("kvstore_pages", "Pages stored per tier", tier, lower.pages)
        # Each tier's own series (kvstore_disk_*, kvstore_far_*) come from the collector it
        # registered (disk_stats.DiskCollector, far/metrics.FarCollector).
        holds = s.lock
        if holds is not None:
            h = HistogramMetricFamily("kvstore_store_lock_hold_seconds",
                                      "How long each hold of the store's lock lasted")
            # counts has one more entry than BUCKETS: the holds past the last, as +Inf.
            cumulative = list(itertools.accumulate(holds.counts))
            h.add_metric([], [(str(b), c) for b, c in zip(BUCKETS, cumulative, strict=False)]
                         + [("+Inf", cumulative[-1])], holds.total_seconds)
            yield h
            yield _gauge("kvstore_store_lock_hold_max_seconds",
                         "Longest hold of the store's lock since start", None, holds.max_seconds)
        for name, (kind, doc, value) in self._extra().items():
            yield (_gauge if kind == "gauge" else _counter)(name, doc, None, value)


def _gauge(name, doc, tier, value):
    g = GaugeMetricFamily(name, doc, labels=["tier"] if tier else [])
    g.add_metric([tier] if tier else [], value)
    return g


def _counter(name, doc, tier, value):
    c = CounterMetricFamily(name, doc, labels=["tier"] if tier else [])
    c.add_metric([tier] if tier else [], value)
    return c


class Metrics:
    """Per-RPC latency and outcome; store gauges and counters at scrape time."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        # kvstore_rpc_duration_seconds and kvstore_rpc_total, counted per thread without
        # a lock and summed at scrape (rpc_tally.py says why).
        self._rpcs = RpcTally()
        self.registry.register(self._rpcs)
        self._server: Any = None        # the HTTP server, once serve() started it

    def observe(self, method: str, seconds: float, code: grpc.StatusCode) -> None:
        self._rpcs.observe(method, seconds, code)

    def refused(self, method: str, code: grpc.StatusCode) -> None:
        """A call refused before any handler ran (auth): counted, with no latency."""
        self._rpcs.refused(method, code)

    def watch_store(self, stats: Callable[[], StoreStats],
                    extra: Callable[[], dict] = lambda: {}) -> None:
        self.registry.register(_StoreCollector(stats, extra))

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        """Serve /metrics over HTTP (a daemon thread)."""
        self._server, _ = start_http_server(port, addr=addr, registry=self.registry)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None
