"""SGLang's host pages in the store's page order, and the PageLayout of an SGLang host pool.

Pages live in the namespace of a PageLayout built from the storage config and the host
pool (model, KV dtype, layers, page size, heads, TP rank and size, PP rank, MLA), so
pages of two ranks, dtypes or models never mix (SGLang #33268 lost the dtype from its keys). An MLA
latent is the same on every TP rank: its layout leaves TP out (rank 0 of 1), so every
rank reads what SGLang's one writer rank stored. Decode context parallelism is refused.

Bytes. A stored page is the store's layer-major page (kvstore_protocol.layout): per layer
a [kv_factor, page_tokens, heads * head_dim] slab, the same bytes vLLM's connector
stores. Each host layout (layer_first, page_first, page_first_direct) is viewed in that
order without a copy, so moving a page is one strided copy between the store's mapped
pool and the host pool; the flat pages of the generic get/set are converted the same way,
so both paths share pages.
"""

from __future__ import annotations

import dataclasses

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

from kvstore_client import PageLayout

from .config import ConnectorConfig

__all__ = ["LAYOUTS", "PageCodec", "layout_of"]

LAYOUTS = ("layer_first", "page_first", "page_first_direct")   # host layouts supported


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class PageCodec:
    """Views of one host pool's pages in the store's page order, without copies.

    Every view is uint8 and shaped (layers, kv_factor, page_tokens, row_bytes), where a
    row is one token's heads * head_dim elements of one layer.
    """

    layout: str         # the host pool's layout, one of LAYOUTS
    mla: bool           # host buffer has no K/V axis (kv_factor 1)
    page_tokens: int
    page_shape: tuple   # uint8 shape of one host page, rows merged (host_page's result)
    host: torch.Tensor  # the whole host buffer as uint8, rows merged

    @classmethod
    def of(cls, pool) -> PageCodec:
        if pool.layout not in LAYOUTS:
            raise ValueError(f"kvstore: host layout {pool.layout!r} is not supported "
                             f"(supported: {', '.join(LAYOUTS)})")
        host = pool.kv_buffer.view(torch.uint8).flatten(-2)
        codec = cls(pool.layout, isinstance(pool, MLATokenToKVPoolHost), pool.page_size, (), host)
        shape = tuple(codec.host_page(0).shape)
        return dataclasses.replace(codec, page_shape=shape)

    def host_page(self, index: int) -> torch.Tensor:
        """The host page starting at token index, in the host's own axis order."""
        t, h = self.page_tokens, self.host
        if self.layout == "page_first_direct":
            p = index // t
            return h[:, p:p + 1] if not self.mla else h[p:p + 1]
        if self.layout == "page_first":
            return h[:, index:index + t] if not self.mla else h[index:index + t]
        return h[:, :, index:index + t] if not self.mla else h[:, index:index + t]

    def store_order(self, page: torch.Tensor) -> torch.Tensor:
        """A host-ordered page (host_page's shape) permuted to (L, kv, T, row)."""
        if self.mla:
            if self.layout == "page_first_direct":
                page = page[0]                   # (L, T, row)
            elif self.layout == "page_first":
                page = page.permute(1, 0, 2)     # (T, L, row) -> (L, T, row)
            return page.unsqueeze(1)
        if self.layout == "page_first_direct":
            return page[:, 0].permute(1, 0, 2, 3)   # (2, 1, L, T, row)
        if self.layout == "page_first":
            return page.permute(2, 0, 1, 3)         # (2, T, L, row)
        return page.permute(1, 0, 2, 3)             # (2, L, T, row)

    def flat(self, value: torch.Tensor) -> torch.Tensor:
        """A flat data page (SGLang's get_data_page(flat=True)) in store order."""
        return self.store_order(value.view(torch.uint8).reshape(self.page_shape))


def layout_of(config: HiCacheStorageConfig, pool, settings: ConnectorConfig,
              revision: str = "") -> PageLayout:
    if not isinstance(pool, (MHATokenToKVPoolHost, MLATokenToKVPoolHost)):
        # A hybrid model's host pools (sliding-window, Mamba/linear-attention state)
        # are not pages of one token-major KV layout: refused, never stored wrongly.
        raise ValueError(f"kvstore: SGLang host pool {type(pool).__name__} is not "
                         f"supported: only full-attention (MHA) and MLA host pools are")
    if getattr(pool, "dcp_size", 1) != 1:
        raise ValueError("kvstore: decode context parallelism (dcp_size > 1) is not supported")
    mla = isinstance(pool, MLATokenToKVPoolHost)
    if mla:
        heads, head_dim = 1, pool.kv_cache_dim
        # One latent for all TP ranks (rank 0 writes, every rank reads): not TP-scoped.
        tp_rank, tp_size = 0, 1
    else:
        if pool.head_dim != pool.v_head_dim:
            raise ValueError(f"kvstore: K and V widths differ ({pool.head_dim} != "
                             f"{pool.v_head_dim}); the store's pages need equal widths")
        heads, head_dim = pool.head_num, pool.head_dim
        tp_rank, tp_size = config.tp_rank, config.tp_size
    salt = settings.salt
    if getattr(pool, "storage_format_tag", None):
        salt = f"{salt}/{pool.storage_format_tag}"
    return PageLayout(
        model=settings.model or config.model_name or "sglang",
        num_layers=pool.layer_num, page_tokens=pool.page_size, num_kv_heads=heads,
        head_size=head_dim, dtype=str(pool.dtype).removeprefix("torch."),
        kv_factor=1 if mla else 2, tp_rank=tp_rank, tp_size=tp_size,
        pp_rank=config.pp_rank, salt=salt, revision=revision)
