"""The disk tier's numbers: its stats value, the event counters behind it, and the
`kvstore_disk_*` metrics made from them at scrape time (as far/metrics.py does for the
far tier: the tier registers its own families, the store's collector knows no tier)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..tier import TierStats

__all__ = ["DiskCollector", "DiskCounters", "DiskStats"]


@dataclasses.dataclass(frozen=True, slots=True)
class DiskStats(TierStats):
    """The disk tier's counters: TierStats and its queue, restart and I/O mode."""

    pages_by_layout: dict[bytes, int] = dataclasses.field(default_factory=dict)
    queued_pages: int = 0
    queued_bytes: int = 0
    queue_capacity_bytes: int = 0
    rebuilt_pages: int = 0          # found on disk at start
    undurable_deletes: int = 0      # deletes that returned before their slots were blank
    direct_io: bool = False
    rebuild_seconds: float = 0.0


@dataclasses.dataclass(slots=True)
class DiskCounters:
    """Events since start, named fields so that a typo is an error, not a new counter."""

    reads: int = 0
    bytes_read: int = 0
    writes: int = 0
    bytes_written: int = 0
    drops: int = 0
    refused: int = 0
    corrupt_pages: int = 0
    read_errors: int = 0
    evictions: int = 0
    rebuilt_pages: int = 0
    undurable_deletes: int = 0


class DiskCollector:
    """kvstore_disk_* families from the disk tier's stats, read when scraped."""

    def __init__(self, stats: Callable[[], DiskStats]) -> None:
        self._stats = stats

    def collect(self):
        s = self._stats()
        for name, doc, value in (
                ("kvstore_disk_reads", "Pages read back from disk", s.reads),
                ("kvstore_disk_writes", "Pages written to disk", s.writes),
                ("kvstore_disk_drops", "Pages not spilled: write queue full", s.drops),
                ("kvstore_disk_corrupt_pages", "Disk pages whose checksum failed (dropped, "
                 "never served)", s.corrupt_pages)):
            family = CounterMetricFamily(name, doc)
            family.add_metric([], value)
            yield family
        failed = GaugeMetricFamily("kvstore_disk_failed",
                                   "1 when disk writes stopped (full or failing)")
        failed.add_metric([], int(s.failed))
        yield failed
