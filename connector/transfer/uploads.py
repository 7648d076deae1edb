"""Index arrays (page offsets, block ids) to the device without an allocation per upload."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .runtime import TransferError, clear_cuda_error, cudart

__all__ = ["IndexUploads"]

_CUDA_MEMCPY_HOST_TO_DEVICE = 1
_MIN_ELEMENTS = 4096                  # 32 KiB a buffer to start with


class IndexUploads:
    """Small int64 arrays to the device, on one stream, through a kept pinned buffer into a
    kept device buffer.

    Every load and save uploads its block ids (and, by the kernel, its page offsets)
    before its first copy or scatter, so the upload's host time is on a short copy's
    critical path. torch's way, a tensor from its pinned-memory allocator and then
    .to(device), costs two allocator calls and a copy dispatch; here an upload is a
    numpy write and one cudaMemcpyAsync.

    Uploads since the last reset() lie one after another, so no upload overwrites
    another that a later copy still reads. After reset() the buffers are written again
    from the start. That is safe because every reader of an upload runs on this same
    stream, so it reads before the next copy lands; and the host waits for the last copy
    out of the pinned buffer before it writes there again. The caller resets once
    nothing it enqueues later reads what was uploaded before.
    """

    def __init__(self, device: torch.device, stream: Any) -> None:
        self.device = device
        self.stream = stream                # torch.cuda.Stream: the copies and readers
        self._host: np.ndarray | None = None            # pinned, int64
        self._host_t: torch.Tensor | None = None        # the same memory (keeps it alive)
        self._dev: torch.Tensor | None = None           # int64 on the device
        self._ptrs = (0, 0)                 # their addresses (host, device)
        self._used = 0                      # elements handed out since the last reset
        self._done: Any = None              # event: after the newest copy
        self._fresh = True                  # reset since the last put
        self._retired: list = []            # buffers outgrown since the reset
        self._lib: Any = None

    def put(self, *parts: np.ndarray) -> torch.Tensor:
        """`parts` (int64), back to back, as one tensor on the device; it stays valid
        until the next reset()."""
        n = sum(p.size for p in parts)
        if self._fresh:
            if self._done is not None:
                self._done.synchronize()    # the pinned buffer's last copy out is over
            self._retired.clear()
            self._fresh = False
        if self._dev is None or self._used + n > self._dev.numel():
            self._grow(n)
        assert self._host is not None and self._dev is not None
        at = start = self._used
        for part in parts:
            self._host[at:at + part.size] = part.reshape(-1)
            at += part.size
        if n:
            host, dev = self._ptrs
            rc = self._lib.cudaMemcpyAsync(dev + 8 * start, host + 8 * start, 8 * n,
                                           _CUDA_MEMCPY_HOST_TO_DEVICE,
                                           self.stream.cuda_stream)
            if rc:
                clear_cuda_error()
                raise TransferError(f"uploading {n} indices failed with CUDA error {rc}")
            self._done.record(self.stream)
        self._used = at
        return self._dev[start:at]

    def reset(self) -> None:
        """Hand the buffers out from the start again (see the class)."""
        self._used = 0
        self._fresh = True

    def _grow(self, n: int) -> None:
        """Buffers for at least `n` more elements. The old ones are kept until the next
        reset: what was put in them may still be read, and copied out."""
        if self._dev is not None:
            self._retired.append((self._host_t, self._dev))
        size = max(_MIN_ELEMENTS, 2 * n, 2 * (self._dev.numel() if self._dev is not None
                                              else 0))
        if self._lib is None:
            self._lib = cudart()
            self._done = torch.cuda.Event()
        # Made on the stream that reads it: the caching allocator hands its memory to
        # other work only after the stream's work that was queued before it is freed.
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self._dev = torch.empty(size, dtype=torch.int64, device=self.device)
        self._host_t = torch.empty(size, dtype=torch.int64, pin_memory=True)
        self._host = self._host_t.numpy()
        self._ptrs = (self._host_t.data_ptr(), self._dev.data_ptr())
        self._used = 0
