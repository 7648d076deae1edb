"""What the scheduler half keeps of one request: its tokens, page keys, blocks and hit."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from kvstore_client.results import Pins

from ..groups import NULL_BLOCK
from .hashing import page_keys

__all__ = ["RequestState", "new_keys"]


def new_keys(tokens: np.ndarray, keys: Sequence[bytes], pages: int, page_tokens: int,
             seed: bytes) -> list[bytes]:
    """The keys of pages len(keys)..pages-1, chained on from the last key in `keys`:
    a request's pages are hashed once each, as it grows."""
    have = len(keys)
    if pages <= have:
        return []
    return page_keys(tokens[have * page_tokens:pages * page_tokens], page_tokens, seed,
                     parent=keys[-1] if keys else None)


@dataclasses.dataclass(slots=True)
class RequestState:
    tokens: np.ndarray                     # int32 token ids known so far
    prompt_len: int
    keys: list[bytes] = dataclasses.field(default_factory=list)  # keys of full pages
    packed: bytes = b""                    # the same keys back to back, for lookups
    # The engine's blocks, one list per KV-cache group (connector.groups), in page order.
    block_ids: list[list[int]] = dataclasses.field(default_factory=lambda: [[]])
    local_tokens: int = 0                  # the engine's own prefix-cache hit
    lease_id: int = 0                      # pins the counted pages until allocated
    state_lease: int = 0                   # pins the hit's Mamba state page (mamba.py)
    pins: Pins | None = None               # where they lie, while the lease is held
    pins_use_by: float = 0.0
    saved_pages: int = 0                   # leading pages known stored (hit or saved)
    load_failed: bool = False              # its own load failed: recompute, no new hit
    tainted: bool = False                  # read blocks of another's failed load
    asked_again: int = 0                   # "ask again" answers given so far

    def all_blocks(self, upto: int | None = None) -> list[int]:
        """Every group's block ids (the first `upto` of each), the null block left out."""
        return [b for blocks in self.block_ids for b in blocks[:upto] if b != NULL_BLOCK]

    def keys_upto(self, pages: int, page_tokens: int, seed: bytes) -> list[bytes]:
        """Keys of the first `pages` pages, hashing only pages not hashed before."""
        new = new_keys(self.tokens, self.keys, pages, page_tokens, seed)
        if new:
            self.keys += new
            self.packed += b"".join(new)
        return self.keys[:pages]

    def take_hashing(self, tokens: np.ndarray, keys: tuple[bytes, ...], packed: bytes) -> None:
        """Keep conversion and hashing done elsewhere (the lookup worker) where it
        reaches further than the request's own."""
        if len(tokens) > len(self.tokens):
            self.tokens = tokens
        if len(keys) > len(self.keys):
            self.keys = list(keys)
            self.packed = packed
