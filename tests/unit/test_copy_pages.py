import numpy as np
import pytest

from kvstore_client.buffers import page_aligned_empty
from kvstore_client.shm import copy_layer, copy_pages

PB = 8192


def pool_and_offsets():
    mem = page_aligned_empty((64 * PB,))
    mem[:] = np.random.default_rng(0).integers(0, 256, mem.size, dtype=np.uint8)
    # Runs of adjacent slots, a gap, slots out of order, and a skipped key (-1).
    slots = [3, 4, 5, 9, 10, 2, -1, 20, 21, 22, 23, 0]
    return mem, np.array([s * PB if s >= 0 else -1 for s in slots], dtype=np.int64)


@pytest.mark.parametrize("shift", [0, 16, 64])     # co-aligned with the pool, or not
def test_copy_out_and_in_byte_exact(shift):
    mem, offsets = pool_and_offsets()
    n = len(offsets)
    raw = page_aligned_empty((n * PB + shift,))
    out = raw[shift:].reshape(n, PB)
    out[:] = 7
    copy_pages(out, mem, offsets, to_pool=False)
    for i, off in enumerate(offsets.tolist()):
        expected = mem[off:off + PB] if off >= 0 else np.full(PB, 7, dtype=np.uint8)
        assert np.array_equal(out[i], expected)

    before = mem.copy()
    pages = np.random.default_rng(1).integers(0, 256, (n, PB), dtype=np.uint8)
    src = page_aligned_empty((n * PB + shift,))[shift:].reshape(n, PB)
    src[:] = pages
    copy_pages(src, mem, offsets, to_pool=True)
    written = np.zeros(mem.size, dtype=bool)
    for i, off in enumerate(offsets.tolist()):
        if off >= 0:
            assert np.array_equal(mem[off:off + PB], pages[i])
            written[off:off + PB] = True
    assert np.array_equal(mem[~written], before[~written])    # nothing else touched


@pytest.mark.parametrize("layer", [0, 1, 3])
def test_copy_layer_gathers_each_pages_slab(layer):
    mem, offsets = pool_and_offsets()
    offsets = offsets[offsets >= 0]           # get_layers names only stored pages
    lb = PB // 4                              # four layers a page
    slab = np.full((len(offsets), lb), 7, dtype=np.uint8)
    copy_layer(slab, mem, offsets, layer, PB)
    for i, off in enumerate(offsets.tolist()):
        assert np.array_equal(slab[i], mem[off + layer * lb: off + (layer + 1) * lb])


def test_no_pages():
    mem, _ = pool_and_offsets()
    copy_pages(np.zeros((0, PB), dtype=np.uint8), mem, np.zeros(0, dtype=np.int64),
               to_pool=False)


def test_page_aligned_empty():
    for shape in [(3, 4096), (1,), (5, 7)]:
        a = page_aligned_empty(shape)
        assert a.shape == shape and a.dtype == np.uint8 and a.ctypes.data % 4096 == 0
        assert a.flags.c_contiguous and a.flags.writeable
