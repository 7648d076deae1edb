"""Shared fixtures: a real kvstore-server process per test module, and CUDA detection."""

from __future__ import annotations

import pytest

from kvstore_bench.serverproc import ServerProcess


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def server():
    """A kvstore-server with 64 MiB of DRAM, shared by the tests of one module."""
    with ServerProcess(dram="64MiB", metrics_port=0) as srv:
        yield srv


@pytest.fixture
def fresh_server():
    """A kvstore-server of the test's own, for tests that fill, stop or restart it."""
    servers = []

    def start(**flags) -> ServerProcess:
        srv = ServerProcess(**flags).start()
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.stop()
