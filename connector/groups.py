"""KV-cache groups: which of an engine's hybrid caches the connector moves, and how.

A hybrid model (vLLM's hybrid KV cache manager, HMA) keeps one block table per group of
layers that share a cache spec: full attention, sliding-window attention, MLA, an
EAGLE/MTP drafter's layers. Each group's pages are a layout of their own (its layers, its
heads, its head size), scoped by the group so that two groups never meet in the store
even where their shapes agree; every group's pages are keyed by the same chained token
hashes, so one Lookup over all the groups' layouts answers how many leading pages every
group holds (the store answers the minimum).

What each kind needs for a hit that ends at page P (tokens [0, P*page_tokens)):

    FULL      every page before P
    SLIDING   only the pages the window at P reaches: the engine's next token reads the
              `reach` tokens before it (sliding_window - 1, plus the tokens vLLM retains
              for multi-token drafts); vLLM holds null blocks for the rest of the prefix,
              so those pages are neither loaded nor, where null, saved
    DRAFT     (EAGLE/MTP drafter layers) every page before P, but the drafter's last page
              is volatile: its KV at a position reads the token after it, so a page is
              stored only once the engine has computed past its end (never the trailing
              page of a prefill), and is never served as if it were stable
    MAMBA     (Mamba / linear-attention state, vLLM's mamba_cache_mode "align") only page
              P-1: the recurrent state at the boundary P*page_tokens, which vLLM keeps in
              the group's block P-1. Its page is that block's bytes, under the key of page
              P-1 in a layout of its own. The engine writes a state only at some
              boundaries (a chunk's end, the prefill checkpoint before the prompt's end;
              null blocks between), so these pages are sparse: connector.scheduler.mamba finds the
              longest hit whose boundary state is stored and saves a state only in the
              step that wrote it.

Alignment across groups: the hit is the leading count every group holds (the Lookup's
minimum), cut to `usable`; a sliding group needs only its window inside that, so it never
makes a hit shorter than the full groups' -- vLLM's own coordinator shortens hits for a
sliding group only when the window's blocks are missing, which with every page stored
cannot happen before the full groups' count. Saving every page of a sliding group (not
only the last window) is what lets any later prefix length hit.

Refused at start-up, with one line that says what and why (`UnsupportedCache`): Mamba and
linear-attention state in any cache mode but "align" (one running state per request, no
state at a boundary to store), with speculative blocks (vLLM relocates them in place),
or with pages of several engine blocks; cross-attention and encoder-only caches (not a
prefix of the prompt), chunked-local and sink attention, and any spec this module does not
know: never silently wrong.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from .meta import StepMeta

__all__ = ["NULL_BLOCK", "CacheGroup", "GroupKind", "UnsupportedCache", "cache_groups",
           "for_group"]

# vLLM's block pool hands out block 0 as its null block: the placeholder a sliding-window
# group holds for blocks outside the window (never read, never written).
NULL_BLOCK = 0


class UnsupportedCache(ValueError):
    """A KV-cache spec the connector cannot move correctly: refused at start-up."""


class GroupKind(enum.Enum):
    FULL = "full"
    SLIDING = "sliding"
    DRAFT = "draft"
    MAMBA = "mamba"


@dataclasses.dataclass(frozen=True, slots=True)
class CacheGroup:
    """One KV-cache group as the connector sees it."""

    index: int                       # the engine's group index (block_ids[index])
    kind: GroupKind
    layer_names: tuple[str, ...]
    num_kv_heads: int
    head_size: int
    dtype: str                       # torch's spelling, e.g. "bfloat16"
    mla: bool                        # one latent per token (kv_factor 1)
    reach: int = 0                   # SLIDING: tokens before a position it still reads
    scope: str = ""                  # folded into the layout's salt; "" = a lone group
    block_size: int = 0              # the group's engine block size in tokens
    state_bytes: int = 0             # MAMBA: a layer's bytes of one state block

    def first_page(self, end_page: int, page_tokens: int) -> int:
        """The first page this group needs for a prefix of `end_page` pages."""
        if self.kind is GroupKind.MAMBA:
            return max(0, end_page - 1)
        if self.kind is not GroupKind.SLIDING:
            return 0
        skipped = max(0, end_page * page_tokens - self.reach)
        return min(end_page, skipped // page_tokens)


def _dtype(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def cache_groups(kv_cache_config: Any) -> list[CacheGroup]:
    """The connector's view of a vLLM KVCacheConfig's groups; UnsupportedCache (one line:
    which group, which spec, why) for anything it cannot move correctly."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )
    if kv_cache_config is None:
        # No config handed over (an engine older than the three-argument constructor):
        # one group of every layer, whose layouts come from the model config.
        return [CacheGroup(0, GroupKind.FULL, (), 1, 1, "", False)]
    specs = list(kv_cache_config.kv_cache_groups)
    if not specs:
        raise UnsupportedCache("kvstore connector: the engine has no KV-cache groups")
    lone = len(specs) == 1
    groups = []
    for index, group in enumerate(specs):
        spec = group.kv_cache_spec
        name = type(spec).__name__
        where = f"kvstore connector: KV-cache group {index} ({name}, " \
                f"{len(group.layer_names)} layers)"
        if isinstance(spec, MambaSpec):
            groups.append(_mamba_group(index, spec, group.layer_names, where))
            continue
        draft = bool(getattr(group, "is_eagle_group", False))
        mla = isinstance(spec, (MLAAttentionSpec, SlidingWindowMLASpec))
        if type(spec) in (SlidingWindowSpec, SlidingWindowMLASpec):
            if not spec.prefix_cacheable:
                raise UnsupportedCache(f"{where}: a bounded-replay window is not a "
                                       f"cacheable prefix")
            kind = GroupKind.SLIDING
            reach = spec.sliding_window - 1 + spec.extra_retained_tokens
        elif type(spec) in (FullAttentionSpec, MLAAttentionSpec):
            # A FullAttentionSpec that records a sliding window is vLLM's own fallback
            # with HMA off: blocks for every token, so it is full attention to us.
            kind, reach = GroupKind.FULL, 0
        else:
            raise UnsupportedCache(
                f"{where}: the connector moves full-attention, MLA and sliding-window "
                f"pages only; this spec's blocks do not hold a prompt prefix it can store")
        if draft:
            if kind is GroupKind.SLIDING:
                raise UnsupportedCache(f"{where}: a sliding-window drafter is not supported")
            kind = GroupKind.DRAFT
        head_v = getattr(spec, "head_size_v", spec.head_size)
        if not mla and head_v != spec.head_size:
            raise UnsupportedCache(f"{where}: K and V head sizes differ "
                                   f"({spec.head_size} and {head_v})")
        if getattr(spec, "page_size_padded", None) or getattr(spec, "tokens_per_state", 1) != 1:
            raise UnsupportedCache(f"{where}: padded or compressed pages are not supported")
        groups.append(CacheGroup(
            index, kind, tuple(group.layer_names), 1 if mla else spec.num_kv_heads,
            spec.head_size, _dtype(spec.dtype), mla, reach,
            "" if lone else _scope(index, kind, spec, group.layer_names),
            block_size=spec.block_size))
    if not any(g.kind in (GroupKind.FULL, GroupKind.DRAFT) for g in groups) \
            and (not lone or groups[0].kind is GroupKind.MAMBA):
        # Every hit is bounded by full attention's count; with none, nothing aligns it.
        raise UnsupportedCache("kvstore connector: a model without a full-attention "
                               "group (sliding-window or Mamba layers alone) is not "
                               "supported")
    mamba = any(g.kind is GroupKind.MAMBA for g in groups)
    if len({g.mla for g in groups if g.kind is not GroupKind.MAMBA}) > 1 \
            or (mamba and any(g.mla for g in groups)):
        raise UnsupportedCache("kvstore connector: MLA and non-MLA groups (or MLA and "
                               "Mamba) in one model are not supported")
    if mamba and len({g.block_size for g in groups}) > 1:
        raise UnsupportedCache(
            "kvstore connector: Mamba state needs every KV-cache group on one block size "
            f"(got {sorted({g.block_size for g in groups})}): a state page is one block")
    return groups


def _mamba_group(index: int, spec: Any, layer_names: Sequence[str], where: str) -> CacheGroup:
    """A Mamba / linear-attention group in align mode; UnsupportedCache for the rest."""
    if spec.mamba_cache_mode != "align":
        raise UnsupportedCache(
            f"{where} is Mamba/linear-attention state in mamba_cache_mode="
            f"{spec.mamba_cache_mode!r}: only 'align' keeps a state at each block "
            f"boundary that can be stored; start vLLM with --mamba-cache-mode align")
    if spec.num_speculative_blocks:
        raise UnsupportedCache(
            f"{where}: Mamba state with speculative blocks ({spec.num_speculative_blocks}) "
            f"is not supported (vLLM relocates those blocks in place)")
    # vLLM 0.33 hands a Mamba layer over as its blocks' bytes, [blocks, 1, 1, content]
    # (kv_cache_interface.create_kv_cache_views); a page is the content of one block.
    return CacheGroup(index, GroupKind.MAMBA, tuple(layer_names), 1, 1, "uint8", False,
                      scope=_scope(index, GroupKind.MAMBA, spec, layer_names),
                      block_size=spec.block_size,
                      state_bytes=spec.state_content_size_bytes)


def _scope(index: int, kind: GroupKind, spec: Any, layer_names: Sequence[str]) -> str:
    """What sets a group's pages apart: its place, kind, window and exact layer set (a
    digest, so the salt stays short whatever the model's layer names)."""
    layers = xxhash.xxh3_64_hexdigest("\n".join(layer_names).encode())
    if kind is GroupKind.MAMBA:
        # The state's tensors, their dtypes and its kernel: what the bytes of a block mean.
        state = xxhash.xxh3_64_hexdigest(repr((spec.shapes, spec.dtypes,
                                                str(spec.mamba_type))).encode())
        return f"hma:g{index}:{kind.value}:{state}:{layers}"
    window = getattr(spec, "sliding_window", None) or 0
    return f"hma:g{index}:{kind.value}:w{window}:{layers}"


def for_group(step: StepMeta, group: CacheGroup, page_tokens: int) -> StepMeta:
    """The part of a step's plan one group's worker carries out: its own block rows;
    for a sliding group only the pages its window reaches at the load's end; never a
    page whose block is the engine's null block (one the group does not hold)."""
    loads = []
    for load in step.loads:
        rows = load.group_blocks[group.index] if load.group_blocks else load.block_ids
        end = load.first_page + len(load.keys)
        skip = max(0, group.first_page(end, page_tokens) - load.first_page)
        keep = np.arange(len(load.keys)) >= skip
        keep &= ~(rows == NULL_BLOCK).any(axis=1)
        if not keep.any():
            continue
        pins = load.pins
        if pins is not None:
            pins = dataclasses.replace(pins, offsets={lid: offs[keep] for lid, offs
                                                      in pins.offsets.items()})
        loads.append(dataclasses.replace(
            load, keys=_take(load.keys, keep), block_ids=rows[keep],
            first_page=load.first_page + skip, pins=pins, group_blocks=()))
    saves = []
    for save in step.saves:
        rows = save.group_blocks[group.index] if save.group_blocks else save.block_ids
        keep = ~(rows == NULL_BLOCK).any(axis=1)
        if keep.any():
            saves.append(dataclasses.replace(save, keys=_take(save.keys, keep),
                                             block_ids=rows[keep], group_blocks=()))
    return dataclasses.replace(step, loads=tuple(loads), saves=tuple(saves))


def _take(keys: tuple[bytes, ...], keep: np.ndarray) -> tuple[bytes, ...]:
    return tuple(key for key, kept in zip(keys, keep.tolist(), strict=True) if kept)
