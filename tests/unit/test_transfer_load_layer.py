"""KVTransfer.load_layer (one layer of pages back to back in a slab, as a remote load
receives it) in every engine cache layout, checked by the hand-written indexing of
test_transfer_cpu; the same cases run on CUDA in tests/gpu/test_remote_load_gpu.py."""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="the connector's transfer moves pages with torch (not installed)")

from kvstore_connector.kvviews import kv5  # noqa: E402
from kvstore_connector.transfer import KVTransfer  # noqa: E402

# tests/unit is not a package: load the cases by path, as the GPU tests do.
_spec = importlib.util.spec_from_file_location(
    "transfer_cases", pathlib.Path(__file__).resolve().parent / "test_transfer_cpu.py")
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)


def run_load_layers(kind_or_name, k, device="cpu", block_size=4, n_pages=5, seed=0):
    kind, physical = cases.case(kind_or_name)
    layout = cases.layout_for(kind, k * block_size)
    rng = np.random.default_rng(seed)
    pages = rng.integers(0, 256, (n_pages, layout.page_bytes), dtype=np.uint8)
    caches = [cases.make_cache(kind, block_size, torch.bfloat16, device, physical)
              for _ in range(layout.num_layers)]
    block_ids = rng.permutation(cases.BLOCKS)[:n_pages * k].reshape(n_pages, k)
    xfer = KVTransfer([kv5(t, kind) for t in caches], layout.page_tokens, device)
    blocks = xfer.load_blocks(block_ids)
    lb = layout.layer_bytes
    slab = torch.empty((n_pages, lb), dtype=torch.uint8,
                       pin_memory=device == "cuda").numpy()
    for layer in range(layout.num_layers):
        slab[:] = pages[:, layer * lb:(layer + 1) * lb]
        event = xfer.load_layer(layer, slab, blocks)
        if event is not None:
            event.synchronize()          # the slab is written again for the next layer
    cases.check_loaded(caches, kind, layout, pages, block_ids)


@pytest.mark.parametrize("kind_or_name,k", cases.CASES)
def test_load_layer_in_every_cache_layout(kind_or_name, k):
    run_load_layers(kind_or_name, k)


def test_load_layer_rejects_bad_input_and_writes_nothing():
    kind, _ = cases.case(cases.CASES[0][0])
    layout = cases.layout_for(kind, 4)
    cache = cases.make_cache(kind, 4)
    xfer = KVTransfer([kv5(cache, kind)], 4, "cpu")
    before = cache.clone()
    with pytest.raises(ValueError, match="repeat a block"):
        xfer.load_blocks(np.array([[3], [3]]))
    with pytest.raises(ValueError, match="block ids must be in"):
        xfer.load_blocks(np.array([[cases.BLOCKS]]))
    blocks = xfer.load_blocks(np.array([[1], [2]]))
    with pytest.raises(ValueError, match="slab must be uint8 of shape"):
        xfer.load_layer(0, np.zeros((3, layout.layer_bytes), np.uint8), blocks)
    with pytest.raises(IndexError):
        xfer.load_layer(1, np.zeros((2, layout.layer_bytes), np.uint8), blocks)
    assert torch.equal(cache, before)
