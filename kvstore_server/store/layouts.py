"""The layout registry: each tenant's registered page layouts and their key indexes.

Not thread-safe: the store calls it under its lock. Registering is idempotent, and a
layout is never unregistered, so a LayoutInfo's idx names it for the store's life.
So their number is capped (max_layouts): any client makes a new layout by changing its
salt, and tens of thousands of them took tens of MiB and made every Stats call slow.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import numpy as np

from kvstore_protocol.layout import PageLayout

from ..errors import Outcome, Reason, StoreError
from ..tenants import DEFAULT_TENANT, scoped_layout_id
from .index import KeyIndex
from .presence import Presence

__all__ = ["DEFAULT_MAX_LAYOUTS", "LAYOUT_ID_BYTES", "LayoutInfo", "LayoutRegistry",
           "unknown_layout"]

log = logging.getLogger(__name__)

LAYOUT_ID_BYTES = 16        # PageLayout.layout_id: xxh3-128 of the canonical encoding
# Layouts a server keeps: one per model, dtype, page size, rank and salt in use, so a
# fleet's few dozen fit many times over.
DEFAULT_MAX_LAYOUTS = 4096


def unknown_layout(layout_id: bytes) -> StoreError:
    """INVALID with reason LAYOUT_UNKNOWN (a client that sees it after a restart registers
    again). The id is echoed only as long as an id is: one of 8,000 bytes echoed whole
    made a status message past gRPC's 16 KiB metadata limit, and the client got a
    transport error (RESOURCE_EXHAUSTED) in place of this one."""
    if len(layout_id) != LAYOUT_ID_BYTES:
        what = f"{len(layout_id)} bytes, not a layout id (those are {LAYOUT_ID_BYTES})"
    else:
        what = layout_id.hex()
    return StoreError(Outcome.INVALID, f"unknown layout {what}: call RegisterLayout first",
                      reason=Reason.LAYOUT_UNKNOWN)


@dataclasses.dataclass(slots=True)
class LayoutInfo:
    """A registered layout, its index of keys, and its counters."""

    idx: int
    layout: PageLayout
    layout_id: bytes                # the store's id: scoped to the tenant (tenants.py)
    cls: int                        # pool size class of its pages
    tenant: str = DEFAULT_TENANT    # whose pages these are: quota and lease ownership
    # READY pages only, one vectorised hash table per key size (a request's keys all
    # have one size), so a lookup is a few numpy calls and no per-key state check
    ready: dict[int, KeyIndex] = dataclasses.field(default_factory=dict)
    # key -> slot id of pages being written (reserved, not yet committed); small and
    # short-lived, so a dict
    writing: dict[bytes, int] = dataclasses.field(default_factory=dict)
    # Told of every key that enters or leaves `ready` (KeyIndex.watch): the presence map's
    # (kvstore_server.store.presence), or None
    watch: Callable[[np.ndarray | list[list[int]], int], None] | None = None
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    served: int = 0                 # pages handed out by Acquire (StoreStats.served)
    # The layout's, computed once: each was three property calls, on every request.
    page_bytes: int = dataclasses.field(init=False)
    layer_bytes: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.page_bytes = self.layout.page_bytes
        self.layer_bytes = self.layout.layer_bytes

    def index_for(self, key_size: int) -> KeyIndex:
        """The READY index of keys of this size, made on first use."""
        index = self.ready.get(key_size)
        if index is None:
            index = self.ready[key_size] = KeyIndex(key_size)
            index.watch = self.watch
        return index


class LayoutRegistry:
    """Layouts by store layout id and by idx."""

    def __init__(self, max_layouts: int = DEFAULT_MAX_LAYOUTS) -> None:
        self.max_layouts = max_layouts          # past it a new layout is refused
        self._refused_at = float("-inf")        # time.monotonic() of the last warning
        self._by_id: dict[bytes, LayoutInfo] = {}
        self.by_idx: list[LayoutInfo] = []      # idx -> info; only appended to
        # The presence map new layouts report their keys to (the store sets it), or None
        self.presence: Presence | None = None

    def __len__(self) -> int:
        return len(self.by_idx)

    def register(self, layout: PageLayout, tenant: str, cls: int) -> LayoutInfo:
        """The tenant's LayoutInfo for layout, made if new; cls: its pool size class."""
        layout_id = scoped_layout_id(tenant, layout.layout_id)
        info = self._by_id.get(layout_id)
        if info is not None:
            return info
        if len(self.by_idx) >= self.max_layouts:
            why = (f"the server holds {len(self.by_idx)} layouts, the most it keeps "
                   "(--max-layouts); layouts are kept until the server restarts")
            now = time.monotonic()
            if now - self._refused_at > 60:         # once a minute: a flood is one line
                self._refused_at = now
                log.warning("RegisterLayout of %s (tenant %r) refused: %s", layout.model,
                            tenant, why)
            raise StoreError(Outcome.EXHAUSTED, why)
        info = LayoutInfo(len(self.by_idx), layout, layout_id, cls, tenant,
                          watch=None if self.presence is None
                          else self.presence.watch(layout.layout_id))
        self._by_id[layout_id] = info
        self.by_idx.append(info)
        log.info("registered layout %s: %s, %d layers, %d tokens/page, %d bytes/page",
                 layout_id.hex(), layout.model, layout.num_layers, layout.page_tokens,
                 layout.page_bytes)
        return info

    def get(self, layout_id: bytes) -> LayoutInfo | None:
        return self._by_id.get(layout_id)

    def info(self, layout_id: bytes) -> LayoutInfo:
        """The registered layout; INVALID with reason LAYOUT_UNKNOWN if there is none (a
        client that sees it after a restart registers again)."""
        info = self._by_id.get(layout_id)
        if info is None:
            raise unknown_layout(layout_id)
        return info

    def of_tenant(self, tenant: str, cls: int | None = None) -> list[int]:
        """The idx of each layout of the tenant (of one size class if given)."""
        return [i.idx for i in self.by_idx
                if i.tenant == tenant and (cls is None or i.cls == cls)]
