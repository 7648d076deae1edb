"""Attention straight over the paged cache: one Triton kernel per layer, no gathers.

Why it exists. A step that adds a few tokens after a long cached prefix (what a store hit
leaves to compute, and every decode) must cost what a real engine's costs: about one
weight-bound forward. Through torch's own ops it did not: FlashAttention takes contiguous
K/V, so each layer first gathered the whole context out of its blocks (128 MiB a layer at
32k tokens of an 8B model), and the op's Python path plus the gather cost more host time a
layer than the layer's GPU work at 16 new tokens. vLLM's backends read
K/V through the block table inside the kernel; so does this one.

The work is cut into tiles of at most BLOCK_M query rows of one request (consecutive
positions), each tile against one KV head with its GROUP query heads (GQA), so a program
computes a [BLOCK_M * GROUP, BLOCK_N] score block per iteration over the keys. When a step
has too few tiles to fill the GPU (a few new tokens over a long prefix) the keys are split
among SPLITS programs, each writing an unnormalised partial result, and a second kernel
combines them (the split-K of FlashDecoding). Splits are fixed per step, so two runs of
the same step add in the same order: results are deterministic.

Used for steps whose every request adds at most MAX_QUERY tokens (decodes and the
remainder of a hit); larger prefills keep FlashAttention, which is faster there and whose
gather is small against the attention itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

try:                                  # Triton ships with CUDA builds of torch; CI has none
    import triton
    import triton.language as tl
except ImportError:                   # pragma: no cover - depends on the install
    triton = None

__all__ = ["MAX_QUERY", "PagedPlan", "available", "paged_attention_triton", "plan"]

MAX_QUERY = 512        # longer steps attend through FlashAttention (see above)
_BLOCK_M = 16          # query rows per tile
_BLOCK_N = 64          # keys per iteration
_TARGET_PROGRAMS = 256  # about two programs per SM on an H100/H200 (132 SMs)
_MIN_KEYS_PER_SPLIT = 256


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


@dataclass(frozen=True, slots=True)
class PagedPlan:
    """A step's tiles for the kernel, built once per step and shared by every layer."""

    tiles: torch.Tensor      # [num_tiles, 4] int32 on the device: row0, rows, request, pos0
    num_tiles: int
    splits: int              # key ranges per tile (1: no combine pass)
    keys_per_split: int      # a multiple of _BLOCK_N
    num_tokens: int


def plan(q_lens: list[int], ctx_lens: list[int], num_kv_heads: int,
         device: torch.device) -> PagedPlan:
    """Tiles of consecutive query rows of one request each, and how to split the keys."""
    rows: list[int] = []
    start = 0
    for i, (q, ctx) in enumerate(zip(q_lens, ctx_lens, strict=True)):
        for j in range(0, q, _BLOCK_M):
            rows += [start + j, min(_BLOCK_M, q - j), i, ctx - q + j]
        start += q
    num_tiles = len(rows) // 4
    max_ctx = max(ctx_lens)
    programs = num_tiles * num_kv_heads
    splits = 1
    if programs < _TARGET_PROGRAMS // 2:
        splits = max(1, min(-(-_TARGET_PROGRAMS // programs), max_ctx // _MIN_KEYS_PER_SPLIT))
    per = -(-max_ctx // splits)
    per = -(-per // _BLOCK_N) * _BLOCK_N
    splits = -(-max_ctx // per)
    tiles = torch.tensor(rows, dtype=torch.int32).view(num_tiles, 4).to(device, non_blocking=True)
    return PagedPlan(tiles, num_tiles, splits, per, start)


def paged_attention_triton(q: torch.Tensor, kv_layer: torch.Tensor, block_table: torch.Tensor,
                           p: PagedPlan) -> torch.Tensor:
    """Causal attention of q [T, heads, head] over kv_layer [2, blocks, block_size, kv_heads,
    head] through block_table [requests, max_blocks]; returns [T, heads * head]."""
    num_tokens, heads, head = q.shape
    kv_heads = kv_layer.shape[3]
    group = heads // kv_heads
    out = q.new_empty(num_tokens, heads * head)
    k, v = kv_layer[0], kv_layer[1]
    scale = 1.0 / math.sqrt(head)
    grid = (p.num_tiles, kv_heads, p.splits)
    common = {"GROUP": group, "BLOCK_M": _BLOCK_M, "BLOCK_N": _BLOCK_N, "D": head,
              "BS": kv_layer.shape[2], "num_warps": 4, "num_stages": 2}
    if p.splits == 1:
        _attn_kernel[grid](q, k, v, block_table, p.tiles, out, out, out,
                           q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
                           block_table.stride(0), p.keys_per_split, scale, 0,
                           SPLIT=False, **common)
        return out
    acc = torch.empty(p.splits, num_tokens, heads, head, dtype=torch.float32, device=q.device)
    ml = torch.empty(p.splits, num_tokens, heads, 2, dtype=torch.float32, device=q.device)
    _attn_kernel[grid](q, k, v, block_table, p.tiles, out, acc, ml,
                       q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
                       block_table.stride(0), p.keys_per_split, scale, num_tokens * heads,
                       SPLIT=True, **common)
    _combine_kernel[(num_tokens * heads,)](acc, ml, out, num_tokens * heads, p.splits,
                                           SPLITS=triton.next_power_of_2(p.splits), D=head,
                                           num_warps=4)
    return out


if triton is not None:
    @triton.jit
    def _attn_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, tile_ptr, out_ptr, acc_ptr, ml_ptr,
                     s_qt, s_qh, s_blk, s_tok, s_head, s_bt, keys_per_split, scale, split_stride,
                     GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     D: tl.constexpr, BS: tl.constexpr, SPLIT: tl.constexpr):
        tile = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        row0 = tl.load(tile_ptr + tile * 4)
        nrows = tl.load(tile_ptr + tile * 4 + 1)
        req = tl.load(tile_ptr + tile * 4 + 2).to(tl.int64)
        pos0 = tl.load(tile_ptr + tile * 4 + 3)
        # Score rows: query row t of the tile with query head kvh * GROUP + g, m = t*GROUP+g.
        m = tl.arange(0, BLOCK_M * GROUP)
        t = m // GROUP
        h = kvh * GROUP + m % GROUP
        row_ok = t < nrows
        d = tl.arange(0, D)
        rows = (row0 + t).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * s_qt + h[:, None] * s_qh + d[None, :],
                    mask=row_ok[:, None], other=0.0)
        pos = pos0 + t                         # a row sees keys [0, pos]
        lo = split * keys_per_split
        hi = tl.minimum(pos0 + nrows, lo + keys_per_split)
        m_i = tl.full([BLOCK_M * GROUP], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M * GROUP], tl.float32)
        acc = tl.zeros([BLOCK_M * GROUP, D], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < hi
            blk = tl.load(bt_ptr + req * s_bt + n // BS, mask=n_ok, other=0).to(tl.int64)
            at = blk * s_blk + (n % BS) * s_tok + kvh * s_head
            kt = tl.load(k_ptr + at[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(kt)) * scale
            seen = n_ok[None, :] & (n[None, :] <= pos[:, None])
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            pr = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(pr, 1)
            vt = tl.load(v_ptr + at[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(pr.to(vt.dtype), vt)
            m_i = m_new
        hd = h[:, None] * D + d[None, :]
        if SPLIT:
            base = split * split_stride + rows * (GROUP * tl.num_programs(1)) + h
            tl.store(acc_ptr + base[:, None] * D + d[None, :], acc, mask=row_ok[:, None])
            tl.store(ml_ptr + base * 2, m_i, mask=row_ok)
            tl.store(ml_ptr + base * 2 + 1, l_i, mask=row_ok)
        else:
            res = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            width = GROUP * tl.num_programs(1) * D
            tl.store(out_ptr + rows[:, None] * width + hd, res.to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None])

    @triton.jit
    def _combine_kernel(acc_ptr, ml_ptr, out_ptr, split_stride, splits,
                        SPLITS: tl.constexpr, D: tl.constexpr):
        i = tl.program_id(0).to(tl.int64)    # (token, head), heads fastest: out's row order
        s = tl.arange(0, SPLITS)
        ok = s < splits
        m = tl.load(ml_ptr + (s * split_stride + i) * 2, mask=ok, other=float("-inf"))
        l_ = tl.load(ml_ptr + (s * split_stride + i) * 2 + 1, mask=ok, other=0.0)
        top = tl.max(m, 0)
        w = tl.where(ok & (m > float("-inf")), tl.exp(m - top), 0.0)
        d = tl.arange(0, D)
        acc = tl.load(acc_ptr + (s[:, None] * split_stride + i) * D + d[None, :],
                      mask=ok[:, None], other=0.0)
        num = tl.sum(acc * w[:, None], 0)
        den = tl.sum(l_ * w, 0)
        tl.store(out_ptr + i * D + d, (num / den).to(out_ptr.dtype.element_ty))
