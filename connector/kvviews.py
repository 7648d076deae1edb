"""One logical view of every engine's paged KV tensor: kv5 = [kv, blocks, tokens, heads, head].

Engines lay out a layer's paged KV in several ways. The transfer code
(connector.transfer) moves pages between the store's slab layout and *one* logical shape,

    kv5[kv, block, n, h, d]      kv in [0, kv_factor): 0 = K, 1 = V (MLA: 0 = the latent)
                                 block: the engine's block id, n: token in the block,
                                 h: KV head, d: element of the head

so each engine layout is only a strided *view* of its tensor, never a copy; writing
through kv5 writes the engine's tensor. A view is made from the tensor's own strides,
so padded blocks or several layers sharing one buffer (vLLM's create_kv_cache_views)
are handled. Only the head dimension must be contiguous (stride 1): the transfer
kernels move whole heads.

Layouts (``KVKind``), as the engine hands them over::

    FLASH_NHD    [2, blocks, block_size, heads, head]   vLLM FlashAttention before 0.33
                                                       (HND physical order shows as strides)
    FLASH_HND    [2, blocks, heads, block_size, head]   the same with heads before tokens
    VLLM_4D      [blocks, heads, block_size, 2*head]    vLLM 0.33: K and V concatenated
                                                       in the last dim; LBNHC or LBHNC
                                                       physical order, read from strides
    MLA_3D       [blocks, block_size, head]             MLA before vLLM 0.33 (kv_factor 1)
    MLA_VLLM_4D  [blocks, 1, block_size, head]          vLLM 0.33 MLA (kv_factor 1)
"""

from __future__ import annotations

import enum

import torch

__all__ = ["KVKind", "detect_kind", "kv5"]


class KVKind(enum.Enum):
    FLASH_NHD = "flash_nhd"
    FLASH_HND = "flash_hnd"
    VLLM_4D = "vllm_4d"
    MLA_3D = "mla_3d"
    MLA_VLLM_4D = "mla_vllm_4d"

    @property
    def kv_factor(self) -> int:
        return 1 if self in (KVKind.MLA_3D, KVKind.MLA_VLLM_4D) else 2


_NDIM = {KVKind.FLASH_NHD: 5, KVKind.FLASH_HND: 5, KVKind.VLLM_4D: 4,
         KVKind.MLA_3D: 3, KVKind.MLA_VLLM_4D: 4}


def kv5(tensor: torch.Tensor, kind: KVKind) -> torch.Tensor:
    """A view of `tensor` shaped [kv_factor, blocks, block_size, heads, head] (no copy).

    ValueError if the tensor's shape does not fit `kind`.
    """
    shape = tuple(tensor.shape)
    if tensor.dim() != _NDIM[kind]:
        raise ValueError(f"{kind.name} needs a {_NDIM[kind]}-d tensor, got shape {shape}")
    if kind is KVKind.FLASH_NHD:
        if shape[0] != 2:
            raise ValueError(f"FLASH_NHD needs [2, blocks, block_size, heads, head], got {shape}")
        return tensor
    if kind is KVKind.FLASH_HND:
        if shape[0] != 2:
            raise ValueError(f"FLASH_HND needs [2, blocks, heads, block_size, head], got {shape}")
        return tensor.permute(0, 1, 3, 2, 4)
    if kind is KVKind.VLLM_4D:
        # [B, H, N, C] with C = K ‖ V: split C into (2, D), then bring kv to the front.
        if shape[3] % 2:
            raise ValueError(f"VLLM_4D needs an even last dim (K and V concatenated), "
                             f"got {shape}")
        return tensor.unflatten(3, (2, shape[3] // 2)).permute(3, 0, 2, 1, 4)
    if kind is KVKind.MLA_3D:
        return tensor.unsqueeze(0).unsqueeze(3)            # [1, B, N, 1, D]
    if shape[1] != 1:                                      # MLA_VLLM_4D
        raise ValueError(f"MLA_VLLM_4D needs [blocks, 1, block_size, head], got {shape}")
    return tensor.permute(1, 0, 2, 3).unsqueeze(3)         # [1, B, N, 1, D]


def detect_kind(tensor: torch.Tensor, *, mla: bool = False, block_size: int | None = None,
                num_kv_heads: int | None = None) -> KVKind:
    """The KVKind of an engine's per-layer KV tensor, from its shape and role.

    mla: the model uses MLA (one latent per token, kv_factor 1). A 5-d tensor is read as
    FLASH_NHD, the shape vLLM exposes whatever the physical order (an HND cache shows
    up as strides, which kv5 follows), unless block_size/num_kv_heads say the middle
    dims are swapped. ValueError when the shape fits no kind or the hints contradict it.
    """
    shape = tuple(tensor.shape)
    if mla:
        if tensor.dim() == 3:
            return KVKind.MLA_3D
        if tensor.dim() == 4 and shape[1] == 1:
            return KVKind.MLA_VLLM_4D
        raise ValueError(f"an MLA cache is [blocks, block_size, head] or "
                         f"[blocks, 1, block_size, head], got {shape}")
    if tensor.dim() == 4:
        if shape[3] % 2:
            raise ValueError(f"a 4-d KV cache needs K and V concatenated in an even last "
                             f"dim, got {shape}")
        _check_hints(shape[2], shape[1], block_size, num_kv_heads, shape)
        return KVKind.VLLM_4D
    if tensor.dim() == 5 and shape[0] == 2:
        # NHD first: with no hints, or when block_size == num_kv_heads, the shape alone
        # cannot tell, and NHD is the order vLLM's FlashAttention backend exposes.
        if _fits(shape[2], shape[3], block_size, num_kv_heads):
            return KVKind.FLASH_NHD
        if _fits(shape[3], shape[2], block_size, num_kv_heads):
            return KVKind.FLASH_HND
        raise ValueError(f"shape {shape} fits neither block_size={block_size} nor "
                         f"num_kv_heads={num_kv_heads}")
    raise ValueError(f"unknown KV cache shape {shape} (mla={mla}); expected "
                     f"[2, blocks, block_size, heads, head] or [blocks, heads, block_size, 2*head]")


def _fits(tokens: int, heads: int, block_size: int | None, num_kv_heads: int | None) -> bool:
    return ((block_size is None or tokens == block_size)
            and (num_kv_heads is None or heads == num_kv_heads))


def _check_hints(tokens: int, heads: int, block_size: int | None, num_kv_heads: int | None,
                 shape: tuple) -> None:
    if not _fits(tokens, heads, block_size, num_kv_heads):
        raise ValueError(f"shape {shape} does not match block_size={block_size}, "
                         f"num_kv_heads={num_kv_heads}")
