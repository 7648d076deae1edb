"""The Triton kernel that moves layers between page slabs and engine blocks.

One launch covers one or several consecutive layers (grid axis 1): each layer's cache is
found from layer 0's by a byte distance kept on the device (LayerTable), so the caches
need not be one tensor, only share their strides.

Row u of a layer's work is U contiguous bytes of one head, both in the slab and in the
cache: u = ((((p * KV + kv) * T + t) * H + h) * R + r). In the slab (contiguous
[kv, T, H, D]) row u sits at offsets[p] + layer * host_layer_stride + (u mod
rows_per_page) * U; in the cache at deltas[layer] + kv*s_kv + block_ids[p, t // N]*s_blk +
(t mod N)*s_tok + h*s_head + r*U (byte strides of the kv5 view). A program takes ROWS rows at a time, strided by the grid
(persistent), so ALIGN-byte alignment plus contiguous columns give 16-byte accesses.
"""

from __future__ import annotations

import contextlib

import torch

from .plan import Geometry
from .runtime import TransferError

try:                                  # Triton ships with CUDA builds of torch; CI has none
    import triton
    import triton.language as tl
except ImportError:                   # pragma: no cover - depends on the install
    triton = None

__all__ = ["DEFAULT_MAX_CTAS", "LayerTable", "available", "launch", "load_ctas"]

# Default cap on the kernel's programs (persistent CTAs). Every cap from 16 to uncapped
# moved the same bytes a second: PCIe, not the SMs, is the limit, so take few and leave
# the rest of the SMs to the model.
DEFAULT_MAX_CTAS = 32


def load_ctas(unit: int) -> int:
    """The cap on a load's programs for rows of `unit` bytes (0 = one program per tile).

    A program's PCIe reads of short rows move less: the 1B preset's 128-byte rows needed
    128 programs to come near what the 8B preset's 256-byte rows reach with 32
    (docs/perf/load-e833749c3f.json has the 1B layout's loads). Saves write, and few
    programs already reach PCIe's speed for either; they keep DEFAULT_MAX_CTAS. Rows
    shorter than 128 bytes were not measured: no cap."""
    if unit >= 256:
        return DEFAULT_MAX_CTAS
    return 128 if unit >= 128 else 0


# Bytes one program moves per loop iteration (rows of one contiguous unit each).
_TILE_BYTES = 16 << 10


def available() -> bool:
    return triton is not None


def launch(geo: Geometry, caches: LayerTable, layer0: int, layers: int, host_t: torch.Tensor,
           pages: int, offs: torch.Tensor, blocks: torch.Tensor, host_layer_stride: int,
           align: int, to_cache: bool, max_ctas: int, stream: int | None = None) -> None:
    """One launch over layers [layer0, layer0 + layers): `pages` slabs at host_t + offs[p]
    + layer * host_layer_stride (host memory, or the DMA path's device staging) and their
    blocks of each layer's cache, on the stream whose handle is `stream` (None: the
    current stream; looking it up costs the host time on every launch)."""
    n_rows = pages * geo.kv * geo.page_tokens * geo.heads * geo.units_per_head
    rows = max(1, _TILE_BYTES // geo.unit)
    n_tiles = -(-n_rows // rows)
    # The cap is on the launch: a launch over several layers shares it among them.
    per_layer = max(1, -(-max_ctas // layers)) if max_ctas > 0 else n_tiles
    programs = min(n_tiles, per_layer)
    args = (host_t, caches.base, caches.deltas, offs, blocks, n_rows, -(-n_tiles // programs),
            layer0, host_layer_stride, *caches.strides)
    consts = (geo.kv, geo.page_tokens, geo.heads, geo.units_per_head, geo.block_size, geo.k,
              geo.unit, rows, align, to_cache)
    try:
        _LAUNCHER.launch((programs, layers), args, consts, stream)
    except (ValueError, RuntimeError) as exc:
        if "cannot be accessed from Triton" in str(exc):
            raise ValueError("the host array is not visible to the GPU: register it with "
                             "HostRegistration (or use pinned memory)") from exc
        raise TransferError(f"launching the KV copy kernel failed: {exc}") from exc


class LayerTable:
    """Every layer's cache for the kernel: layer 0's bytes, each layer's byte distance from
    it (on the device) and the strides they share, so one launch can cover several layers."""

    def __init__(self, layers: list[torch.Tensor]) -> None:
        self.base = layers[0]
        first = layers[0].data_ptr()
        self.deltas = torch.tensor([t.data_ptr() - first for t in layers], dtype=torch.int64,
                                   device=layers[0].device)
        self.strides = tuple(layers[0].stride()[:4])
        if any(tuple(t.stride()[:4]) != self.strides for t in layers):
            raise ValueError("every layer's cache view must have the same strides")


_CONSTS = ("KV", "T", "H", "R", "N", "K", "U", "ROWS", "ALIGN", "TO_CACHE")
_I32 = 1 << 31


def _spec(value) -> tuple:
    """What Triton specializes a kernel on for one argument: a pointer's 16-byte alignment;
    an integer's being 1, a multiple of 16, and whether it fits 32 bits."""
    if isinstance(value, torch.Tensor):
        return (value.data_ptr() % 16 == 0,)
    return (value == 1, value % 16 == 0, -_I32 <= value < _I32)


class _Launcher:
    """Launches the copy kernel without Triton's per-call argument binding.

    Triton's `kernel[grid](...)` binds, type-checks and specializes every argument on
    every call, and a short load launched one layer at a time spent longer launching
    than its bytes needed on PCIe. Once a specialization is compiled
    its launcher is called directly; the key holds every property Triton specializes on
    (_spec), so a call with other properties takes the full path and compiles or finds its
    own kernel.
    """

    def __init__(self) -> None:
        self._compiled: dict = {}

    def launch(self, grid: tuple[int, int], args: tuple, consts: tuple,
               stream: int | None = None) -> None:
        """On the current stream; `stream`, if given, is its handle."""
        key = (consts, tuple(_spec(a) for a in args))
        compiled = self._compiled.get(key)
        if compiled is None:
            # Triton launches on the current stream: make it the one named.
            with (contextlib.nullcontext() if stream is None
                  else torch.cuda.stream(torch.cuda.ExternalStream(stream))):
                compiled = _kv_copy_kernel[grid](*args, **dict(zip(_CONSTS, consts,
                                                                   strict=True)),
                                                 num_warps=4)
            self._compiled[key] = compiled
            return
        if stream is None:
            stream = torch.cuda.current_stream().cuda_stream
        compiled.run(grid[0], grid[1], 1, stream, compiled.function, compiled.packed_metadata,
                     None, None, None, *args, *consts)


_LAUNCHER = _Launcher()


if triton is not None:
    @triton.jit
    def _kv_copy_kernel(host_ptr, cache_ptr, deltas_ptr, offs_ptr, blocks_ptr, n_rows, iters,
                        layer0, host_layer_stride, s_kv, s_blk, s_tok, s_head,
                        KV: tl.constexpr, T: tl.constexpr, H: tl.constexpr, R: tl.constexpr,
                        N: tl.constexpr, K: tl.constexpr, U: tl.constexpr, ROWS: tl.constexpr,
                        ALIGN: tl.constexpr, TO_CACHE: tl.constexpr):
        cols = tl.arange(0, U)
        pid = tl.program_id(0).to(tl.int64)
        nprog = tl.num_programs(0)
        layer = layer0 + tl.program_id(1)
        delta = tl.load(deltas_ptr + layer)               # this layer's cache - layer 0's
        layer_off = layer.to(tl.int64) * host_layer_stride
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
            cache_row = tl.multiple_of(delta + kv * s_kv + blk * s_blk + (t % N) * s_tok
                                       + h * s_head + r * U, ALIGN)
            host_at = host_ptr + host_row[:, None] + cols[None, :]
            cache_at = cache_ptr + cache_row[:, None] + cols[None, :]
            mask = ok[:, None]
            if TO_CACHE:
                tl.store(cache_at, tl.load(host_at, mask=mask), mask=mask)
            else:
                tl.store(host_at, tl.load(cache_at, mask=mask), mask=mask)
