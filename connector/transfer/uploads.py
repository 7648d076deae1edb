"""Index arrays (page offsets, block ids) to the device without an allocation per upload."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from .runtime import TransferError, clear_cuda_error, cudart

__all__ = ["IndexUploads"]

_CUDA_MEMCPY_HOST_TO_DEVICE = 1
_MIN_ELEMENTS = 4096                  # 32 KiB a buffer to start with
# Pinned buffers kept for reuse once their copies are over (more are freed).
_SPARES_KEPT = 4


@dataclasses.dataclass(slots=True)
class _Pinned:
    """A pinned buffer and the event recorded after its newest copy out."""

    tensor: torch.Tensor                 # keeps the memory alive
    array: np.ndarray                    # the same memory, for numpy writes
    ptr: int
    event: Any                           # torch.cuda.Event

    @classmethod
    def make(cls, size: int) -> _Pinned:
        tensor = torch.empty(size, dtype=torch.int64, pin_memory=True)
        return cls(tensor, tensor.numpy(), tensor.data_ptr(), torch.cuda.Event())

    def idle(self) -> bool:
        """No copy out of it is still to run."""
        return self.event.query()


class IndexUploads:
    """Small int64 arrays to the device, on one stream, through kept pinned buffers into a
    kept device buffer.

    Every load and save uploads its block ids (and, by the kernel, its page offsets)
    before its first copy or scatter, so the upload's host time is on a short copy's
    critical path. torch's way, a tensor from its pinned-memory allocator and then
    .to(device), costs two allocator calls and a copy dispatch; here an upload is a
    numpy write and one cudaMemcpyAsync.

    Uploads since the last reset() lie one after another, so no upload overwrites
    another that a later copy still reads. After reset() the device buffer is written
    again from the start: safe because every reader of an upload runs on this same
    stream, so it reads before the next copy lands. The pinned side is not ordered so:
    a copy out of it may still be queued (behind a wait for the engine's stream, say)
    when the host wants to write it again. Then the uploads go through another pinned
    buffer, never waiting on the host, and the first stays kept until its copies are
    over. The caller resets once nothing it enqueues later reads what was uploaded
    before.
    """

    def __init__(self, device: torch.device, stream: Any) -> None:
        self.device = device
        self.stream = stream                # torch.cuda.Stream: the copies and readers
        self._dev: torch.Tensor | None = None           # int64 on the device
        self._dev_ptr = 0
        self._pinned: _Pinned | None = None  # written now, as large as the device buffer
        self._spares: list[_Pinned] = []    # others: copies out may still be queued
        self._used = 0                      # elements handed out since the last reset
        self._fresh = True                  # reset since the last put
        self._retired: list = []            # device buffers outgrown since the reset
        self._lib: Any = None

    def put(self, *parts: np.ndarray) -> torch.Tensor:
        """`parts` (int64), back to back, as one tensor on the device; it stays valid
        until the next reset()."""
        n = sum(p.size for p in parts)
        if self._fresh:
            self._fresh = False
            self._retired.clear()
            if self._pinned is not None and not self._pinned.idle():
                self._spares.append(self._pinned)       # written again from the start
                self._pinned = None
        if self._dev is None or self._used + n > self._dev.numel():
            self._grow(n)
        assert self._dev is not None
        if self._pinned is None:
            self._pinned = self._spare(self._dev.numel())
        pinned, at = self._pinned, self._used
        start = at
        for part in parts:
            pinned.array[at:at + part.size] = part.reshape(-1)
            at += part.size
        if n:
            rc = self._lib.cudaMemcpyAsync(self._dev_ptr + 8 * start, pinned.ptr + 8 * start,
                                           8 * n, _CUDA_MEMCPY_HOST_TO_DEVICE,
                                           self.stream.cuda_stream)
            if rc:
                clear_cuda_error()
                raise TransferError(f"uploading {n} indices failed with CUDA error {rc}")
            pinned.event.record(self.stream)
        self._used = at
        return self._dev[start:at]

    def reset(self) -> None:
        """Hand the buffers out from the start again (see the class)."""
        self._used = 0
        self._fresh = True

    def _grow(self, n: int) -> None:
        """A device buffer for at least `n` more elements, and a pinned one as large. The
        old device buffer is kept until the next reset (what was put in it may still be
        read), the old pinned one until its copies are over."""
        if self._dev is not None:
            self._retired.append(self._dev)
        size = max(_MIN_ELEMENTS, 2 * n, 2 * (self._dev.numel() if self._dev is not None
                                              else 0))
        if self._lib is None:
            self._lib = cudart()
        # Made on the stream that reads it: the caching allocator hands its memory to
        # other work only after the stream's work that was queued before it is freed.
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self._dev = torch.empty(size, dtype=torch.int64, device=self.device)
        self._dev_ptr = self._dev.data_ptr()
        if self._pinned is not None:
            self._spares.append(self._pinned)
            self._pinned = None
        self._used = 0

    def _spare(self, size: int) -> _Pinned:
        """A pinned buffer of `size` elements with no copy out still to run: a kept one,
        or a new one. Idle buffers beyond _SPARES_KEPT, or too small, are freed."""
        found, keep = None, []
        for spare in self._spares:
            if not spare.idle():
                keep.append(spare)          # its copies still read it
            elif found is None and spare.array.size >= size:
                found = spare
            elif spare.array.size >= size and len(keep) < _SPARES_KEPT:
                keep.append(spare)
        self._spares = keep
        return found if found is not None else _Pinned.make(size)
