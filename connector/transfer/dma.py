"""Loads by the copy engine (CopyMethod.DMA): per layer, one cudaMemcpy2DAsync per run of
adjacent pages into a device staging buffer, then the kernel scatters the buffer into the
engine's blocks, device to device, on a second stream while the next piece copies.

Why: the kernel's own PCIe reads peak short of a pinned copy, while the copy engine
reaches a pinned copy's speed on runs of adjacent pages (docs/perf/shm-cf14367beb.json
measures runs of 1 MiB slots). A layer's slabs of a run of adjacent pages are rows of one 2D copy (width
layer_bytes, pitch page_bytes). When a load takes this path is KVTransfer's choice.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .plan import Geometry, Plan
from .runtime import TransferError, clear_cuda_error, cudart, record
from .uploads import IndexUploads

__all__ = ["DEFAULT_STAGING_BYTES", "DmaLoader", "DmaSaver"]

# Device memory for staging: two buffers of this many bytes, taken on the first DMA load
# (a layer larger than one is moved in pieces).
DEFAULT_STAGING_BYTES = 64 << 20
_CUDA_MEMCPY_DEFAULT = 4                      # cudaMemcpyDefault: direction from UVA
# Offset tensors a DmaLoader or DmaSaver keeps (a few hundred bytes of device memory each).
_STAGED_KEPT = 256

# scatter(staging, first, count, pages, staged_offsets, block_ids, align, stream): the kernel
# from a device buffer into layers [first, first + count)'s blocks, on the current stream
# (`stream`: its handle, so the launch need not look it up).
Scatter = Callable[[torch.Tensor, int, int, int, torch.Tensor, torch.Tensor, int, int], None]
# gather(staging, first, count, pages, staged_offsets, block_ids, align, stream): the kernel
# from layers [first, first + count)'s blocks into a device buffer, on the stream whose
# handle is `stream` (current or not).
Gather = Callable[[torch.Tensor, int, int, int, torch.Tensor, torch.Tensor, int, int], None]


class _Staging:
    """Two device staging buffers used in turn, each with the event after which it is free
    again, a stream of the path's own, and the offsets of pages in a buffer per piece
    shape; made on first use."""

    def __init__(self, device: torch.device, staging_bytes: int, priority: int) -> None:
        self.device = device
        self.staging_bytes = staging_bytes
        self._priority = priority           # of the stream
        self._staging: list[torch.Tensor] = []
        self._free: list = [None, None]     # event: the buffer's last use is done
        self._stream: Any = None            # torch.cuda.Stream, made at first use
        self._lib: Any = None               # the CUDA runtime (cudart), loaded at first use
        self._piece = 0                     # pieces so far: picks the buffer
        self._staged: dict = {}             # (pages, width, shift) -> offsets in a buffer

    def _reserve(self, width: int) -> None:
        """Buffers that hold at least one page's piece (`width` bytes). Buffers too small
        (a staging size under a page) are made anew once the device is done with them."""
        if self._staging and self._staging[0].numel() >= width:
            return
        for event in self._free:
            if event is not None:
                event.synchronize()
        self._free = [None, None]
        self._lib = cudart()
        per = max(width, self.staging_bytes)
        self._staging = [torch.empty(per, dtype=torch.uint8, device=self.device)
                         for _ in range(2)]
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device, priority=self._priority)

    def _take(self, stream) -> tuple[int, torch.Tensor]:
        """The next buffer in turn, once `stream` has waited for its last use. Counted
        across calls: a call of one piece must not take the buffer the previous one did."""
        b = self._piece % 2
        self._piece += 1
        if self._free[b] is not None:
            stream.wait_event(self._free[b])
        return b, self._staging[b]

    def _staged_offsets(self, pages: int, width: int, shift: int, stream) -> torch.Tensor:
        """Where each page lies in a buffer, less `shift`, for the kernel, made on
        `stream`, which alone reads it. Kept: a step's pieces repeat from step to step,
        and making it anew cost three small launches a piece."""
        key = (pages, width, shift)
        staged = self._staged.get(key)
        if staged is None:
            if len(self._staged) >= _STAGED_KEPT:
                self._staged.clear()
            with torch.cuda.stream(stream):
                staged = self._staged[key] = (torch.arange(pages, dtype=torch.int64,
                                                           device=self.device) * width - shift)
        return staged


class DmaLoader(_Staging):
    """Loads by the copy engine into staging, scattered on a stream of high priority (a
    layer's scatter is on the forward's path)."""

    def __init__(self, device: torch.device, staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        super().__init__(device, staging_bytes, priority=-1)
        self._uploads: Any = None           # IndexUploads on the scatter stream
        # One a buffer, recorded on the load stream after a piece's copies into it and
        # waited for by the scatter stream before the piece's scatter: a wait takes the
        # event's newest record when it is made, and the buffer's next piece is recorded
        # only after that wait, so two events serve every piece (one made per piece cost
        # the host a creation).
        self._handoff: list = []

    def load(self, geo: Geometry, num_layers: int, base: int, offsets: np.ndarray,
             runs: list[tuple[int, int]],
             block_ids: np.ndarray, load, cache_align: int, scatter: Scatter,
             group: int = 1, shift: Callable[[int], int] = lambda layer: 0,
             ) -> tuple[list, torch.Tensor | None]:
        """Every layer of the pages at `offsets` in the host array at address `base`
        (checked) by the copy engine into a staging buffer (on `load`, the load stream),
        scattered into the blocks by the kernel (scatter stream), `group` layers a piece:
        one 2D copy per run of adjacent pages moves the piece's layers of each page at
        once (they lie back to back in a pool page), one launch scatters them. The two
        buffers alternate, so the copy of one piece runs while the previous one scatters.
        block_ids (checked) go up on the scatter stream once the first two pieces' copies
        are enqueued. Returns one event per layer, on the scatter stream, recorded once
        the layer's piece is in its blocks, and the block ids on the device (keep them
        until the last). shift(first): the piece's first layer's index in its layer table
        times layer_bytes (the scatter counts layers in the table)."""
        lb, pages, k = geo.layer_bytes, len(offsets), geo.k
        if not pages:
            return [record(load) for _ in range(num_layers)], None
        group = max(1, min(group, num_layers))
        self._reserve(group * lb)
        extent = num_layers * lb
        stream = self._stream
        align = math.gcd(cache_align, lb, 16)
        events: list = []
        if not self._handoff:
            self._handoff = [torch.cuda.Event(), torch.cuda.Event()]
            self._uploads = IndexUploads(self.device, stream)
        handoff, lib, to = self._handoff, self._lib, load.cuda_stream
        # A piece's host work is what bounds a short load (a piece's bytes take PCIe less
        # time than the host takes to launch it), so what repeats from piece to piece
        # is worked out once a load: per buffer-full of pages, its runs (row in the
        # buffer, byte address of the run's first page, rows).
        chunks: dict[int, list] = {}

        def pieces(chunk: int) -> list:
            got = chunks.get(chunk)
            if got is None:
                got = chunks[chunk] = []
                for p0 in range(0, pages, chunk):
                    p1 = min(pages, p0 + chunk)
                    rows = [(max(r0, p0) - p0, base + int(offsets[max(r0, p0)]),
                             min(r1, p1) - max(r0, p0))
                            for r0, r1 in runs if max(r0, p0) < min(r1, p1)]
                    got.append((p0, p1, rows))
            return got

        def copy(first: int, width: int, rows: list) -> tuple[int, torch.Tensor]:
            """The next buffer, with one piece's copies into it enqueued on `load`."""
            b, buf = self._take(load)
            dst = buf.data_ptr()
            for row, src, nrows in rows:
                rc = lib.cudaMemcpy2DAsync(dst + row * width, width, src + first * lb, extent,
                                           width, nrows, _CUDA_MEMCPY_DEFAULT, to)
                if rc:
                    clear_cuda_error()
                    raise TransferError(f"cudaMemcpy2DAsync of layers {first}.."
                                        f"{first + width // lb - 1} failed with CUDA error {rc}")
            handoff[b].record(load)
            return b, buf

        # Every piece in order: (first layer, layers, pages a buffer holds, p0, p1, rows,
        # whether it is its layers' last).
        order = []
        for first in range(0, num_layers, group):
            count = min(group, num_layers - first)
            chunk = max(1, self._staging[0].numel() // (count * lb))   # pages a buffer holds
            got = pieces(chunk)
            order += [(first, count, min(chunk, pages), p0, p1, rows, j == len(got) - 1)
                      for j, (p0, p1, rows) in enumerate(got)]
        # The first two pieces' copies (one a buffer) go out before anything else,
        # contexts included: the copy engine idles until then, and a short load has
        # nothing to hide it behind. With the first alone, a profiler trace of a short
        # load showed the second copy starting well after the first ended, behind the
        # host's upload and first scatter; with two first (and uploads.py and the save
        # flush's changes, core._flush_save) short loads and saves came closer to a
        # pinned copy, side by side with the old code.
        taken = [copy(first, count * lb, rows)
                 for first, count, _, _, _, rows, _ in order[:2]]
        cuts: dict[tuple[int, int], torch.Tensor] = {}      # block ids of each piece's pages

        # The rest on the scatter stream: the scatters launch on the current stream, and
        # the copies and events name their streams. A `with` per piece costs host time.
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            on = stream.cuda_stream
            self._uploads.reset()      # the last load's scatters are all queued
            blocks = self._uploads.put(block_ids)
            # Where each page lies in a buffer, for the layers starting at staged_for.
            first, count, held = order[0][:3]
            staged = self._staged_offsets(held, count * lb, shift(first), stream)
            staged_for = first
            for i, (first, count, held, p0, p1, rows, last) in enumerate(order):
                width = count * lb
                b, buf = taken[i] if i < len(taken) else copy(first, width, rows)
                stream.wait_event(handoff[b])
                if staged_for != first:
                    staged, staged_for = self._staged_offsets(held, width, shift(first),
                                                               stream), first
                cut = cuts.get((p0, p1))
                if cut is None:
                    cut = cuts[p0, p1] = blocks[p0 * k:p1 * k]
                n = p1 - p0
                scatter(buf, first, count, n, staged if n == held else staged[:n], cut,
                        align, on)
                self._free[b] = record(stream)
                if last:
                    events += [self._free[b]] * count
        return events, blocks


class DmaSaver(_Staging):
    """Saves by the copy engine: the kernel gathers a group of layers' blocks into a device
    staging buffer laid out as the pool lays out a page (the group's layers back to back),
    then one cudaMemcpy2DAsync per run of adjacent pool slots writes the rows out (width
    count * layer_bytes, pitch page_bytes).

    Why: a kernel save writes the pool through UVA from the SMs for as long as the bytes
    take on PCIe, beside the forward that produced them; the copy engine needs no SM while
    the bytes move, so the forward keeps its SMs (the gather is device to device, a small
    part of the copy's time). The gather runs on the save stream and the copy on a stream of its
    own, two buffers alternating, so a piece gathers while the previous one copies out.
    """

    def __init__(self, device: torch.device, staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        super().__init__(device, staging_bytes, priority=0)
        self.last = None                    # event: the newest copy out (finish_save)
        # Recorded on the save stream after each gather and waited for by the copy stream
        # at once, so one event serves every piece (as DmaLoader's handoff).
        self._handoff: Any = None

    def save(self, geo: Geometry, num_layers: int, plan: Plan, runs: list[tuple[int, int]],
             first: int, count: int, shift: int, save, cache_align: int,
             gather: Gather) -> None:
        """Layers [first, first + count) of the plan's pages, from their blocks to the
        host at plan.offsets; `save` is the save stream (it has waited for the forward;
        every launch and copy names its stream, so it need not be current). The kernel addresses layer l of page p at
        staging + offs[p] + l * layer_bytes, l counted in its layer table: `shift` = the
        group's first layer's index there times layer_bytes, taken off so the group
        starts at the buffer's start.

        A piece's host work is what bounds a short save (smaller pieces made it slower).
        So a piece enters no stream or device context of its own (the caller's are in
        force), makes no event for the handoff, and names its stream to the launch (a
        lookup costs host time); together these took a short save much closer to a pinned
        copy (a 1,024-token save reaches 90% of one: docs/perf/load-e21a8ae119.json). Each
        buffer keeps one event for
        when it is free, recorded anew per piece, and the flush that calls this enters no
        stream context either (core._flush_save)."""
        lb, pages = geo.layer_bytes, len(plan.offsets)
        if not pages:
            return
        width = count * lb
        self._reserve(width)
        chunk = max(1, self._staging[0].numel() // width)      # pages a buffer holds
        extent = num_layers * lb
        base = plan.host_t.data_ptr()
        meta = plan.meta
        assert meta is not None             # the plan makes it for every device copy
        held = min(chunk, pages)
        staged = self._staged_offsets(held, width, shift, save)
        blocks = meta[pages:]
        align = math.gcd(cache_align, lb, 16)
        copy = self._stream
        if self._handoff is None:
            self._handoff = torch.cuda.Event()
        handoff, on, to = self._handoff, save.cuda_stream, copy.cuda_stream
        for p0 in range(0, pages, chunk):
            p1 = min(pages, p0 + chunk)
            b, buf = self._take(save)
            gather(buf, first, count, p1 - p0, staged if p1 - p0 == held else staged[:p1 - p0],
                   blocks if p1 - p0 == pages else blocks[p0 * geo.k:p1 * geo.k], align, on)
            handoff.record(save)
            copy.wait_event(handoff)
            for r0, r1 in runs:
                r0, r1 = max(r0, p0), min(r1, p1)
                if r0 >= r1:
                    continue
                rc = self._lib.cudaMemcpy2DAsync(
                    base + int(plan.offsets[r0]) + first * lb, extent,
                    buf.data_ptr() + (r0 - p0) * width, width, width, r1 - r0,
                    _CUDA_MEMCPY_DEFAULT, to)
                if rc:
                    clear_cuda_error()
                    raise TransferError(f"cudaMemcpy2DAsync of layers {first}.."
                                        f"{first + count - 1} failed with CUDA error {rc}")
            # Each buffer's one event, recorded anew: its next user (_take) waits before
            # the next record, and finish_save wants only the newest (self.last).
            if self._free[b] is None:
                self._free[b] = torch.cuda.Event()
            self._free[b].record(copy)
            self.last = self._free[b]
