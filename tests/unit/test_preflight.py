"""preflight.check_host against memory figures given by the test (the host's own are
exercised by tests/integration/test_startup.py)."""

from __future__ import annotations

import pytest

from kvstore_server.config import ConfigError, ServerConfig
from kvstore_server.preflight import HostMemory, check_host, host_memory
from kvstore_server.region import region_bytes

GiB = 1 << 30


def check(dram: int, memory: HostMemory, tmp_path) -> None:
    config = ServerConfig(dram=dram, shm_dir=str(tmp_path))
    check_host(config, region_bytes(dram), memory)


def test_pool_within_memory_passes(tmp_path):
    check(1 * GiB, HostMemory(available=4 * GiB, cgroup_left=4 * GiB), tmp_path)
    check(1 * GiB, HostMemory(available=None, cgroup_left=None), tmp_path)


def test_pool_over_mem_available(tmp_path):
    with pytest.raises(ConfigError, match=r"^dram: 2\.0 GiB .* available memory \(1\.0 GiB"):
        check(2 * GiB, HostMemory(available=1 * GiB, cgroup_left=None), tmp_path)


def test_pool_over_the_cgroup_limit(tmp_path):
    with pytest.raises(ConfigError, match=r"^dram: 2\.0 GiB .* cgroup .*512\.0 MiB"):
        check(2 * GiB, HostMemory(available=8 * GiB, cgroup_left=512 << 20), tmp_path)


def test_host_memory_reads_this_host():
    memory = host_memory()
    assert memory.available is not None and memory.available > 0
