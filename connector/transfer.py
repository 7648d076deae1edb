"""Page slabs <-> paged KV caches: the connector's one module of streams, events and kernels.

Lifecycle (one KVTransfer per worker, used from the engine's thread; not thread-safe)::

    reg = HostRegistration(client.region().mem)     once at attach: cudaHostRegister the
                                                    whole pool mapping (never per request)
    xfer = KVTransfer([kv5(t, kind) for t in caches], page_tokens, device)

    load:  acq = client.acquire(ns, keys)           pages pinned in the pool
           h = xfer.load(pool, acq.offsets, ns.layer_bytes, block_ids)
                                                    every layer enqueued on the load stream,
                                                    one event per layer; returns at once
           h.wait_layer(l)                          before layer l's attention: the CURRENT
                                                    stream waits on layer l's event only
           h.done() / h.synchronize()               then acq.release()
    save:  res = client.reserve(ns, keys)           offsets, -1 = already stored
           xfer.save_layer(l, pool, res.offsets, block_ids)   after layer l wrote its KV:
                                                    the save stream waits for the current
                                                    stream's work so far, then copies out
           xfer.finish_save()                       host sync on every save enqueued since
                                                    the last finish_save; then res.commit()
    reg.close()                                     at detach

`block_ids` is (pages, k) int64: page p's tokens [j*block_size, (j+1)*block_size) live in
engine block block_ids[p, j]; page_tokens = k * block_size. A page in host memory is
num_layers slabs back to back, a slab [kv_factor, page_tokens, kv_heads, head_size]
contiguous (kvstore_client.layout.PageLayout); the caches are kv5 views
[kv_factor, blocks, block_size, kv_heads, head_size] (connector.kvviews).

How a layer moves, and why (H200, PCIe Gen5 x16; DESIGN.md "Measured limits"):
a layer's slabs of P pages sit at P scattered places in the pool (page p's slab at
offsets[p] + l * layer_bytes), 64 KiB each for an 8B-shaped 16-token page. One cudaMemcpy
per slab runs at ~11 GB/s at that size; a pinned staging copy needs the slabs contiguous
in host memory first (a CPU gather, no faster than memcpy). So the GPU path is one Triton
kernel per layer that reads the registered pool directly through its UVA address and
writes each head straight into its engine block (for saves the reverse: reads the blocks,
writes the pool) -- no staging buffer, no CPU copy, one launch per layer. Measured on
the H200 by bench/load_bench.py (8B shape, vLLM 0.33 4D caches, random block ids, host
wall-clock medians of 5 including launches, against one pinned cudaMemcpy of the bytes):

    tokens  bytes     load GB/s  of H2D    save GB/s  of D2H
    1k      128 MiB   44.0       80%       46.4       84%
    4k      512 MiB   49.0       89%       49.6       90%
    16k     2 GiB     50.3       91%       51.4       93%
    32k     4 GiB     50.6       91%       52.0       94%      (H2D 55.1-55.5, D2H 55.0-55.3)
    CopyMethod.COPIES at 16k: load 8.6, save 8.2 (one cudaMemcpy per 64 KiB slab)

The ~9% left on loads is the SMs' own PCIe reads against the copy engine's DMA (DESIGN.md
measured the same kernel idea at 51.3 of 55.5 on contiguous pages). The kernel is capped
at `max_ctas` persistent programs so that a load beside the model leaves most SMs free.

So a load whose pages lie in runs of adjacent slots (the usual case: a request's pages
are reserved together) goes by the copy engine instead (CopyMethod.DMA): per layer, one
cudaMemcpy2DAsync per run (rows of layer_bytes, pitch page_bytes) into a device staging
buffer, then the same kernel scatters the staging buffer into the blocks, device to
device, on a second stream while the next piece copies. Same bench, same run, H200:

    tokens  load GB/s  of H2D    (kernel alone at 16k: 50.1 GB/s)
    1k      45.8       83%
    4k      51.7       94%
    16k     53.9       97%
    32k     54.4       98%

On CPU tensors (CI) and with CopyMethod.COPIES the same API runs torch copies: per
slab `copy_` into a staging tensor and one indexed write per layer (and the reverse);
there are no streams on CPU and every call completes before it returns.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import enum
import math
import warnings
from collections.abc import Sequence

import numpy as np
import torch

try:                                  # Triton ships with CUDA builds of torch; CI has none
    import triton
    import triton.language as tl
except ImportError:                   # pragma: no cover - depends on the install
    triton = None

__all__ = ["CopyMethod", "HostRegistration", "KVTransfer", "LoadHandle", "SaveHandle",
           "TransferError"]

# Default cap on the kernel's programs (persistent CTAs). On the H200 16, 32, 64, 128 and
# uncapped all moved 49.8-50.2 GB/s (load) and 50.8-51.2 GB/s (save) at 16k tokens: PCIe,
# not the SMs, is the limit, so take few and leave the rest of the 132 SMs to the model.
DEFAULT_MAX_CTAS = 32
# Bytes one program moves per loop iteration (rows of one contiguous unit each).
_TILE_BYTES = 16 << 10
_CUDA_ERROR_ALREADY_REGISTERED = 712          # cudaErrorHostMemoryAlreadyRegistered
# Why loads of adjacent pages go by DMA. The kernel's own PCIe reads peak at ~91% of a
# pinned copy (the table above), while the copy engine reaches ~100% on runs of adjacent
# pages (shm --gpu: 55.3 of 55.4 GB/s for runs of 1 MiB slots). A layer's slabs of a run
# of adjacent pages are rows of one 2D copy (width layer_bytes, pitch page_bytes); a lone
# 64 KiB slab copies at ~11.5 GB/s, so a load takes the DMA path only when its pages form
# runs of at least this many on average.
_DMA_MIN_RUN = 8
# ... and only when a layer of the load is this large. The DMA path costs the host more per
# layer (a 2D copy per run, two streams, events between them): in the 8B e2e bench on the
# H200 a 1,024-token load (4 MiB a layer) went from 88% to 94% of a pinned copy on the
# device but from 66% to 42% timed on the host, its hit TTFT no better; from 4,096 tokens
# (16 MiB a layer) both gained (device 91 -> 97%, host 82 -> 86%).
_DMA_MIN_LAYER_BYTES = 8 << 20
# Device memory for the DMA path's staging: two buffers of this many bytes, taken once
# per KVTransfer on the first DMA load (a layer larger than one is moved in pieces).
DEFAULT_STAGING_BYTES = 64 << 20
_CUDA_MEMCPY_DEFAULT = 4                      # cudaMemcpyDefault: direction from UVA


class TransferError(RuntimeError):
    """A copy failed on the device (a CUDA error surfaced by a launch, query or sync)."""


class CopyMethod(enum.Enum):
    KERNEL = "kernel"    # one Triton kernel per layer over UVA host memory (CUDA default)
    # Loads by the copy engine: per layer, one 2D copy per run of pages adjacent in the
    # pool into a device staging buffer, then the kernel scatters it on the device. On
    # CUDA a load takes it when its pages form runs and its layers are large
    # (_DMA_MIN_RUN, _DMA_MIN_LAYER_BYTES); saves stay KERNEL.
    DMA = "dma"
    COPIES = "copies"    # torch copy_ per slab + indexed write (CPU; the CUDA fallback)


# -- host memory ---------------------------------------------------------------------------
class HostRegistration:
    """`mem` registered with cudaHostRegister for as long as this object is open.

    Registering makes the pages of the server's pool DMA-able and gives them a UVA
    address the GPU can read and write, so copies from the pool run at PCIe speed (55 GB/s
    on the H200, as from cudaHostAlloc memory). It costs time proportional to the size:
    533-652 ms for an 11 GiB pool already populated by the client's MAP_POPULATE (H200,
    bench/load_bench.py; DESIGN.md: 216 ms for 4 GiB touched, 803 ms for 2 GiB of another
    process's pages not yet touched). So register once per mapping, at attach, never per
    request. Without CUDA this is a no-op object.
    Memory some other registration already covers is used as is and not unregistered.
    """

    def __init__(self, mem: np.ndarray) -> None:
        self.mem = mem              # kept: the mapping must outlive the registration
        self.ptr = int(mem.ctypes.data) if mem.size else 0
        self.nbytes = int(mem.nbytes)
        self.registered = False     # True: this object registered it and must unregister
        if not torch.cuda.is_available() or not self.nbytes:
            return
        rc = _rc(torch.cuda.cudart().cudaHostRegister(self.ptr, self.nbytes, 0))
        if rc == _CUDA_ERROR_ALREADY_REGISTERED:
            _clear_cuda_error()
            return
        if rc != 0:
            _clear_cuda_error()
            raise TransferError(f"cudaHostRegister of {self.nbytes} bytes at {self.ptr:#x} "
                                f"failed with CUDA error {rc}")
        self.registered = True

    def close(self) -> None:
        """Unregister; waits for the device first, since a copy may still use the memory."""
        if self.registered:
            self.registered = False
            torch.cuda.synchronize()
            rc = _rc(torch.cuda.cudart().cudaHostUnregister(self.ptr))
            if rc != 0:
                _clear_cuda_error()
                raise TransferError(f"cudaHostUnregister failed with CUDA error {rc}")

    def __enter__(self) -> HostRegistration:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _rc(value) -> int:
    return int(getattr(value, "value", value))


def _cudart() -> ctypes.CDLL:
    """The CUDA runtime torch loaded (its Python bindings have no 2D copy)."""
    major = (torch.version.cuda or "0").split(".")[0]
    lib = ctypes.CDLL(f"libcudart.so.{major}")
    fn = lib.cudaMemcpy2DAsync
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                   ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return lib


def _page_runs(offsets: np.ndarray, extent: int) -> list[tuple[int, int]]:
    """[start, end) ranges of page indices whose pages lie back to back in the pool."""
    if not len(offsets):
        return []
    breaks = np.flatnonzero(np.diff(offsets) != extent) + 1
    edges = [0, *breaks.tolist(), len(offsets)]
    return list(zip(edges[:-1], edges[1:]))


def _clear_cuda_error() -> None:
    # The runtime keeps a failed call's error as the "last error"; a later unrelated
    # check (torch's, after a launch) would report it, so read it off.
    # torch's cudart bindings have no cudaGetLastError: call the runtime torch loaded.
    major = (torch.version.cuda or "0").split(".")[0]
    try:
        ctypes.CDLL(f"libcudart.so.{major}").cudaGetLastError()
    except (OSError, AttributeError):
        pass


# -- handles -------------------------------------------------------------------------------
class LoadHandle:
    """The layers of one load in flight: one event per layer (None on CPU: all done)."""

    def __init__(self, device: torch.device, events: list | None, keep: tuple) -> None:
        self._device = device
        self._events = events
        self._keep = keep        # host array, index tensors: alive until the copies end

    @property
    def num_layers(self) -> int:
        return len(self._events) if self._events is not None else 0

    def wait_layer(self, layer: int) -> None:
        """Make the current stream wait for layer `layer`'s copies (no host sync)."""
        if self._events is None:
            return
        if not 0 <= layer < len(self._events):
            raise IndexError(f"layer {layer} out of range [0, {len(self._events)})")
        torch.cuda.current_stream(self._device).wait_event(self._events[layer])

    def done(self) -> bool:
        """Whether every layer has landed (polls; raises TransferError on a CUDA error)."""
        if self._events is None:
            return True
        finished = _query(self._events[-1])   # one stream: the last event implies all
        if finished:
            self._keep = ()
        return finished

    def synchronize(self) -> None:
        """Block the host until every layer has landed."""
        if self._events is not None:
            _sync(self._events[-1])
            self._keep = ()


class SaveHandle(LoadHandle):
    """The saves enqueued between two finish_save calls (same polling as a load)."""


def _query(event) -> bool:
    try:
        return event.query()
    except RuntimeError as exc:
        raise TransferError(f"KV copy failed on the device: {exc}") from exc


def _sync(event) -> None:
    try:
        event.synchronize()
    except RuntimeError as exc:
        raise TransferError(f"KV copy failed on the device: {exc}") from exc


# -- geometry ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class _Geometry:
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


def _geometry(layers: Sequence[torch.Tensor], page_tokens: int) -> _Geometry:
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
    return _Geometry(kv, blocks, block_size, heads, head, page_tokens, first.dtype, unit)


# -- the transfer --------------------------------------------------------------------------
class KVTransfer:
    """Moves page slabs between host memory and the engine's paged caches, layer by layer.

    layers: kv5 views in layer order (connector.kvviews.kv5), all of one shape and dtype;
    page_tokens: tokens per store page (a multiple of the views' block_size);
    device: where the views live. max_ctas caps the kernel's programs (0 = one per tile);
    method: None = KERNEL on CUDA, COPIES on CPU.
    """

    def __init__(self, layers: Sequence[torch.Tensor], page_tokens: int,
                 device: torch.device | str | None = None, *, max_ctas: int = DEFAULT_MAX_CTAS,
                 method: CopyMethod | None = None,
                 staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        self.layers = list(layers)
        self.geo = _geometry(self.layers, page_tokens)
        self.device = torch.device(device) if device is not None else self.layers[0].device
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.layers[0].device != self.device:
            raise ValueError(f"the views are on {self.layers[0].device}, not {self.device}")
        self.cuda = self.device.type == "cuda"
        self.method = method or (CopyMethod.KERNEL if self.cuda else CopyMethod.COPIES)
        if self.method in (CopyMethod.KERNEL, CopyMethod.DMA) and triton is None:
            raise ValueError(f"{self.method} needs Triton")
        if self.method is CopyMethod.DMA and not self.cuda:
            raise ValueError("CopyMethod.DMA needs a CUDA device")
        # Unless a method was named, a CUDA load of pages in runs goes by DMA.
        self._dma_auto = method is None and self.cuda
        self.staging_bytes = staging_bytes
        self._staging: list[torch.Tensor] = []      # the DMA path's two buffers
        self._staging_free: list = [None, None]     # event: the buffer's last scatter done
        self._scatter_stream = None
        self._lib = None
        self.max_ctas = max_ctas
        # Byte views: strides in bytes, a uint8 pointer for the kernel.
        self._bytes = [v.view(torch.uint8) for v in self.layers]
        self._cache_align = math.gcd(self.geo.unit, *(s for b in self._bytes
                                                      for s in b.stride()[:4]),
                                     *(b.data_ptr() for b in self._bytes))
        self._load_stream = self._save_stream = None
        if self.cuda:
            # Loads gate the model's layers: high priority, so their programs are
            # scheduled ahead of queued compute work. Saves have slack until finish_save.
            self._load_stream = torch.cuda.Stream(self.device, priority=-1)
            self._save_stream = torch.cuda.Stream(self.device)
        self._pending: list = []          # save events since the last finish_save
        self._pending_keep: list = []     # what those saves read or write
        self._save_plans: dict = {}       # checked save pages, until finish_save

    # -- loads ---------------------------------------------------------------------------
    def load(self, host: np.ndarray, offsets: np.ndarray, layer_bytes: int,
             block_ids: np.ndarray) -> LoadHandle:
        """Enqueue every layer of pages at `offsets` in `host` into `block_ids`.

        On CUDA the load stream first waits for the current stream's work so far (the
        blocks may have been in use), then copies layer by layer; the host memory must be
        registered (HostRegistration) or pinned, and stay untouched until done(). Keep the
        handle until then: it holds what the copies read.
        """
        if layer_bytes != self.geo.layer_bytes:
            raise ValueError(f"layer_bytes {layer_bytes} does not match the caches: "
                             f"{self.geo.layer_bytes} per layer of a {self.geo.page_tokens}-"
                             f"token page")
        events = []
        with self._on(self._load_stream):
            plan = self._plan(host, offsets, block_ids, save=False)
            runs = _page_runs(plan.offsets, len(self.layers) * self.geo.layer_bytes)
            if self.method is CopyMethod.DMA or (
                    self._dma_auto and runs and len(plan.offsets) >= _DMA_MIN_RUN * len(runs)
                    and len(plan.offsets) * self.geo.layer_bytes >= _DMA_MIN_LAYER_BYTES):
                return LoadHandle(self.device, self._dma_load(plan, runs), (plan,))
            for layer in range(len(self.layers)):
                self._copy_layer(layer, plan, to_cache=True)
                events.append(self._record(self._load_stream))
        return LoadHandle(self.device, events if self.cuda else None, (plan,))

    def _dma_load(self, plan: _Plan, runs: list[tuple[int, int]]) -> list:
        """Every layer by the copy engine into a staging buffer (load stream), scattered
        into the blocks by the kernel (scatter stream); the two buffers alternate, so the
        copy of one piece runs while the previous one scatters. One event per layer, on
        the scatter stream, recorded once the layer is in its blocks."""
        g = self.geo
        lb, pages = g.layer_bytes, len(plan.offsets)
        if not pages:
            return [self._record(self._load_stream) for _ in self.layers]
        if not self._staging:
            self._lib = _cudart()
            per = max(lb, self.staging_bytes // lb * lb)
            self._staging = [torch.empty(per, dtype=torch.uint8, device=self.device)
                             for _ in range(2)]
            self._scatter_stream = torch.cuda.Stream(self.device, priority=-1)
        chunk = self._staging[0].numel() // lb          # pages a buffer holds
        extent = len(self.layers) * lb
        base = int(plan.host.ctypes.data)
        load, scatter = self._load_stream, self._scatter_stream
        meta = plan.meta
        staged = torch.arange(min(chunk, pages), dtype=torch.int64, device=self.device) * lb
        # Made on the load stream, read on the scatter stream: the allocator must not hand
        # their memory out again before the scatters are done.
        staged.record_stream(scatter)
        meta.record_stream(scatter)
        align = math.gcd(self._cache_align, lb, 16)
        events, piece = [], 0
        with torch.cuda.device(self.device):
            for layer in range(len(self.layers)):
                for p0 in range(0, pages, chunk):
                    p1 = min(pages, p0 + chunk)
                    b = piece % 2
                    piece += 1
                    buf = self._staging[b]
                    if self._staging_free[b] is not None:
                        load.wait_event(self._staging_free[b])
                    for r0, r1 in runs:
                        r0, r1 = max(r0, p0), min(r1, p1)
                        if r0 >= r1:
                            continue
                        rc = self._lib.cudaMemcpy2DAsync(
                            buf.data_ptr() + (r0 - p0) * lb, lb,
                            base + int(plan.offsets[r0]) + layer * lb, extent, lb, r1 - r0,
                            _CUDA_MEMCPY_DEFAULT, load.cuda_stream)
                        if rc:
                            _clear_cuda_error()
                            raise TransferError(f"cudaMemcpy2DAsync of layer {layer} "
                                                f"failed with CUDA error {rc}")
                    scatter.wait_event(self._record(load))
                    with torch.cuda.stream(scatter):
                        self._launch(buf, layer, p1 - p0, staged[:p1 - p0],
                                     meta[pages + p0 * g.k:pages + p1 * g.k], 0, align, True)
                    self._staging_free[b] = self._record(scatter)
                events.append(self._staging_free[(piece - 1) % 2])
        return events

    # -- saves ---------------------------------------------------------------------------
    def save_layer(self, layer: int, host: np.ndarray, offsets: np.ndarray,
                   block_ids: np.ndarray) -> None:
        """Copy layer `layer` of the pages in `block_ids` to `host` at `offsets` (-1: skip).

        On CUDA the save stream first waits for the current stream's work so far (the
        layer's KV was just written there); finish_save() waits for the copies.
        """
        if not 0 <= layer < len(self.layers):
            raise IndexError(f"layer {layer} out of range [0, {len(self.layers)})")
        with self._on(self._save_stream):
            # Called once per layer with the same pages: check and upload them once per
            # finish_save. The key holds the host array's identity and every value.
            offsets = np.asarray(offsets, dtype=np.int64)
            block_ids = np.asarray(block_ids, dtype=np.int64)
            key = (id(host), offsets.tobytes(), block_ids.tobytes(), block_ids.shape)
            plan = self._save_plans.get(key)
            if plan is None or plan.host is not host:
                plan = self._save_plans[key] = self._plan(host, offsets, block_ids, save=True)
            self._copy_layer(layer, plan, to_cache=False)
            event = self._record(self._save_stream)
        if self.cuda:
            self._pending.append(event)
            self._pending_keep.append(plan)

    def finish_save(self, wait: bool = True) -> SaveHandle:
        """A handle on every save enqueued since the last call; wait=True blocks until they
        have landed (TransferError if one failed)."""
        events, keep = self._pending, tuple(self._pending_keep)
        self._pending, self._pending_keep = [], []
        self._save_plans = {}
        handle = SaveHandle(self.device, events if (self.cuda and events) else None, keep)
        if wait:
            handle.synchronize()
        return handle

    # -- checks ----------------------------------------------------------------------------
    def _plan(self, host: np.ndarray, offsets, block_ids, *, save: bool) -> _Plan:
        """Validated pages of one load or save (for saves, offset -1 rows dropped), with
        the index uploaded to the device (current stream)."""
        if not isinstance(host, np.ndarray) or host.dtype != np.uint8 or host.ndim != 1 \
                or not host.flags.c_contiguous:
            raise ValueError("host must be a 1-d contiguous uint8 numpy array (the pool "
                             "mapping or a pinned buffer)")
        if save and not host.flags.writeable:
            raise ValueError("save_layer needs a writable host array")
        offsets = np.asarray(offsets, dtype=np.int64).reshape(-1)
        block_ids = np.asarray(block_ids, dtype=np.int64)
        k = self.geo.k
        if block_ids.ndim == 1 and k == 1:
            block_ids = block_ids.reshape(-1, 1)
        if block_ids.shape != (len(offsets), k):
            raise ValueError(f"block_ids must be (pages, {k}) for {len(offsets)} pages of "
                             f"{self.geo.page_tokens} tokens in blocks of "
                             f"{self.geo.block_size}, got shape {block_ids.shape}")
        if save:
            keep = offsets != -1
            offsets, block_ids = offsets[keep], block_ids[keep]
        page_extent = len(self.layers) * self.geo.layer_bytes
        if len(offsets):
            if offsets.min() < 0 or offsets.max() > host.size - page_extent:
                bad = offsets[(offsets < 0) | (offsets > host.size - page_extent)][0]
                raise ValueError(f"page offset {int(bad)} is outside the host array: a page "
                                 f"of {page_extent} bytes must fit in [0, {host.size})")
            if block_ids.min() < 0 or block_ids.max() >= self.geo.blocks:
                raise ValueError(f"block ids must be in [0, {self.geo.blocks}), got "
                                 f"[{int(block_ids.min())}, {int(block_ids.max())}]")
            if save and len(offsets) > 1 and np.diff(np.sort(offsets)).min() < page_extent:
                raise ValueError(f"page offsets overlap: pages of {page_extent} bytes need "
                                 f"offsets at least that far apart")
            if not save and len(np.unique(block_ids)) != block_ids.size:
                raise ValueError("block_ids repeat a block: two pages cannot load into one "
                                 "block")
        offsets, block_ids = np.ascontiguousarray(offsets), np.ascontiguousarray(block_ids)
        host_t = _as_tensor(host)
        align = math.gcd(self._cache_align, host_t.data_ptr(), self.geo.layer_bytes,
                         int(np.gcd.reduce(offsets)) if len(offsets) else 0, 16)
        return _Plan(host, host_t, offsets, block_ids, self._upload(offsets, block_ids), align)

    # -- CUDA kernel path --------------------------------------------------------------------
    def _on(self, stream):
        """Run on `stream` after the current stream's work so far (nothing on CPU)."""
        if stream is None:
            return contextlib.nullcontext()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(stream)

    @staticmethod
    def _record(stream):
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def _upload(self, offsets: np.ndarray, block_ids: np.ndarray) -> torch.Tensor | None:
        """offsets then block ids as one int64 tensor on the device (current stream), for
        the kernel; None for CopyMethod.COPIES."""
        if self.method is CopyMethod.COPIES or not len(offsets):
            return None
        staged = torch.empty(len(offsets) + block_ids.size, dtype=torch.int64,
                             pin_memory=self.cuda)
        staged_np = staged.numpy()
        staged_np[:len(offsets)] = offsets
        staged_np[len(offsets):] = block_ids.reshape(-1)
        return staged.to(self.device, non_blocking=True)

    def _copy_layer(self, layer: int, plan: _Plan, *, to_cache: bool) -> None:
        pages = len(plan.offsets)
        if not pages:
            return
        if self.method is CopyMethod.COPIES:
            self._copies(layer, plan, to_cache=to_cache)
            return
        self._launch(plan.host_t, layer, pages, plan.meta[:pages], plan.meta[pages:],
                     layer * self.geo.layer_bytes, plan.align, to_cache)

    def _launch(self, host_t: torch.Tensor, layer: int, pages: int, offs: torch.Tensor,
                blocks: torch.Tensor, layer_off: int, align: int, to_cache: bool) -> None:
        """The kernel over `pages` slabs at host_t + offs[p] + layer_off (host memory, or
        the DMA path's device staging) and their blocks of `layer`'s cache."""
        g = self.geo
        cache = self._bytes[layer]
        n_rows = pages * g.kv * g.page_tokens * g.heads * g.units_per_head
        rows = max(1, _TILE_BYTES // g.unit)
        n_tiles = triton.cdiv(n_rows, rows)
        programs = min(n_tiles, self.max_ctas) if self.max_ctas > 0 else n_tiles
        try:
            _kv_copy_kernel[(programs,)](
                host_t, cache, offs, blocks, n_rows,
                triton.cdiv(n_tiles, programs), layer_off, *cache.stride()[:4],
                KV=g.kv, T=g.page_tokens, H=g.heads, R=g.units_per_head, N=g.block_size,
                K=g.k, U=g.unit, ROWS=rows, ALIGN=align, TO_CACHE=to_cache, num_warps=4)
        except (ValueError, RuntimeError) as exc:
            if "cannot be accessed from Triton" in str(exc):
                raise ValueError("the host array is not visible to the GPU: register it with "
                                 "HostRegistration (or use pinned memory)") from exc
            raise TransferError(f"launching the KV copy kernel failed: {exc}") from exc

    # -- torch copies (CPU, and the CUDA fallback) ---------------------------------------------
    def _copies(self, layer: int, plan: _Plan, *, to_cache: bool) -> None:
        g = self.geo
        view, host_t = self.layers[layer], plan.host_t
        lb = g.layer_bytes
        start = layer * lb
        pages = len(plan.offsets)
        index = torch.from_numpy(plan.block_ids.reshape(-1)).to(self.device, non_blocking=True)
        # [P, kv, k, N, H, D] slabs  <->  view[:, blocks]: [kv, P*k, N, H, D]
        if to_cache:
            staging = torch.empty((pages, lb), dtype=torch.uint8, device=self.device)
            for row, off in zip(staging, plan.offsets.tolist()):
                row.copy_(host_t[off + start:off + start + lb], non_blocking=True)
            slabs = staging.view(g.dtype).view(pages, g.kv, g.page_tokens, g.heads, g.head)
            view[:, index] = slabs.transpose(0, 1).reshape(g.kv, pages * g.k, g.block_size,
                                                           g.heads, g.head)
        else:
            gathered = view[:, index].reshape(g.kv, pages, g.page_tokens, g.heads, g.head)
            slabs = gathered.transpose(0, 1).contiguous().view(torch.uint8).view(pages, lb)
            for row, off in zip(slabs, plan.offsets.tolist()):
                host_t[off + start:off + start + lb].copy_(row, non_blocking=True)


@dataclasses.dataclass(frozen=True, slots=True)
class _Plan:
    """The checked pages of one load, or of one save across its layers."""

    host: np.ndarray                 # kept alive until the copies end
    host_t: torch.Tensor             # the same memory as a CPU tensor (the kernel's pointer)
    offsets: np.ndarray              # (P,) int64 page offsets in host, all valid
    block_ids: np.ndarray            # (P, k) int64
    meta: torch.Tensor | None        # offsets ‖ block ids on the device (kernel path)
    align: int                       # bytes every row address is a multiple of (<= 16)


def _as_tensor(host: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():          # a read-only pool view is only ever read
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(host)


# -- the kernel --------------------------------------------------------------------------------
# Row u of a layer's work is U contiguous bytes of one head, both in the slab and in the
# cache: u = ((((p * KV + kv) * T + t) * H + h) * R + r). In the slab (contiguous
# [kv, T, H, D]) row u sits at offsets[p] + layer_off + (u mod rows_per_page) * U; in the
# cache at kv*s_kv + block_ids[p, t // N]*s_blk + (t mod N)*s_tok + h*s_head + r*U (byte
# strides of the kv5 view). A program takes ROWS rows at a time, strided by the grid
# (persistent), so ALIGN-byte alignment plus contiguous columns give 16-byte accesses.
if triton is not None:
    @triton.jit
    def _kv_copy_kernel(host_ptr, cache_ptr, offs_ptr, blocks_ptr, n_rows, iters, layer_off,
                        s_kv, s_blk, s_tok, s_head,
                        KV: tl.constexpr, T: tl.constexpr, H: tl.constexpr, R: tl.constexpr,
                        N: tl.constexpr, K: tl.constexpr, U: tl.constexpr, ROWS: tl.constexpr,
                        ALIGN: tl.constexpr, TO_CACHE: tl.constexpr):
        cols = tl.arange(0, U)
        pid = tl.program_id(0).to(tl.int64)
        nprog = tl.num_programs(0)
        for i in range(iters):                  # past the last tile every row is masked
            u = (pid + i * nprog) * ROWS + tl.arange(0, ROWS)
            ok = u < n_rows
            p = u // (KV * T * H * R)
            w = u % (KV * T * H * R)
            r = w % R
            h = (w // R) % H
            t = (w // (R * H)) % T
            kv = w // (R * H * T)
            off = tl.load(offs_ptr + p, mask=ok, other=0)
            blk = tl.load(blocks_ptr + p * K + t // N, mask=ok, other=0)
            host_row = tl.multiple_of(off + layer_off + w * U, ALIGN)
            cache_row = tl.multiple_of(kv * s_kv + blk * s_blk + (t % N) * s_tok + h * s_head
                                       + r * U, ALIGN)
            host_at = host_ptr + host_row[:, None] + cols[None, :]
            cache_at = cache_ptr + cache_row[:, None] + cols[None, :]
            mask = ok[:, None]
            if TO_CACHE:
                tl.store(cache_at, tl.load(host_at, mask=mask), mask=mask)
            else:
                tl.store(host_at, tl.load(cache_at, mask=mask), mask=mask)
