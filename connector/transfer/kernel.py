"""The Triton kernel that moves one layer between page slabs and engine blocks.

Row u of a layer's work is U contiguous bytes of one head, both in the slab and in the
cache: u = ((((p * KV + kv) * T + t) * H + h) * R + r). In the slab (contiguous
[kv, T, H, D]) row u sits at offsets[p] + layer_off + (u mod rows_per_page) * U; in the
cache at kv*s_kv + block_ids[p, t // N]*s_blk + (t mod N)*s_tok + h*s_head + r*U (byte
strides of the kv5 view). A program takes ROWS rows at a time, strided by the grid
(persistent), so ALIGN-byte alignment plus contiguous columns give 16-byte accesses.
"""

from __future__ import annotations

import torch

from .plan import Geometry
from .runtime import TransferError

try:                                  # Triton ships with CUDA builds of torch; CI has none
    import triton
    import triton.language as tl
except ImportError:                   # pragma: no cover - depends on the install
    triton = None

__all__ = ["DEFAULT_MAX_CTAS", "available", "launch"]

# Default cap on the kernel's programs (persistent CTAs). On the H200 16, 32, 64, 128 and
# uncapped all moved 49.8-50.2 GB/s (load) and 50.8-51.2 GB/s (save) at 16k tokens: PCIe,
# not the SMs, is the limit, so take few and leave the rest of the 132 SMs to the model.
DEFAULT_MAX_CTAS = 32
# Bytes one program moves per loop iteration (rows of one contiguous unit each).
_TILE_BYTES = 16 << 10


def available() -> bool:
    return triton is not None


def launch(geo: Geometry, cache: torch.Tensor, host_t: torch.Tensor, pages: int,
           offs: torch.Tensor, blocks: torch.Tensor, layer_off: int, align: int,
           to_cache: bool, max_ctas: int) -> None:
    """The kernel over `pages` slabs at host_t + offs[p] + layer_off (host memory, or the
    DMA path's device staging) and their blocks of one layer's cache (`cache`: the
    layer's kv5 view as bytes), on the current stream."""
    n_rows = pages * geo.kv * geo.page_tokens * geo.heads * geo.units_per_head
    rows = max(1, _TILE_BYTES // geo.unit)
    n_tiles = triton.cdiv(n_rows, rows)
    programs = min(n_tiles, max_ctas) if max_ctas > 0 else n_tiles
    try:
        _kv_copy_kernel[(programs,)](
            host_t, cache, offs, blocks, n_rows,
            triton.cdiv(n_tiles, programs), layer_off, *cache.stride()[:4],
            KV=geo.kv, T=geo.page_tokens, H=geo.heads, R=geo.units_per_head,
            N=geo.block_size, K=geo.k, U=geo.unit, ROWS=rows, ALIGN=align,
            TO_CACHE=to_cache, num_warps=4)
    except (ValueError, RuntimeError) as exc:
        if "cannot be accessed from Triton" in str(exc):
            raise ValueError("the host array is not visible to the GPU: register it with "
                             "HostRegistration (or use pinned memory)") from exc
        raise TransferError(f"launching the KV copy kernel failed: {exc}") from exc


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
