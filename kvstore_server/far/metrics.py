"""The far tier's counters, and the `kvstore_far_*` metrics made from them at scrape time.

As in kvstore_server.metrics: the request path bumps plain integers (under one lock,
once per call, never per key) and a collector turns them into Prometheus families only
when scraped, in the server's own registry (FarTier.register_metrics registers it).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .codec import ValueVerdict

__all__ = ["FarCollector", "FarCounters"]


@dataclasses.dataclass(slots=True)
class FarCounters:
    """Totals since start. Mutable on purpose: bumped in place by add()."""

    hits: int = 0               # keys found (exists) or pages served (get)
    misses: int = 0             # keys asked for and not found, for any reason
    bytes_read: int = 0         # payload bytes served from the far tier
    pages_read: int = 0         # pages served (get), of the hits
    bytes_written: int = 0      # payload bytes stored in it
    pages_written: int = 0
    errors: int = 0             # commands or calls that failed (timeout, refused, down)
    skipped: int = 0            # calls not made: breaker open
    drops: int = 0              # pages not written: write queue full
    deletes_retried: int = 0    # deleted keys sent again (the cluster had not confirmed)
    deletes_dropped: int = 0    # deleted keys not retried: too many already waiting
    deletes_pending: int = 0    # a gauge, set by writer.py: deleted keys and clears that
                                # the cluster has not confirmed yet
    rejected: dict = dataclasses.field(default_factory=dict)   # ValueVerdict -> values refused
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def reject(self, reason: ValueVerdict, n: int = 1) -> None:
        with self._lock:
            self.rejected[reason] = self.rejected.get(reason, 0) + n


class FarCollector:
    """kvstore_far_* families from the counters, the queue depth and the breaker state."""

    def __init__(self, counters: FarCounters, queue_depth: Callable[[], tuple[int, int]],
                 breaker_state: Callable[[], int],
                 watch: Callable[[], tuple[int, int]] = lambda: (0, 0)) -> None:
        self._c = counters
        self._queue_depth = queue_depth         # () -> (pages, bytes) waiting
        self._breaker_state = breaker_state
        self._watch = watch                     # () -> (pages watched, reported gone)

    def collect(self):
        c = self._c
        for name, doc, value in (
                ("kvstore_far_hits", "Keys found or pages served by the far tier", c.hits),
                ("kvstore_far_misses", "Keys asked of the far tier and not found", c.misses),
                ("kvstore_far_bytes_read", "Page bytes served from the far tier", c.bytes_read),
                ("kvstore_far_bytes_written", "Page bytes written to the far tier",
                 c.bytes_written),
                ("kvstore_far_pages_written", "Pages written to the far tier",
                 c.pages_written),
                ("kvstore_far_errors", "Far calls or commands that failed (answered as "
                 "misses)", c.errors),
                ("kvstore_far_skipped", "Far calls not made: breaker open", c.skipped),
                ("kvstore_far_queue_drops", "Pages not written: write-behind queue full",
                 c.drops),
                ("kvstore_far_deletes_retried", "Deleted keys sent to the cluster again: "
                 "their first UNLINK was not confirmed", c.deletes_retried),
                ("kvstore_far_deletes_dropped", "Deleted keys not retried: too many deletes "
                 "already waited for the cluster", c.deletes_dropped)):
            family = CounterMetricFamily(name, doc)
            family.add_metric([], value)
            yield family
        rejected = CounterMetricFamily(
            "kvstore_far_rejected", "Values in the cluster refused (never served), by reason",
            labels=["reason"])
        for reason in (r for r in ValueVerdict if r not in (ValueVerdict.OK, ValueVerdict.MISSING)):
            rejected.add_metric([reason.value], c.rejected.get(reason, 0))
        yield rejected
        pages, nbytes = self._queue_depth()
        depth = GaugeMetricFamily("kvstore_far_queue_depth",
                                  "Pages waiting in the write-behind queue")
        depth.add_metric([], pages)
        yield depth
        qbytes = GaugeMetricFamily("kvstore_far_queue_bytes",
                                   "Bytes waiting in the write-behind queue")
        qbytes.add_metric([], nbytes)
        yield qbytes
        pending = GaugeMetricFamily("kvstore_far_deletes_pending",
                                    "Deleted keys and clears the cluster has not confirmed "
                                    "yet (retried until it does)")
        pending.add_metric([], c.deletes_pending)
        yield pending
        watched, gone = self._watch()
        watching = GaugeMetricFamily("kvstore_far_watched_pages",
                                     "Pages only the far tier holds for this server, checked "
                                     "for removals the cluster makes by itself (watch.py)")
        watching.add_metric([], watched)
        yield watching
        found = CounterMetricFamily("kvstore_far_removals_found",
                                    "Watched pages the cluster no longer held (TTL, its "
                                    "eviction, a failed write, another server's delete), "
                                    "reported to the removal ring")
        found.add_metric([], gone)
        yield found
        state = GaugeMetricFamily("kvstore_far_breaker_state",
                                  "Far tier breaker: 0 closed, 1 open, 2 half-open")
        state.add_metric([], int(self._breaker_state()))
        yield state
