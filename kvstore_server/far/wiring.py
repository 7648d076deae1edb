"""The far tier as the server builds it: settings -> FarClient -> FarTier, glide's own
logging silenced (the tier registers its metrics itself: FarTier.register_metrics).

valkey-glide's Rust core logs to stdout on its own (a WARN line per failed reconnect,
many a second while a node is down). The far tier says what matters itself, once per
state change (breaker.py), so glide's logger is turned off rather than left to flood the
server's output. Nothing connects here: the client connects on its first call, so a
server starts (and serves from DRAM and disk) while the cluster is still down.

The client library is imported only when --far is set: a server without a far tier
starts where valkey-glide is not installed (its Rust core ships only for some platforms).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .settings import WritePolicy, from_config

if TYPE_CHECKING:
    from .tier import FarTier

__all__ = ["ThroughView", "know_layouts", "open_far", "through", "watch"]

log = logging.getLogger("kvstore.far")


def open_far(config) -> FarTier | None:
    """The far tier of a ServerConfig; None without --far. ValueError says what is wrong
    with the settings."""
    settings = from_config(config)
    if settings is None:
        return None
    import glide_sync as glide

    from .client import FarClient
    from .tier import FarTier

    glide.Logger.set_logger_config(glide.LogLevel.OFF)
    tier = FarTier(FarClient(settings))
    if settings.signed:
        log.info("far tier: values signed with key id %s (%s)",
                 settings.keys.keyring().writing.key_id.hex(), config.far_secret_file)
    else:
        log.warning("far tier WITHOUT a secret (--far-insecure): anyone who can write the "
                    "cluster can make this server serve pages of their choosing")
    log.info("far tier: %s at %s, namespace %s, write %s, timeout %.0fms",
             f"cluster={settings.cluster.value}",
             ",".join(f"{h}:{p}" for h, p in settings.nodes), settings.namespace,
             settings.write.value, settings.timeout * 1000)
    return tier


class ThroughView:
    """The far tier as a commit's write-through sees it: offer() is through_offer, as the
    page stays in DRAM (not watched: watch.py)."""

    __slots__ = ("offer",)

    def __init__(self, tier: FarTier) -> None:
        self.offer = tier.through_offer


def through(tier: FarTier | None) -> ThroughView | None:
    """What every commit is offered to: the far tier under --far-write through."""
    if tier is not None and tier.client.settings.write is WritePolicy.THROUGH:
        return ThroughView(tier)
    return None


def watch(tier: FarTier | None, removals, in_dram, disk) -> None:
    """Start the far tier's watch of far-only pages (watch.py): what the cluster removes
    by itself is recorded in `removals` (the store's ring) unless in_dram(layout, keys)
    or the disk tier (or None) holds the page."""
    if tier is None:
        return
    import numpy as np

    def held_above(layout_id: bytes, keys) -> np.ndarray:
        held = np.asarray(in_dram(layout_id, keys), dtype=bool)
        rest = np.flatnonzero(~held)
        if disk is not None and rest.size:
            held[rest] = disk.contains(layout_id, [keys[i] for i in rest.tolist()])
        return held

    tier.watch.removals = removals
    tier.watch.held_above = held_above
    tier.watch.start()


def know_layouts(tier: FarTier | None, info) -> None:
    """Let the far tier write each layout's record (records.py): info(layout_id) is the
    store's registered LayoutInfo, or raises (an id no longer or never registered)."""
    if tier is None:
        return
    from ..errors import StoreError
    from .records import LayoutRecord

    def record_of(layout_id: bytes) -> LayoutRecord | None:
        try:
            found = info(layout_id)
        except StoreError:
            return None
        return LayoutRecord.of(layout_id, found.tenant, found.layout)

    tier.record_of = record_of
