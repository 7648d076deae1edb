"""A ring of pinned host slabs that remote loads receive layers into (connector.worker.remote).

    take(stop)          a free slab's index, once the copy out of it has landed (waits)
    mem(i, pages, lb)   its first pages * lb bytes as a (pages, lb) array
    give(i, event)      received and its copy enqueued: free once `event` completes
                        (None: free now, nothing copies out of it)

Thread-safe: the stripes of several Gets take from it at once. A receive never waits on
another receive's slab for ever: a slab taken is given back once its layer has arrived
(every stripe of a Get fills the layers in order), or when its Get has ended.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import numpy as np
import torch

from ..transfer import TransferError, pinned_empty

__all__ = ["SLABS", "StagingRing", "Stopped"]

# Slabs in the ring: one receiving, one or two copying, one spare. A layer's copy (PCIe)
# is faster than its receive (the network), so more slabs would only hold memory.
SLABS = 4
_POLL_S = 0.05                # how often a waiting take looks at `stop`
# Slabs start on a 4 KiB boundary, as pinned memory does; torch's CPU allocator puts a
# large buffer 64 bytes past one. A Get answer's page bytes come 32 bytes past a boundary
# of the kernel's buffers (its header and pad: fastwire.ALIGNED), and on some CPUs a
# receive whose destination lies 32 bytes past its source modulo 4 KiB is slow: slabs
# 64 bytes past a boundary cost a load about twice the client CPU of slabs on one
# (kvstore-bench remote-load times the whole load: docs/perf/remote-load-cb31147405.json).
PAGE = 4096


def _page_aligned(nbytes: int, device: torch.device) -> np.ndarray:
    """pinned_empty(nbytes), starting on a PAGE boundary."""
    mem = pinned_empty(nbytes + PAGE, device)
    skip = -mem.ctypes.data % PAGE
    return mem[skip:skip + nbytes]


class Stopped(Exception):
    """The receive was stopped while it waited for a slab."""


class StagingRing:
    """SLABS pinned host buffers of `slab_bytes` each, taken for a receive and given back
    with the event of the copy out of them. Thread-safe: stripes of several Gets take
    from it at once."""

    def __init__(self, total_bytes: int, min_slab: int, device: torch.device) -> None:
        self.slab_bytes = max(total_bytes // SLABS, min_slab)
        self._mem = [_page_aligned(self.slab_bytes, device) for _ in range(SLABS)]
        self._cond = threading.Condition()      # guards _free
        # Slabs not being received into, oldest first, each with the event of the copy
        # out of it (None: nothing to wait for).
        self._free: collections.deque = collections.deque((i, None) for i in range(SLABS))

    def take(self, stop: threading.Event) -> int:
        """A free slab's index, once the copy out of it has landed; _Stopped when `stop`
        is set while waiting."""
        with self._cond:
            while not self._free:
                if stop.is_set():
                    raise Stopped
                self._cond.wait(_POLL_S)
            slab, event = self._free.popleft()
        if event is not None:
            try:
                event.synchronize()
            except RuntimeError as exc:
                self.give(slab)
                raise TransferError(f"KV copy failed on the device: {exc}") from exc
        return slab

    def mem(self, slab: int, pages: int, layer_bytes: int) -> np.ndarray:
        return self._mem[slab][:pages * layer_bytes].reshape(pages, layer_bytes)

    def give(self, slab: int, event: Any = None) -> None:
        with self._cond:
            self._free.append((slab, event))
            self._cond.notify()
