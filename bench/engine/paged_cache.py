"""A paged KV cache in vLLM's FlashAttention layout, and attention over it for one step.

One tensor per layer, keyed by vLLM's attention-layer name, so the connector registers these
tensors exactly as it registers vLLM's (``register_kv_caches(dict[name, tensor])``)::

    kv_caches["model.layers.{i}.self_attn.attn"]:
        [2, num_blocks, block_size, num_kv_heads, head_size]      # index 0 = K, 1 = V
         |      |           |
         |      |           +-- token offset inside the block
         |      +-------------- block id (what a block table lists)
         +--------------------- K or V

A token's *slot* is ``block_id * block_size + offset``, as in vLLM's ``slot_mapping``. Because
the tensor is contiguous, ``[2, num_blocks * block_size, heads, head]`` is a free view of it,
and a slot indexes its second dimension directly: writes are one ``index_copy_`` per K and V,
and a request's context is one ``index_select`` of whole blocks, with no per-token Python.

A step (``SeqStep`` per request: new tokens, tokens already cached, block table) becomes a
``StepMetadata`` once, shared by all layers: positions, slots, and attention groups.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import CausalBias, causal_lower_right

from . import paged_attn
from .paged_attn import PagedPlan

# SDPA's backends, cuDNN left out. On the H200 (torch 2.11) SDPA picks cuDNN for the decode
# attention, and there two identical greedy runs of the 1B preset drew different attention
# outputs from equal inputs from the third decode step on (a race: it went away when the
# host waited for the GPU before each step, under CUDA_LAUNCH_BLOCKING=1, and with the
# flash backend). FlashAttention serves every bf16/fp16 shape here; the others catch the rest.
_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

__all__ = [
    "PagedCacheSpec",
    "SeqStep",
    "StepMetadata",
    "allocate_kv_caches",
    "check_kv_caches",
    "gather_kv",
    "layer_name",
    "paged_attention",
    "prepare_step",
    "slot_mapping",
    "write_kv",
]


def layer_name(index: int) -> str:
    """vLLM's name for the attention layer ``index`` of a Llama model."""
    return f"model.layers.{index}.self_attn.attn"


@dataclass(frozen=True, slots=True)
class PagedCacheSpec:
    """The shape of a model's paged KV cache (dtype and device are chosen at allocation)."""

    num_layers: int
    num_blocks: int
    block_size: int  # tokens per block; a store page spans page_tokens / block_size blocks
    num_kv_heads: int
    head_size: int

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_size"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)}")

    @property
    def layer_shape(self) -> tuple[int, int, int, int, int]:
        return (2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_size)

    def layer_names(self) -> list[str]:
        return [layer_name(i) for i in range(self.num_layers)]


def allocate_kv_caches(
    spec: PagedCacheSpec, *, dtype: torch.dtype, device: torch.device | str
) -> dict[str, torch.Tensor]:
    """Zeroed per-layer KV tensors, in layer order (dicts keep insertion order)."""
    return {
        name: torch.zeros(spec.layer_shape, dtype=dtype, device=device)
        for name in spec.layer_names()
    }


def check_kv_caches(
    kv_caches: Mapping[str, torch.Tensor], num_layers: int, num_kv_heads: int, head_size: int
) -> tuple[int, int]:
    """Validate that ``kv_caches`` fits a model; return ``(num_blocks, block_size)``."""
    shape: tuple[int, ...] | None = None
    for i in range(num_layers):
        name = layer_name(i)
        if name not in kv_caches:
            raise ValueError(f"kv_caches has no tensor for layer {name!r}")
        t = kv_caches[name]
        if t.dim() != 5 or t.shape[0] != 2 or t.shape[3:] != (num_kv_heads, head_size):
            raise ValueError(
                f"{name}: expected [2, num_blocks, block_size, {num_kv_heads}, {head_size}], "
                f"got {list(t.shape)}"
            )
        if shape is not None and t.shape != shape:
            raise ValueError(f"{name}: shape {list(t.shape)} differs from layer 0's {list(shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name}: the KV tensor must be contiguous")
        shape = t.shape
    assert shape is not None  # num_layers > 0 by ModelConfig's validation
    return shape[1], shape[2]


def slot_mapping(
    block_table: torch.Tensor, req_index: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Slot of each token: ``block_table[req, pos // block_size] * block_size + pos % block_size``.

    ``block_table`` is ``[num_reqs, max_blocks]``; ``req_index`` and ``positions`` give, per
    token, its request's row and its position in that request's sequence.
    """
    block_ids = block_table[req_index, torch.div(positions, block_size, rounding_mode="floor")]
    return block_ids * block_size + positions.remainder(block_size)


def write_kv(
    kv_layer: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> None:
    """Store ``key``/``value`` (``[num_tokens, kv_heads, head_size]``) at ``slots``."""
    flat = kv_layer.view(2, -1, kv_layer.shape[3], kv_layer.shape[4])
    flat[0].index_copy_(0, slots, key)
    flat[1].index_copy_(0, slots, value)


def gather_kv(kv_layer: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first ``num_tokens`` tokens' K and V of each request in ``block_table``.

    ``block_table`` ``[num_reqs, max_blocks]`` gives ``[2, num_reqs, num_tokens, kv_heads,
    head_size]``; a 1-D table (one request) gives ``[2, num_tokens, kv_heads, head_size]``.
    Requests with a shorter context get whatever their padding blocks hold past their end:
    the caller masks those positions.
    """
    block_size = kv_layer.shape[2]
    needed = -(-num_tokens // block_size)
    if block_table.shape[-1] < needed:
        raise ValueError(
            f"a block table of {block_table.shape[-1]} blocks cannot hold {num_tokens} tokens"
        )
    table = block_table[..., :needed]
    blocks = kv_layer.index_select(1, table.reshape(-1))  # [2, reqs * needed, bs, h, d]
    out = blocks.view(2, *table.shape[:-1], needed * block_size, *kv_layer.shape[3:])
    return out[..., :num_tokens, :, :]


@dataclass(frozen=True, slots=True)
class SeqStep:
    """One request's share of a step."""

    token_ids: Sequence[int] | torch.Tensor  # the new tokens (>= 1), host-side
    num_computed_tokens: int  # leading tokens whose K/V is already in the cache
    block_ids: Sequence[int]  # block table; must cover num_computed_tokens + len(token_ids)


@dataclass(frozen=True, slots=True)
class _AttnGroup:
    """Requests that attend in one SDPA call: one prefill, or all of a step's decodes."""

    rows: slice | torch.Tensor  # the group's tokens among the step's: a range, or indices
    block_table: torch.Tensor  # [G, max_blocks], padded with block 0 (masked out)
    query_len: int  # new tokens per request: a prefill's length, or 1 for decodes
    context_len: int  # the longest context in the group
    attn_mask: torch.Tensor | CausalBias | None


@dataclass(frozen=True, slots=True)
class StepMetadata:
    """A step's index tensors and attention groups, built once and shared by all layers."""

    input_ids: torch.Tensor  # [T] new tokens of all requests, concatenated
    positions: torch.Tensor  # [T] each token's position in its sequence
    slots: torch.Tensor  # [T] where each token's K/V is written
    last_index: torch.Tensor  # [B] row of each request's last new token
    groups: list[_AttnGroup]  # for torch's attention ops (empty when `paged` is set)
    block_table: torch.Tensor | None = None  # [B, max_blocks], for the paged kernel
    paged: PagedPlan | None = None  # the step's tiles: attention by paged_attn's kernel


def prepare_step(seqs: Sequence[SeqStep], num_blocks: int, block_size: int,
                 device: torch.device, num_kv_heads: int | None = None) -> StepMetadata:
    """Validate a step and build its metadata: one small host-to-device copy per table.

    With num_kv_heads on a CUDA device, a step whose requests add at most
    paged_attn.MAX_QUERY tokens each attends through paged_attn's kernel."""
    if not seqs:
        raise ValueError("a step needs at least one request")
    q_lens = [len(s.token_ids) for s in seqs]
    ctx_lens = [s.num_computed_tokens + n for s, n in zip(seqs, q_lens, strict=True)]
    max_blocks = 1
    for i, (s, q, ctx) in enumerate(zip(seqs, q_lens, ctx_lens, strict=True)):
        if q < 1 or s.num_computed_tokens < 0:
            raise ValueError(f"request {i}: needs >= 1 new token and num_computed_tokens >= 0, "
                             f"got {q} and {s.num_computed_tokens}")
        if len(s.block_ids) * block_size < ctx:
            raise ValueError(f"request {i}: {len(s.block_ids)} blocks of {block_size} tokens "
                             f"cannot hold a context of {ctx} tokens")
        if min(s.block_ids) < 0 or max(s.block_ids) >= num_blocks:
            raise ValueError(f"request {i}: block ids must lie in [0, {num_blocks})")
        max_blocks = max(max_blocks, len(s.block_ids))
    table = [list(s.block_ids) + [0] * (max_blocks - len(s.block_ids)) for s in seqs]

    # Token ids are host-side (the sampler's output); one copy moves the whole batch.
    input_ids = torch.cat([torch.as_tensor(s.token_ids, dtype=torch.long).reshape(-1).cpu()
                           for s in seqs]).to(device, non_blocking=True)
    block_table = _long_tensor(table, device)
    q_lens_t, ctx_lens_t = _long_tensor(q_lens, device), _long_tensor(ctx_lens, device)
    num_tokens = input_ids.numel()
    starts = torch.cumsum(q_lens_t, 0) - q_lens_t
    req_index = torch.repeat_interleave(torch.arange(len(seqs), device=device), q_lens_t,
                                        output_size=num_tokens)
    # Token t of a request whose new tokens start at row `start` sits at position
    # (ctx - q) + (t - start): the per-request part is gathered, the rest is one arange.
    first_minus_start = ctx_lens_t - q_lens_t - starts
    positions = first_minus_start[req_index] + torch.arange(num_tokens, device=device)
    paged = None
    if num_kv_heads and paged_attn.available(device) and max(q_lens) <= paged_attn.MAX_QUERY:
        paged = paged_attn.plan(q_lens, ctx_lens, num_kv_heads, device)
    return StepMetadata(
        input_ids=input_ids,
        positions=positions,
        slots=slot_mapping(block_table, req_index, positions, block_size),
        last_index=starts + q_lens_t - 1,
        groups=[] if paged else _attention_groups(q_lens, ctx_lens, block_table),
        block_table=block_table,
        paged=paged,
    )


def _long_tensor(values: list[int] | list[list[int]], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def _attention_groups(q_lens: list[int], ctx_lens: list[int],
                      block_table: torch.Tensor) -> list[_AttnGroup]:
    """Split a step as vLLM's attention backends do: prefills apart, decodes together.

    Torch has no varlen attention, and padding a mixed batch to its longest query would build
    a [B, max_query, max_context] mask (2 GB for one 8k prefill beside 31 decodes). So each
    prefill attends alone with bottom-right causal masking (which SDPA's fused kernels take),
    and the decodes attend as one batch padded only along the context.
    """
    device = block_table.device
    groups, decodes, start = [], [], 0
    for i, (q, ctx) in enumerate(zip(q_lens, ctx_lens, strict=True)):
        if q == 1:
            decodes.append((i, start, ctx))
        else:
            groups.append(_AttnGroup(slice(start, start + q), block_table[i:i + 1], q, ctx,
                                     causal_lower_right(q, ctx)))
        start += q
    if decodes:
        reqs, rows, ctxs = (list(x) for x in zip(*decodes, strict=True))
        max_ctx = max(ctxs)
        mask = None  # all of one context length: the single query sees everything
        if min(ctxs) != max_ctx:
            kv_idx = torch.arange(max_ctx, device=device)
            mask = (kv_idx[None, :] < _long_tensor(ctxs, device)[:, None])[:, None, None, :]
        contiguous = reqs == list(range(reqs[0], reqs[0] + len(reqs)))
        groups.append(_AttnGroup(
            slice(rows[0], rows[0] + len(rows)) if contiguous else _long_tensor(rows, device),
            block_table[reqs[0]:reqs[0] + len(reqs)] if contiguous
            else block_table.index_select(0, _long_tensor(reqs, device)),
            1, max_ctx, mask))
    return groups


def paged_attention(q: torch.Tensor, kv_layer: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
    """Grouped-query attention of ``q`` ``[T, heads, head_size]`` over the cached context.

    The step's new K/V must already be written (``write_kv``): attention reads every key,
    old and new, from ``kv_layer``. Returns ``[T, heads * head_size]``.
    """
    if meta.paged is not None:
        return paged_attn.paged_attention_triton(q, kv_layer, meta.block_table, meta.paged)
    if len(meta.groups) == 1:
        return _attend_group(q, kv_layer, meta.groups[0])
    out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
    for group in meta.groups:
        if isinstance(group.rows, slice):
            out[group.rows] = _attend_group(q[group.rows], kv_layer, group)
        else:
            out.index_copy_(0, group.rows, _attend_group(q[group.rows], kv_layer, group))
    return out


def _flash_prefill(q: torch.Tensor, kv_layer: torch.Tensor, group: _AttnGroup) -> torch.Tensor:
    """One prefill through FlashAttention's own op, whose causal mask is bottom-right aligned.

    Through SDPA the same kernel needs a ``CausalBias`` (Python dispatch) and four transposes:
    on the H200 that cost more host time per layer than the kernel's device time at 16 new
    tokens. The op takes ``[batch, seq, heads, head]`` as the cache stores it, and grouped
    K/V heads as they are.
    """
    kv = gather_kv(kv_layer, group.block_table[0], group.context_len)  # [2, ctx, kv_heads, d]
    out = torch.ops.aten._flash_attention_forward(
        q.unsqueeze(0), kv[0].unsqueeze(0), kv[1].unsqueeze(0), None, None,
        group.query_len, group.context_len, 0.0, True, False)[0]
    return out.view(q.shape[0], q.shape[1] * q.shape[2])


def _attend_group(q: torch.Tensor, kv_layer: torch.Tensor, group: _AttnGroup) -> torch.Tensor:
    num_tokens, num_heads, head_size = q.shape
    num_seqs = group.block_table.shape[0]
    if (group.query_len > 1 and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and head_size % 8 == 0 and head_size <= 256):
        return _flash_prefill(q, kv_layer, group)
    q = q.view(num_seqs, group.query_len, num_heads, head_size).transpose(1, 2)
    kv = gather_kv(kv_layer, group.block_table, group.context_len)  # [2, G, ctx, kv_heads, d]
    k, v = kv[0].transpose(1, 2), kv[1].transpose(1, 2)
    with sdpa_kernel(_BACKENDS):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=group.attn_mask,
                                             enable_gqa=True)
    return out.transpose(1, 2).reshape(num_tokens, num_heads * head_size)
