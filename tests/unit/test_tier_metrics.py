"""Each tier registers its own gauges: a registry given to a tier, a chain or the store
holds every level's capacity, use and pages, and the null tier adds nothing."""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry

from kvstore_server.disk.tier import DiskTier
from kvstore_server.region import Region
from kvstore_server.store import Store
from kvstore_server.tier import NullTier, TierChain

MiB = 1 << 20
LAYOUT = bytes(range(16))


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in registry.collect() for s in family.samples}


def test_the_null_tier_registers_nothing():
    registry = CollectorRegistry()
    NullTier().register_metrics(registry)
    TierChain([NullTier()]).register_metrics(registry)
    assert samples(registry) == {}


def test_a_disk_tier_registers_its_gauges_and_its_own_families(tmp_path):
    tier = DiskTier(str(tmp_path / "d"), 16 * MiB)
    try:
        assert tier.offer(LAYOUT, b"k" * 16, np.full(8192, 7, dtype=np.uint8))
        assert tier.flush(10) == 0
        registry = CollectorRegistry()
        TierChain([tier]).register_metrics(registry)       # a chain registers its members
        got = samples(registry)
        stats = tier.stats()
        disk = (("tier", "disk"),)
        assert got[("kvstore_capacity_bytes", disk)] == 16 * MiB == stats.capacity_bytes
        assert got[("kvstore_used_bytes", disk)] == stats.used_bytes > 0
        assert got[("kvstore_pages", disk)] == stats.pages == 1
        assert got[("kvstore_disk_writes_total", ())] == 1
        assert got[("kvstore_disk_failed", ())] == 0
    finally:
        tier.close()


def test_the_store_registers_dram_and_hands_the_registry_to_its_tiers(tmp_path):
    region = Region(4 * MiB, str(tmp_path))
    tier = DiskTier(str(tmp_path / "d"), 16 * MiB)
    try:
        store = Store(region, lower=TierChain([tier]))
        registry = CollectorRegistry()
        store.register_metrics(registry)
        got = samples(registry)
        assert got[("kvstore_capacity_bytes", (("tier", "dram"),))] == \
            store.stats().capacity_bytes > 0
        assert got[("kvstore_capacity_bytes", (("tier", "disk"),))] == 16 * MiB
        assert ("kvstore_leases", ()) in got and ("kvstore_disk_reads_total", ()) in got
    finally:
        tier.close()
        region.close()
