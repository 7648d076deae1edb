"""A hybrid model's host pools are refused at registration, with one line (SGLang 0.5.23).

SGLang's hybrid cache controller (hybrid_cache_controller.attach_storage_backend) builds
the backend, registers the anchor pool (register_mem_pool_host), then each side pool by
name (register_mem_host_pool_v2: Mamba state, sliding-window KV, ...); an exception there
fails the storage attach at start-up. The backend stores MHA and MLA pages only, so a
side pool, or an anchor that is a group of pools, is refused rather than stored as MHA.
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang", reason="needs SGLang 0.5.23 (scripts/venv-sglang.sh)")

import torch
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

from kvstore_bench.sglang_bench import host_pool, make_backend, storage_config
from kvstore_client import KVStoreClient


def _mamba_pool() -> MambaPoolHost:
    """SGLang's own Mamba state host pool on CPU: 2 layers, 8 state slots."""
    info = MambaStateBufferInfo(temporal=torch.zeros(2, 8, 4, 16),
                                conv=(torch.zeros(2, 8, 3, 32),))
    return MambaPoolHost(info, 2.0, 0, device_capacity=8, pin_memory=False, device="cpu",
                         layout="page_first")


def _layouts(address: str) -> int:
    with KVStoreClient(address) as c:
        return len(c.stats().layouts)


def test_a_mamba_side_pool_is_refused_with_one_line(store):
    anchor = host_pool("mha", "page_first")
    backend = make_backend(storage_config(store.address), anchor)   # an MHA model: fine
    with pytest.raises(ValueError) as info:
        backend.register_mem_host_pool_v2(_mamba_pool(), PoolName.MAMBA)
    message = str(info.value)
    assert "\n" not in message
    assert "'mamba'" in message and "MambaPoolHost" in message and "hybrid" in message


def test_an_anchor_that_groups_pools_is_refused_with_one_line(store):
    anchor = host_pool("mha", "page_first")
    group = HostPoolGroup([
        PoolEntry(PoolName.KV, anchor, None, lambda layer: layer, is_primary_index_anchor=True),
        PoolEntry(PoolName.MAMBA, _mamba_pool(), None, lambda layer: layer)])
    before = _layouts(store.address)
    with pytest.raises(ValueError) as info:
        make_backend(storage_config(store.address), group)
    message = str(info.value)
    assert "\n" not in message and "HostPoolGroup" in message
    assert _layouts(store.address) == before          # nothing registered in the store
