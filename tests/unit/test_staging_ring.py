"""The remote loads' slab ring (connector.worker.staging): slabs on a page boundary, of the size
asked, each taken once until given back."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

from kvstore_connector.worker.staging import SLABS, StagingRing, Stopped  # noqa: E402

PAGE = 4096


def test_slabs_start_on_a_page_boundary_on_cpu():
    # torch's CPU allocator puts a buffer this large 64 bytes past a page boundary, where
    # a Get's receive copies at half speed on some CPUs (connector.worker.staging says why).
    ring = StagingRing(SLABS << 20, 64 << 10, torch.device("cpu"))
    for slab in range(SLABS):
        mem = ring.mem(slab, 16, 64 << 10)
        assert mem.ctypes.data % PAGE == 0
        assert mem.shape == (16, 64 << 10) and mem.flags.c_contiguous and mem.flags.writeable
    starts = {ring.mem(i, 1, 1).ctypes.data for i in range(SLABS)}
    assert len(starts) == SLABS                  # four slabs, none shared


def test_a_take_waits_for_a_slab_and_gives_up_on_stop():
    ring = StagingRing(SLABS << 16, 1 << 16, torch.device("cpu"))
    stop = threading.Event()
    taken = [ring.take(stop) for _ in range(SLABS)]
    assert sorted(taken) == list(range(SLABS))
    stop.set()
    with pytest.raises(Stopped):
        ring.take(stop)
    ring.give(taken[2])
    assert ring.take(threading.Event()) == taken[2]
