"""Loads by the copy engine (CopyMethod.DMA): per layer, one cudaMemcpy2DAsync per run of
adjacent pages into a device staging buffer, then the kernel scatters the buffer into the
engine's blocks, device to device, on a second stream while the next piece copies.

Why: the kernel's own PCIe reads peak at ~91% of a pinned copy, while the copy engine
reaches ~100% on runs of adjacent pages (shm --gpu: 55.3 of 55.4 GB/s for runs of 1 MiB
slots). A layer's slabs of a run of adjacent pages are rows of one 2D copy (width
layer_bytes, pitch page_bytes). When a load takes this path is KVTransfer's choice.
"""

from __future__ import annotations

import math
from typing import Any
from collections.abc import Callable

import torch

from .plan import Geometry, Plan
from .runtime import TransferError, clear_cuda_error, cudart, record

__all__ = ["DEFAULT_STAGING_BYTES", "DmaLoader"]

# Device memory for staging: two buffers of this many bytes, taken on the first DMA load
# (a layer larger than one is moved in pieces).
DEFAULT_STAGING_BYTES = 64 << 20
_CUDA_MEMCPY_DEFAULT = 4                      # cudaMemcpyDefault: direction from UVA

# scatter(staging, layer, pages, staged_offsets, block_ids, align): the kernel from a
# device buffer into one layer's blocks, on the current stream.
Scatter = Callable[[torch.Tensor, int, int, torch.Tensor, torch.Tensor, int], None]


class DmaLoader:
    """Two device staging buffers and a scatter stream, made on first use."""

    def __init__(self, device: torch.device, staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        self.device = device
        self.staging_bytes = staging_bytes
        self._staging: list[torch.Tensor] = []
        self._free: list = [None, None]     # event: the buffer's last scatter is done
        self._scatter_stream: Any = None   # torch.cuda.Stream, made at first use
        self._lib: Any = None              # the CUDA runtime (cudart), loaded at first use

    def _setup(self, layer_bytes: int) -> None:
        self._lib = cudart()
        per = max(layer_bytes, self.staging_bytes // layer_bytes * layer_bytes)
        self._staging = [torch.empty(per, dtype=torch.uint8, device=self.device)
                         for _ in range(2)]
        self._scatter_stream = torch.cuda.Stream(self.device, priority=-1)

    def load(self, geo: Geometry, num_layers: int, plan: Plan, runs: list[tuple[int, int]],
             load, cache_align: int, scatter: Scatter) -> list:
        """Every layer by the copy engine into a staging buffer (on `load`, the load
        stream), scattered into the blocks by the kernel (scatter stream); the two buffers
        alternate, so the copy of one piece runs while the previous one scatters. One
        event per layer, on the scatter stream, recorded once the layer is in its blocks."""
        lb, pages = geo.layer_bytes, len(plan.offsets)
        if not pages:
            return [record(load) for _ in range(num_layers)]
        if not self._staging:
            self._setup(lb)
        chunk = self._staging[0].numel() // lb          # pages a buffer holds
        extent = num_layers * lb
        base = int(plan.host.ctypes.data)
        stream = self._scatter_stream
        meta = plan.meta
        assert meta is not None             # the plan makes it for every device copy
        staged = torch.arange(min(chunk, pages), dtype=torch.int64, device=self.device) * lb
        # Made on the load stream, read on the scatter stream: the allocator must not hand
        # their memory out again before the scatters are done.
        staged.record_stream(stream)
        meta.record_stream(stream)
        align = math.gcd(cache_align, lb, 16)
        events, piece = [], 0
        with torch.cuda.device(self.device):
            for layer in range(num_layers):
                for p0 in range(0, pages, chunk):
                    p1 = min(pages, p0 + chunk)
                    b = piece % 2
                    piece += 1
                    buf = self._staging[b]
                    if self._free[b] is not None:
                        load.wait_event(self._free[b])
                    for r0, r1 in runs:
                        r0, r1 = max(r0, p0), min(r1, p1)
                        if r0 >= r1:
                            continue
                        rc = self._lib.cudaMemcpy2DAsync(
                            buf.data_ptr() + (r0 - p0) * lb, lb,
                            base + int(plan.offsets[r0]) + layer * lb, extent, lb, r1 - r0,
                            _CUDA_MEMCPY_DEFAULT, load.cuda_stream)
                        if rc:
                            clear_cuda_error()
                            raise TransferError(f"cudaMemcpy2DAsync of layer {layer} "
                                                f"failed with CUDA error {rc}")
                    stream.wait_event(record(load))
                    with torch.cuda.stream(stream):
                        scatter(buf, layer, p1 - p0, staged[:p1 - p0],
                                meta[pages + p0 * geo.k:pages + p1 * geo.k], align)
                    self._free[b] = record(stream)
                events.append(self._free[(piece - 1) % 2])
        return events
