"""Remote loads (connector.worker.remote) on CUDA: pinned slabs, the copy of each layer on the load
stream, the compute stream waiting per layer; byte-exact against the shared-pool path.
Run on the GPU machine."""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pytest
import torch

from kvstore_connector.worker.remote import SLABS
from tests.integration.test_remote_load import SHAPES, Rig, remote_threads

pytestmark = pytest.mark.gpu

# tests/unit is not a package: load its load_layer cases by path.
_spec = importlib.util.spec_from_file_location(
    "load_layer_cases",
    pathlib.Path(__file__).resolve().parents[1] / "unit" / "test_transfer_load_layer.py")
load_layer_cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(load_layer_cases)


@pytest.mark.parametrize("kind_or_name,k", load_layer_cases.cases.CASES)
def test_load_layer_in_every_cache_layout_on_cuda(kind_or_name, k):
    load_layer_cases.run_load_layers(kind_or_name, k, device="cuda")


@pytest.fixture
def srv(fresh_server):
    return fresh_server(dram="2GiB", lease_ttl="10s")


@pytest.mark.parametrize("name", list(SHAPES))
def test_remote_loads_are_the_bytes_of_the_shared_pool_path_on_cuda(srv, name):
    rig = Rig(srv.address, SHAPES[name], pages=40, seed=len(name))
    lb = rig.layout.page_bytes // len(rig.names)
    # Slabs of 3 pages' layers: every layer in page chunks, the load many times the ring.
    remote = rig.worker(srv.address, "cuda", shared_memory=False, remote_connections=3,
                        remote_staging_bytes=SLABS * 3 * lb)
    shared = rig.worker(srv.address, "cuda")
    assert shared._shared() and not remote._shared()
    loads = rig.specs([9, 25], is_async={2})
    assert rig.step(remote, loads) == set()
    assert rig.step(shared, loads) == set()
    torch.cuda.synchronize()
    ring = remote._remote._ring
    assert all(torch.from_numpy(mem).is_pinned() for mem in ring._mem)
    for layer, (a, b) in enumerate(zip(rig.as_bytes(remote), rig.as_bytes(shared))):
        assert np.array_equal(a, b), f"layer {layer} differs from the shared-pool load"
    rig.expected(remote)
    assert remote_threads() == []
    remote.close()
    shared.close()


def test_each_layer_is_read_after_its_copy_on_the_compute_stream(srv):
    """8B-shaped pages, 512 MiB over the default ring and 8 connections: what a kernel on
    the compute stream reads right after wait_for_layer(L) is layer L's loaded bytes."""
    rig = Rig(srv.address, (2, "bfloat16", 16, 8, 128, 32), pages=256, seed=11)
    remote = rig.worker(srv.address, "cuda", shared_memory=False)
    idx = torch.as_tensor(rig.blocks.reshape(-1), device="cuda")
    seen = []

    def read(layer):        # enqueued on the compute stream, copied out later
        seen.append(remote.transfer.layers[layer][:, idx].clone())

    for _ in range(2):      # the second time, every slab of the ring is used again
        for t in remote.transfer.layers:
            t.fill_(-7)
        seen.clear()
        assert rig.step(remote, rig.specs([100]), read) == set()
        torch.cuda.synchronize()
        for layer, got in enumerate(seen):
            # As bits: the pages are random bytes, so bf16 NaNs, which never equal.
            final = remote.transfer.layers[layer][:, idx]
            assert torch.equal(got.view(torch.int16), final.view(torch.int16)), layer
        rig.expected(remote)
    assert remote_threads() == []
    remote.close()
