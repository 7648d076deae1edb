"""Torch copies of one layer: the path on CPU tensors (CI) and the CUDA fallback
(CopyMethod.COPIES): per slab `copy_` into a staging tensor and one indexed write per
layer, and the reverse for saves."""

from __future__ import annotations

import torch

from .plan import Geometry, Plan

__all__ = ["copy_layer"]


def copy_layer(geo: Geometry, view: torch.Tensor, layer: int, plan: Plan, *,
               to_cache: bool, device: torch.device) -> None:
    host_t = plan.host_t
    lb = geo.layer_bytes
    start = layer * lb
    pages = len(plan.offsets)
    index = torch.from_numpy(plan.block_ids.reshape(-1)).to(device, non_blocking=True)
    # [P, kv, k, N, H, D] slabs  <->  view[:, blocks]: [kv, P*k, N, H, D]
    if to_cache:
        staging = torch.empty((pages, lb), dtype=torch.uint8, device=device)
        for row, off in zip(staging, plan.offsets.tolist(), strict=True):
            row.copy_(host_t[off + start:off + start + lb], non_blocking=True)
        slabs = staging.view(geo.dtype).view(pages, geo.kv, geo.page_tokens, geo.heads,
                                             geo.head)
        view[:, index] = slabs.transpose(0, 1).reshape(geo.kv, pages * geo.k, geo.block_size,
                                                       geo.heads, geo.head)
    else:
        gathered = view[:, index].reshape(geo.kv, pages, geo.page_tokens, geo.heads, geo.head)
        slabs = gathered.transpose(0, 1).contiguous().view(torch.uint8).view(pages, lb)
        for row, off in zip(slabs, plan.offsets.tolist(), strict=True):
            host_t[off + start:off + start + lb].copy_(row, non_blocking=True)
