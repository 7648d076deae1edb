"""A tier is named by its TierName, never by a string: in its stats, in Inspect, and in
what an operator's `evict --tier` selects (tier.evict_targets, the one place a string is
read as a tier)."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore_protocol.layout import PageLayout
from kvstore_server.disk.tier import DiskTier
from kvstore_server.errors import Outcome, StoreError
from kvstore_server.region import Region
from kvstore_server.store import Store
from kvstore_server.tier import EVICTABLE, TierName, evict_targets

MiB = 1 << 20
LAYOUT = PageLayout(model="names", num_layers=1, page_tokens=16, num_kv_heads=1, head_size=32)


def test_an_operator_names_one_evictable_tier_or_all():
    assert evict_targets("all") == set(EVICTABLE) == {TierName.DRAM, TierName.DISK, TierName.FAR}
    for name in EVICTABLE:
        assert evict_targets(str(name)) == {name}
    for bad in ("chain", "none", "Disk", "", "dram "):
        with pytest.raises(ValueError, match="tier must be dram, disk, far or all"):
            evict_targets(bad)


@pytest.fixture
def store(tmp_path):
    region = Region(16 * MiB)
    disk = DiskTier(str(tmp_path / "disk"), 4 * MiB)
    try:
        yield Store(region, lower=disk)
    finally:
        disk.close()
        region.close()


def test_stats_and_inspect_name_tiers_by_their_enum(store):
    info = store.register_layout(LAYOUT)
    key = (1).to_bytes(16, "little")
    res = store.reserve(info.layout_id, [key])
    store.mem[res.offsets[0]:res.offsets[0] + info.page_bytes] = np.uint8(7)
    store.commit(res.lease_id)
    assert store.inspect(info.layout_id, key).tier is TierName.DRAM
    assert [t.name for t in store.stats().tiers] == [TierName.DISK]
    assert all(type(t.name) is TierName for t in store.stats().tiers)
    store.evict(everything=True, tier="dram")
    assert store.lower.flush(5.0) == 0
    assert store.inspect(info.layout_id, key).tier is TierName.DISK


def test_evict_refuses_a_tier_it_does_not_know_and_evicts_only_the_one_named(store):
    info = store.register_layout(LAYOUT)
    keys = [i.to_bytes(16, "little") for i in range(1, 5)]
    store.commit(store.reserve(info.layout_id, keys).lease_id)
    with pytest.raises(StoreError) as err:
        store.evict(everything=True, tier="chain")
    assert err.value.outcome is Outcome.INVALID
    assert store.evict(everything=True, tier="disk")[0] == 0      # nothing on disk yet
    assert store.evict(everything=True, tier="dram")[0] == 4      # DRAM -> disk
    assert store.lower.flush(5.0) == 0
    assert store.evict(everything=True, tier="disk")[0] == 4
    assert not store.exists(info.layout_id, keys).any()
