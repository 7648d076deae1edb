"""What a copy needs to know before it touches a device: the caches' geometry, the checked
pages of a load or save, and where they lie in runs. Numpy and shapes only, no streams."""

from __future__ import annotations

import dataclasses
import enum
import itertools
import warnings
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["CopyMethod", "Geometry", "Plan", "as_tensor", "check_pages", "geometry",
           "page_runs"]


class CopyMethod(enum.Enum):
    KERNEL = "kernel"    # one Triton kernel per layer over UVA host memory (CUDA default)
    # By the copy engine: a load copies, per layer, one 2D copy per run of pages adjacent
    # in the pool into a device staging buffer, then the kernel scatters it on the device;
    # a save gathers on the device and copies out the same way (dma.py). On CUDA a load
    # takes it when its pages form runs and its layers are large (core._DMA_MIN_RUN,
    # core._DMA_MIN_LAYER_BYTES), a save when, besides, its pages form runs
    # (core._DMA_SAVE_MIN_RUN).
    DMA = "dma"
    COPIES = "copies"    # torch copy_ per slab + indexed write (CPU; the CUDA fallback)


@dataclasses.dataclass(frozen=True, slots=True)
class Geometry:
    """The shapes a transfer needs, checked once against every layer's view."""

    kv: int           # kv_factor
    blocks: int       # engine blocks per layer
    block_size: int   # N: tokens per engine block
    heads: int        # H
    head: int         # D: elements per head
    page_tokens: int  # T = k * N
    dtype: torch.dtype
    unit: int         # U: bytes per kernel row (a power of two dividing a head's bytes)

    @property
    def k(self) -> int:
        return self.page_tokens // self.block_size

    @property
    def layer_bytes(self) -> int:
        return self.kv * self.page_tokens * self.heads * self.head * self.dtype.itemsize

    @property
    def units_per_head(self) -> int:
        return self.head * self.dtype.itemsize // self.unit


def geometry(layers: Sequence[torch.Tensor], page_tokens: int) -> Geometry:
    if not layers:
        raise ValueError("KVTransfer needs at least one layer")
    first = layers[0]
    for i, view in enumerate(layers):
        if view.dim() != 5:
            raise ValueError(f"layer {i}: expected a kv5 view [kv, blocks, block_size, "
                             f"heads, head] (connector.kvviews.kv5), got shape "
                             f"{tuple(view.shape)}")
        if view.shape != first.shape or view.dtype != first.dtype \
                or view.device != first.device:
            raise ValueError(f"layer {i}: {tuple(view.shape)} {view.dtype} on {view.device} "
                             f"differs from layer 0's {tuple(first.shape)} {first.dtype} on "
                             f"{first.device}")
        if view.stride(4) != 1:
            raise ValueError(f"layer {i}: the head dimension must be contiguous (stride 1), "
                             f"got strides {view.stride()}")
    kv, blocks, block_size, heads, head = first.shape
    if kv not in (1, 2):
        raise ValueError(f"kv_factor must be 1 or 2, got {kv}")
    if page_tokens <= 0 or page_tokens % block_size:
        raise ValueError(f"page_tokens ({page_tokens}) must be a positive multiple of the "
                         f"engine's block_size ({block_size})")
    head_bytes = head * first.dtype.itemsize
    unit = min(head_bytes & -head_bytes, 512)       # largest power of two dividing it
    return Geometry(kv, blocks, block_size, heads, head, page_tokens, first.dtype, unit)


def check_pages(geo: Geometry, num_layers: int, host: np.ndarray, offsets, block_ids, *,
                save: bool) -> tuple[np.ndarray, np.ndarray]:
    """The pages of one load or save, checked against `host` and the caches: (offsets,
    block_ids) as contiguous int64 arrays, block_ids (pages, k); for saves the rows with
    offset -1 (already stored) dropped. ValueError says what is wrong."""
    if not isinstance(host, np.ndarray) or host.dtype != np.uint8 or host.ndim != 1 \
            or not host.flags.c_contiguous:
        raise ValueError("host must be a 1-d contiguous uint8 numpy array (the pool "
                         "mapping or a pinned buffer)")
    if save and not host.flags.writeable:
        raise ValueError("save_layer needs a writable host array")
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1)
    block_ids = np.asarray(block_ids, dtype=np.int64)
    k = geo.k
    if block_ids.ndim == 1 and k == 1:
        block_ids = block_ids.reshape(-1, 1)
    if block_ids.shape != (len(offsets), k):
        raise ValueError(f"block_ids must be (pages, {k}) for {len(offsets)} pages of "
                         f"{geo.page_tokens} tokens in blocks of {geo.block_size}, got "
                         f"shape {block_ids.shape}")
    if save:
        keep = offsets != -1
        if not keep.all():
            offsets, block_ids = offsets[keep], block_ids[keep]
    page_extent = num_layers * geo.layer_bytes
    if len(offsets):
        # These checks are on every copy's critical path, where each numpy call costs the
        # host microseconds (caches cold between copies), and the checks as first written
        # made a dozen. Pages back to back in ascending order, the usual case, are
        # bounded by the first and last and cannot overlap: one pass.
        one_run = len(offsets) == 1 or bool((np.diff(offsets) == page_extent).all())
        lo, hi = ((int(offsets[0]), int(offsets[-1])) if one_run
                  else (int(offsets.min()), int(offsets.max())))
        if lo < 0 or hi > host.size - page_extent:
            bad = offsets[(offsets < 0) | (offsets > host.size - page_extent)][0]
            raise ValueError(f"page offset {int(bad)} is outside the host array: a page "
                             f"of {page_extent} bytes must fit in [0, {host.size})")
        first, last, repeats = _id_facts(block_ids, repeats=not save)
        if first < 0 or last >= geo.blocks:
            raise ValueError(f"block ids must be in [0, {geo.blocks}), got "
                             f"[{first}, {last}]")
        if save and not one_run and np.diff(np.sort(offsets)).min() < page_extent:
            raise ValueError(f"page offsets overlap: pages of {page_extent} bytes need "
                             f"offsets at least that far apart")
        if repeats:
            raise ValueError("block_ids repeat a block: two pages cannot load into one "
                             "block")
    return np.ascontiguousarray(offsets), np.ascontiguousarray(block_ids)


# Up to this many block ids are checked in Python: three numpy calls cost more there.
_IDS_IN_PYTHON = 1024


def _id_facts(block_ids: np.ndarray, *, repeats: bool) -> tuple[int, int, bool]:
    """The least and greatest block id, and (if asked) whether one repeats."""
    if block_ids.size <= _IDS_IN_PYTHON:
        ids = block_ids.ravel().tolist()
        return min(ids), max(ids), repeats and len(set(ids)) != len(ids)
    return (int(block_ids.min()), int(block_ids.max()),
            repeats and len(np.unique(block_ids)) != block_ids.size)


def page_runs(offsets: np.ndarray, extent: int) -> list[tuple[int, int]]:
    """[start, end) ranges of page indices whose pages lie back to back in the pool."""
    if not len(offsets):
        return []
    steps = np.diff(offsets)
    if (steps == extent).all():         # one run: a load's usual case, on its critical path
        return [(0, len(offsets))]
    breaks = np.flatnonzero(steps != extent) + 1
    edges = [0, *breaks.tolist(), len(offsets)]
    return list(itertools.pairwise(edges))


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """The checked pages of one load, or of one save across its layers."""

    host: np.ndarray                 # kept alive until the copies end
    host_t: torch.Tensor             # the same memory as a CPU tensor (the kernel's pointer)
    offsets: np.ndarray              # (P,) int64 page offsets in host, all valid
    block_ids: np.ndarray            # (P, k) int64
    meta: torch.Tensor | None        # offsets ‖ block ids on the device (kernel path)
    align: int                       # bytes every row address is a multiple of (<= 16)


def as_tensor(host: np.ndarray) -> torch.Tensor:
    """`host` as a CPU tensor sharing its memory (a read-only pool view is only read).

    On every copy's path: torch warns only for read-only arrays, and silencing the
    warning (warnings.catch_warnings) costs more than the conversion, so a writable
    array, the pool mapping's case, goes straight through."""
    if host.flags.writeable:
        return torch.from_numpy(host)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(host)
