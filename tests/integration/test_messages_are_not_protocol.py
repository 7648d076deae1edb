"""Clients react to what the server means, not to how it words it.

Every StoreError message is rewritten (in the servers and in the tests' own process) by a
sitecustomize module, and the restart-recovery tests run again: a client that meets a
server restart must still register its layout again and map the new region, which it
can only do by the reason the server sends beside the status (kvstore_client.errors): in
trailing metadata on gRPC, in an error answer's flags on the fast path (fastwire.py). The
recoveries are also met head on, on both paths, with the shared-memory region and without:
a layout the server does not know, and a region token that no longer matches.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import grpc
import numpy as np
import pytest

from kvstore_client import KVStoreClient, KVStoreError, PageLayout, PagesMissing
from kvstore_client.errors import Reason, reason_of
from kvstore_client.results import LayoutHandle
from kvstore_protocol._proto.kvstore.v1 import kvstore_pb2 as pb, kvstore_pb2_grpc as pbg
from kvstore_testing.serverproc import ServerProcess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REWRITE = textwrap.dedent('''
    """Test-only: every StoreError message becomes a meaningless one."""
    import itertools

    import kvstore_server.errors as errors

    _n = itertools.count()
    _init = errors.StoreError.__init__

    def _rewritten(self, outcome, message, reason=None):
        _init(self, outcome, f"message {next(_n)} reworded", reason)

    errors.StoreError.__init__ = _rewritten
''')

RESTART_TESTS = [
    "tests/integration/test_roundtrip.py::test_client_reregisters_after_server_restart",
    "tests/integration/test_shm.py::test_server_restart_while_attached",
    "tests/integration/test_fastpath.py::"
    "test_a_restarted_server_is_reached_again_and_the_layout_registered_again",
]

LAYOUT = PageLayout(model="reworded", num_layers=2, page_tokens=16, num_kv_heads=2,
                    head_size=64)
PATHS = [False, True]
PATH_IDS = ["grpc", "fast-path"]


def _rewriting_env(folder) -> dict:
    (folder / "sitecustomize.py").write_text(REWRITE)
    path = os.pathsep.join(filter(None, [str(folder), ROOT, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


@pytest.fixture
def rewriting_env(tmp_path):
    return _rewriting_env(tmp_path)


def test_the_rewrite_takes_and_the_reason_still_comes(rewriting_env):
    with ServerProcess(dram="32MiB", env=rewriting_env) as srv:
        with grpc.insecure_channel(srv.address) as channel:
            stub = pbg.KVStoreStub(channel)
            with pytest.raises(grpc.RpcError) as caught:
                stub.Lookup(pb.LookupRequest(layout_ids=[bytes(16)],
                                             keys=pb.PackedKeys(data=bytes(16), key_size=16)),
                            timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "reworded" in caught.value.details() and "layout" not in caught.value.details()
    assert reason_of(caught.value) is Reason.LAYOUT_UNKNOWN


@pytest.mark.slow
def test_restart_recovery_survives_reworded_messages(rewriting_env):
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *RESTART_TESTS], cwd=ROOT, env=rewriting_env,
                          capture_output=True, text=True, timeout=600)
    tail = proc.stdout[-3000:]
    assert proc.returncode == 0, tail
    assert "failed" not in tail and " passed" in tail


@pytest.fixture(scope="module")
def rewriting_server(tmp_path_factory):
    env = _rewriting_env(tmp_path_factory.mktemp("rewrite"))
    with ServerProcess(dram="32MiB", env=env) as srv:
        yield srv


def _unregistered(layout: PageLayout) -> LayoutHandle:
    """A handle for a layout this server never saw: what a client holds after a restart."""
    return LayoutHandle(layout, layout.layout_id, layout.page_bytes, layout.layer_bytes)


@pytest.mark.parametrize("shared_memory", [False, True], ids=["remote", "same-host"])
@pytest.mark.parametrize("data_plane", PATHS, ids=PATH_IDS)
def test_an_unknown_layout_is_registered_again_by_its_reason(rewriting_server, data_plane,
                                                              shared_memory):
    with KVStoreClient(rewriting_server.address, data_plane=data_plane,
                       shared_memory=shared_memory) as c:
        ns = _unregistered(dataclasses.replace(LAYOUT, salt=f"{data_plane}{shared_memory}"))
        keys = [bytes([i]) * 16 for i in range(3)]
        assert c.lookup(ns, keys) == 0                 # registered again, then answered
        data = np.arange(3 * ns.page_bytes, dtype=np.uint64).astype(np.uint8).reshape(3, -1)
        assert c.put(ns, keys, data).stored == 3
        assert np.array_equal(c.get(ns, keys), data)


@pytest.mark.parametrize("data_plane", PATHS, ids=PATH_IDS)
def test_a_stale_region_token_maps_the_region_again_by_its_reason(rewriting_server,
                                                                   data_plane):
    with KVStoreClient(rewriting_server.address, data_plane=data_plane,
                       shared_memory=True) as c:
        ns = c.register_layout(dataclasses.replace(LAYOUT, salt=f"stale{data_plane}"))
        region = c.region()
        region.token = bytes(len(region.token))     # what a restarted server's region is
        keys = [bytes([i + 10]) * 16 for i in range(2)]
        data = np.full((2, ns.page_bytes), 7, dtype=np.uint8)
        assert c.put(ns, keys, data).stored == 2    # Reserve refused, region mapped again
        assert c.region() is not region
        assert np.array_equal(c.get(ns, keys), data)


@pytest.mark.parametrize("data_plane", [False, True], ids=["grpc", "fast-path"])
def test_a_missing_page_is_one_error_that_is_also_a_key_error(server, data_plane):
    # The reason comes from the server on gRPC; on the fast path PagesMissing names it.
    layout = PageLayout(model="missing", num_layers=1, page_tokens=16, num_kv_heads=8,
                        head_size=128)
    with KVStoreClient(server.address, data_plane=data_plane, shared_memory=False) as c:
        ns = c.register_layout(layout)
        with pytest.raises(PagesMissing) as caught:
            c.get(ns, [b"not-stored".ljust(16, b"\0")])
    assert isinstance(caught.value, KeyError) and isinstance(caught.value, KVStoreError)
    assert caught.value.code == grpc.StatusCode.NOT_FOUND
    assert caught.value.reason is Reason.PAGES_MISSING
