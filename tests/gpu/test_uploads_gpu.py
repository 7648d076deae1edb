"""connector.transfer.uploads and the saves that share its buffers within a step, on the
GPU. Run on the GPU machine."""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pytest
import torch

from kvstore_connector.kvviews import KVKind, kv5
from kvstore_connector.transfer import CopyMethod, KVTransfer
from kvstore_connector.transfer.uploads import IndexUploads

_spec = importlib.util.spec_from_file_location(
    "transfer_cases", pathlib.Path(__file__).resolve().parents[1] / "unit" / "test_transfer_cpu.py")
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)

pytestmark = pytest.mark.gpu


def test_uploads_until_a_reset_all_stay_valid_through_growth():
    stream = torch.cuda.Stream()
    up = IndexUploads(torch.device("cuda", 0), stream)
    rng = np.random.default_rng(1)
    parts = [rng.integers(-2**40, 2**40, size=n) for n in (5, 3000, 1, 9000, 0, 70)]
    got = [up.put(p) for p in parts]                    # 4,096 to start: grows twice
    both = up.put(parts[0], parts[1])
    stream.synchronize()
    for p, g in zip(parts, got):
        assert np.array_equal(g.cpu().numpy(), p)
    assert np.array_equal(both.cpu().numpy(), np.concatenate([parts[0], parts[1]]))


def test_a_reader_queued_before_a_reset_reads_the_old_values():
    """After reset() the next put writes over the same device memory: a reader on the
    stream that was queued before it (held up behind a sleep) still reads the old ones."""
    stream = torch.cuda.Stream()
    up = IndexUploads(torch.device("cuda", 0), stream)
    old = np.arange(1000, dtype=np.int64)
    first = up.put(old)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(100_000_000)                  # ~50 ms
        read = first * 1                                # queued behind the sleep
    up.reset()
    again = up.put(-old)
    assert again.data_ptr() == first.data_ptr()         # the same memory, written anew
    stream.synchronize()
    assert np.array_equal(read.cpu().numpy(), old)
    assert np.array_equal(again.cpu().numpy(), -old)


def test_a_put_after_a_reset_does_not_wait_for_a_queued_copy():
    """The last copy out of the pinned buffer is queued behind other work on the stream
    (a sleep here; a wait for the engine's stream in a load): the next put after a reset
    returns at once, through another pinned buffer, and both uploads land right."""
    stream = torch.cuda.Stream()
    up = IndexUploads(torch.device("cuda", 0), stream)
    values = np.arange(1000, dtype=np.int64)
    up.put(values)                                      # buffers made
    stream.synchronize()
    up.reset()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)                  # ~0.1 s
        slept = torch.cuda.Event()
        slept.record(stream)
    first = up.put(values)                              # its copy waits behind the sleep
    with torch.cuda.stream(stream):
        read = first * 1
    up.reset()
    again = up.put(-values)
    assert not slept.query()                            # the host did not wait for it
    stream.synchronize()
    assert np.array_equal(read.cpu().numpy(), values)
    assert np.array_equal(again.cpu().numpy(), -values)


@pytest.mark.parametrize("method", [CopyMethod.DMA, CopyMethod.KERNEL])
def test_two_saves_interleaved_in_one_step_are_both_exact(method):
    """Two requests' saves, layer by layer in turn (as the worker's hooks call them):
    their indices lie side by side in the save stream's uploads until finish_save."""
    kind, block_size, layers = KVKind.FLASH_NHD, 4, 5
    layout = cases.layout_for(kind, block_size, layers=layers)
    caches = [cases.make_cache(kind, block_size, device="cuda") for _ in range(layers)]
    for i, t in enumerate(caches):
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(i))
                .to(t.dtype))
    xfer = KVTransfer([kv5(t, kind) for t in caches], block_size, "cuda", method=method,
                      staging_bytes=1)
    pages = 10
    host = torch.zeros(pages * layout.page_bytes, dtype=torch.uint8,
                       pin_memory=True).numpy()
    first = (np.array([[3], [9], [4], [20], [7]]), np.arange(5) * layout.page_bytes)
    second = (np.array([[1], [2], [11], [12], [13]]), np.arange(5, 10) * layout.page_bytes)
    for step in range(2):                               # the second reuses the buffers
        host[:] = 0
        for layer in range(layers):
            for block_ids, offsets in (first, second):
                xfer.save_layer(layer, host, offsets, block_ids)
        xfer.finish_save()
        for block_ids, offsets in (first, second):
            for b, off in zip(block_ids, offsets):
                want = cases.expected_page(caches, kind, layout, b)
                assert np.array_equal(host[off:off + layout.page_bytes], want), \
                    f"step {step}: the page of block {b} differs"
