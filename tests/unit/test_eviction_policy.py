"""A second eviction policy plugs into DRAM and the disk tier by configuration alone.

tests/fifo_policy.py is one new file; nothing else knows it. Named by the server's
eviction_policy setting, both tiers evict in its order, and the eviction tests, unit and
integration (real servers), pass with it (KVSTORE_EVICTION_POLICY reaches both):
tests/integration/test_eviction_fifo.py runs them so.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstore_protocol.layout import PageLayout
from kvstore_server.config import load_config
from kvstore_server.disk.slotfile import slot_bytes_for
from kvstore_server.disk.tier import DiskTier
from kvstore_server.region import Region
from kvstore_server.store import Store
from kvstore_server.store.eviction import EvictionPolicy, load_policy

FIFO = "tests.fifo_policy"
MiB = 1 << 20
LAYOUT = PageLayout(model="fifo", num_layers=1, page_tokens=16, num_kv_heads=8,
                    head_size=128)                   # 64 KiB pages


def _keys(tag: str, n: int) -> list[bytes]:
    return [f"{tag}-{i}".encode().ljust(16, b"\0") for i in range(n)]


def test_policies_load_by_name_and_bad_names_say_why():
    assert isinstance(load_policy("lru")(), EvictionPolicy)
    assert isinstance(load_policy(FIFO)(), EvictionPolicy)
    with pytest.raises(ValueError, match="no eviction policy 'nope'"):
        load_policy("nope")
    with pytest.raises(ValueError, match="defines no POLICY"):
        load_policy("kvstore_server.errors")
    # A path is no module name: import_module raised TypeError and the start crashed.
    for bad in ("../../etc/passwd", "", "a..b", "/abs"):
        with pytest.raises(ValueError, match="is not a module name"):
            load_policy(bad)


def test_fifo_orders_both_tiers_when_configured(tmp_path):
    config = load_config(["--eviction-policy", FIFO], environ={})
    assert config.eviction_policy == FIFO
    # DRAM: the first page put is the first to go, though it was read last (under LRU
    # it would stay).
    region = Region(16 * MiB)
    try:
        store = Store(region, policy=config.eviction_policy)
        info = store.register_layout(LAYOUT)
        first, rest = _keys("a", 1), _keys("b", 8)
        for ks in (first, rest):
            res = store.reserve(info.layout_id, ks)
            store.commit(res.lease_id)
        store.release(store.acquire(info.layout_id, first).lease_id)     # a touch
        store.evict(nbytes=1)
        assert not store.exists(info.layout_id, first)[0]
        assert store.exists(info.layout_id, rest).all()
    finally:
        region.close()
    # Disk: room for 4 pages; key 0 read (touched) after all four were written, then
    # two more written: FIFO evicts keys 0 and 1, where LRU would keep key 0.
    size = 4096
    tier = DiskTier(str(tmp_path / "disk"), 4 * slot_bytes_for(size),
                    policy=config.eviction_policy)
    try:
        ks = _keys("d", 6)
        for k in ks[:4]:
            assert tier.offer(LAYOUT.layout_id, k, np.full(size, k[2], np.uint8))
        assert tier.flush(10) == 0
        assert tier.read_into(LAYOUT.layout_id, ks[:1], [np.empty(size, np.uint8)]) == [True]
        for k in ks[4:]:
            assert tier.offer(LAYOUT.layout_id, k, np.full(size, k[2], np.uint8))
        assert tier.flush(10) == 0
        assert tier.contains(LAYOUT.layout_id, ks).tolist() == [False, False] + [True] * 4
    finally:
        tier.close()
