"""Each tier's own gauges: its capacity, bytes in use and pages, labelled by its name.

Every tier registers what it reports in the server's registry itself
(`Tier.register_metrics`, `Store.register_metrics` for DRAM): the series below come from
the tier they describe, beside the tier's own families (kvstore_disk_*, kvstore_far_*),
and nothing in the metrics module knows which tiers a server has. The null tier
registers nothing. Read when Prometheus scrapes, from the tier's stats.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .tier import TierStats

__all__ = ["TierGauges", "counter", "gauge", "tier_gauges"]


def gauge(name: str, doc: str, tier: str | None, value: float) -> GaugeMetricFamily:
    """One gauge, labelled `tier` when one is named."""
    g = GaugeMetricFamily(name, doc, labels=["tier"] if tier else [])
    g.add_metric([tier] if tier else [], value)
    return g


def counter(name: str, doc: str, tier: str | None, value: float) -> CounterMetricFamily:
    """One counter, labelled `tier` when one is named."""
    c = CounterMetricFamily(name, doc, labels=["tier"] if tier else [])
    c.add_metric([tier] if tier else [], value)
    return c


def tier_gauges(tier: str, capacity_bytes: int, used_bytes: int,
                pages: int) -> Iterator[GaugeMetricFamily]:
    """kvstore_capacity_bytes, kvstore_used_bytes and kvstore_pages of one tier."""
    yield gauge("kvstore_capacity_bytes", "Capacity of each tier", tier, capacity_bytes)
    yield gauge("kvstore_used_bytes", "Bytes of slots in use per tier", tier, used_bytes)
    yield gauge("kvstore_pages", "Pages stored per tier", tier, pages)


class TierGauges:
    """A tier's three gauges for each of its levels, read from levels() when scraped."""

    def __init__(self, levels: Callable[[], tuple[TierStats, ...]]) -> None:
        self._levels = levels

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for level in self._levels():
            yield from tier_gauges(level.name, level.capacity_bytes, level.used_bytes,
                                   level.pages)
