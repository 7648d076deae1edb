"""Mamba / linear-attention state (vLLM's mamba_cache_mode "align") as store pages.

In align mode vLLM keeps a request's recurrent state in the Mamba group's block table by
position: block i holds the state after token (i+1)*block_size, where the engine wrote
one. It writes a state only at some boundaries: the end of each prefill chunk (align
mode cuts chunks at block boundaries), the prefill checkpoint (the last boundary before
the prompt's end, for a later request of the same prompt to resume at) and each boundary
a decode crosses; every other block of the table is the null block, and a state block is
freed two steps after the engine moved past it. So:

    a page        is one state block's bytes per layer, stored under the key of page
                  P-1 (the prefix up to the boundary P*page_tokens) in the group's own
                  layout: vLLM 0.33 hands each Mamba layer over as its blocks' bytes,
                  [blocks, 1, 1, content] (kv_cache_interface.create_kv_cache_views),
                  so a page is a one-"token" slab of `content` bytes (page_tokens 1)
    a save        of page p is made only in the step that wrote its state and only where
                  that state is the one at p's boundary (`saveable_rows`): the chunk's
                  end when it ends on the boundary (done == (p+1)*page_tokens, in block
                  p), or the prefill checkpoint, in block cdiv(done, block) - 2, when
                  vLLM's checkpoint position (`StateCheckpoints`) is that block's
                  boundary; with hits finer than a block (hash blocks smaller than the
                  block) the checkpoint may sit inside a block, and a partial hit's
                  copied state too, so neither is ever saved. The block is not freed
                  before the save's copy has run (the next step's compute waits for it)
    a hit         is only as long as the last boundary for which every group holds what
                  it needs: the full groups' leading pages (one Lookup, as ever) and the
                  state page at the hit's end. `StateLookups.longest` asks which state
                  pages exist below the full groups' count and leases the last one.
    a load        writes only the hit's last page, into the block vLLM allocated for the
                  hit state (block P-1); connector.groups.for_group drops the rest.

The state lookup costs the request's first ask two more round trips (Exists, and a lease
of the one page), made on the scheduler's loop: a hybrid model's lookups are not all
prefetched.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvstore_client import KVStoreClient, KVStoreError, LayoutHandle, PageLayout

from ..breaker import not_answering
from ..groups import NULL_BLOCK, UnsupportedCache
from .lookups import StoreLookups

__all__ = ["StateCheckpoints", "StateLookups", "mamba_view", "saveable_rows"]

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch


def mamba_view(tensor: torch.Tensor, state_bytes: int) -> torch.Tensor:
    """A Mamba layer's cache as a kv5 view [1, blocks, 1, 1, state_bytes] of its bytes
    (no copy); UnsupportedCache when it is not vLLM 0.33's [blocks, 1, 1, content]."""
    import torch  # here, not at the top: the scheduler half imports this module, torch-free
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4 \
            or tuple(tensor.shape[1:]) != (1, 1, state_bytes) or tensor.element_size() != 1 \
            or tensor.stride(3) != 1:
        shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor)
        raise UnsupportedCache(
            f"kvstore connector: a Mamba layer's cache is {shape}, not the byte view "
            f"[blocks, 1, 1, {state_bytes}] of vLLM 0.33")
    return tensor.view(torch.uint8).unsqueeze(0)


@dataclasses.dataclass(frozen=True, slots=True)
class StateCheckpoints:
    """Where vLLM 0.33 writes a prefill checkpoint state
    (kv_cache_interface.get_mamba_prefill_checkpoint_position, without EAGLE's block
    drop): `alignment` is the engine's hit granularity (cache_hit_alignment_tokens),
    `lookahead` its num_hash_lookahead_tokens."""

    alignment: int
    lookahead: int = 0

    def position(self, done: int) -> int:
        """The checkpoint of a step that ends at token `done`."""
        return max((done - max(1, self.lookahead)) // self.alignment * self.alignment, 0)


def saveable_rows(rows: np.ndarray, first_page: int, computed: int, done: int,
                  page_tokens: int, checkpoints: StateCheckpoints | None = None
                  ) -> np.ndarray:
    """A save's rows of a Mamba group (one block a page) with every page but those
    whose boundary state this step wrote set to the null block, which no worker copies:
    the page that ends at `done`, and the checkpoint's page where the checkpoint is its
    block's boundary and lies in this step."""
    keep = {done}
    if checkpoints is not None:
        mark = checkpoints.position(done)
        column = -(-done // page_tokens) - 2           # the block vLLM reserved for it
        if computed < mark < done and mark == (column + 1) * page_tokens:
            keep.add(mark)
    out = np.full_like(rows, NULL_BLOCK)
    ends = (np.arange(first_page, first_page + len(rows)) + 1) * page_tokens
    for i, end in enumerate(ends.tolist()):
        if end in keep:
            out[i] = rows[i]
    return out


class StateLookups:
    """Which state pages the store holds, for the scheduler half (its loop's thread)."""

    def __init__(self, lookups: StoreLookups, layouts: Sequence[PageLayout]) -> None:
        """lookups: the full groups' (its client and breaker are shared); layouts: every
        rank's layout of every Mamba group."""
        self.lookups = lookups
        self.layouts = list(layouts)
        self._handles: list[LayoutHandle] | None = None

    @property
    def client(self) -> KVStoreClient:
        return self.lookups.client

    def longest(self, keys: Sequence[bytes], first: int, end: int,
                lease_ms: int) -> tuple[int, int]:
        """The longest prefix of at most `end` pages (beyond `first`) whose last page's
        state every Mamba layout holds, and a lease on those pages (0: none). (first, 0)
        when there is none or the store does not answer."""
        if end <= first or not self.lookups.breaker.allow():
            return first, 0
        try:
            if self._handles is None:
                self._handles = [self.client.register_layout(lay) for lay in self.layouts]
            present = np.ones(end - first, dtype=bool)
            for handle in self._handles:
                present &= np.asarray(self.client.exists(handle, keys[first:end]), dtype=bool)
            # From the longest down: a page evicted between the Exists and the lease
            # leaves the next one down (a few tries, then no hit).
            for last in np.flatnonzero(present)[::-1][:3]:
                pages = first + int(last) + 1
                if not lease_ms:
                    return pages, 0
                lease = self.client.lookup_lease(self._handles, [keys[pages - 1]], lease_ms)
                if lease.count == 1:
                    return pages, lease.lease_id
                self.lookups.release([lease.lease_id] if lease.lease_id else [])
        except KVStoreError as exc:
            if not not_answering(exc):
                raise
            self.lookups.down(exc)
        return first, 0
