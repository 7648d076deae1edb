"""Shared fixtures: a real kvstore-server process per test module, a real Valkey/Redis
Cluster for the far tier, and CUDA detection."""

from __future__ import annotations

import os
import signal

import pytest

from kvstore_testing.clusterproc import ClusterProcess, server_binaries
from kvstore_testing.serverproc import ServerProcess


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_configure(config):
    # Tests send SIGINT to processes they start (the Ctrl-C paths). A pytest started with
    # SIGINT ignored (a background job of a non-interactive shell, nohup) hands that to
    # every child, and a Python child then never sees the signal: the watch and netns
    # tests failed so. A handler of our own here is reset to the default in each child.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("KVSTORE_EVICTION_POLICY", "lru") != "lru":
        other = pytest.mark.skip(reason="asserts LRU order; another eviction policy is set")
        for item in items:
            if item.get_closest_marker("lru_order"):
                item.add_marker(other)
    if _has_cuda():
        return
    # The marker, not item.keywords: keywords also hold every folder name above the test,
    # so a checkout in a folder named "gpu" would skip the whole suite.
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine)")
    for item in items:
        if item.get_closest_marker("gpu"):
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


def _cluster_binaries():
    """Skip where no valkey-server/redis-server can be had; under CI (which installs
    Debian's redis-server in .ci/run) a missing binary is a failure, not a skip."""
    found = server_binaries()
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("CI must install redis-server (see .ci/run): far-tier tests need it")
        pytest.skip("needs valkey-server or redis-server with its cli on PATH "
                    "(apt-get install redis-server)")
    return found


@pytest.fixture(scope="module")
def far_cluster():
    """A 3-master cluster on loopback ports, shared by the tests of one module."""
    with ClusterProcess(masters=3, binaries=_cluster_binaries()) as cluster:
        yield cluster


@pytest.fixture
def fresh_cluster():
    """A cluster of the test's own (start(masters, replicas)), for tests that kill nodes;
    always torn down."""
    clusters = []

    def start(masters: int = 3, replicas: int = 0) -> ClusterProcess:
        cluster = ClusterProcess(masters, replicas, binaries=_cluster_binaries()).start()
        clusters.append(cluster)
        return cluster

    yield start
    for cluster in clusters:
        cluster.stop()


@pytest.fixture(autouse=True)
def _eviction_policy(monkeypatch):
    """KVSTORE_EVICTION_POLICY names the eviction policy of every store and disk tier the
    tests make, as it does for the servers they start (config.py): the eviction tests run
    under a second policy with nothing else changed (tests/integration/test_eviction_fifo.py)."""
    name = os.environ.get("KVSTORE_EVICTION_POLICY")
    if name:
        monkeypatch.setattr("kvstore_server.store.eviction.DEFAULT_POLICY", name)
