"""Per-step plans the scheduler half hands the worker half: which pages to load or save.

These are the only things that cross from the scheduler process to the workers, so they
are small, immutable and picklable (vLLM sends them to worker processes every step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

__all__ = ["LoadSpec", "PagePins", "SaveSpec", "StepMeta"]


@dataclasses.dataclass(frozen=True, slots=True)
class PagePins:
    """Where a layer-wise load's pages lie in the store's shared pool, as the scheduler's
    lookup answered (kvstore_client.Pins). The lookup's lease pins them until the load's
    outcome is known (connector.scheduler.unconfirmed), so a worker that maps this very pool copies
    from these offsets without an Acquire of its own: one round trip less on the hit's
    critical path. A worker that maps another pool (a restart, another host), or finds
    `use_by` passed, acquires as before."""

    region_id: int                        # the pool's public name (kvstore_client.shm)
    # time.time() after which the lease may run out before the copies end: half the
    # lease's ttl after the lookup was sent. A wall clock, not a monotonic one: the
    # scheduler may run on another host than the worker.
    use_by: float
    offsets: Mapping[bytes, np.ndarray]   # layout id -> offset of each page of the load


@dataclasses.dataclass(frozen=True, slots=True)
class LoadSpec:
    """Load pages keys[i] into the engine blocks block_ids[i] (k blocks per page)."""

    req_id: str
    keys: tuple[bytes, ...]
    block_ids: np.ndarray          # (pages, blocks_per_page) int64
    is_async: bool                 # True: report in finished_recving when done
    load_id: int = 0               # unique per scheduler: what a SaveSpec's `after` names
    pins: PagePins | None = None   # layer-wise loads: where the lookup found the pages
    first_page: int = 0            # the prefix page keys[0] is (a window counts from it)
    # A hybrid engine's blocks, one (pages, blocks_per_page) array per KV-cache group
    # (connector.groups; block_ids is group 0's); empty for one group. The adapter hands
    # each group's worker its own rows (connector.groups.for_group).
    group_blocks: tuple[np.ndarray, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class SaveSpec:
    """Store the pages held in block_ids[i] under keys[i] (skipped if already stored)."""

    req_id: str
    keys: tuple[bytes, ...]
    block_ids: np.ndarray          # (pages, blocks_per_page) int64
    # Loads not yet known to have succeeded whose blocks the request's prefix reads: if
    # one of them failed (this step, or a step the worker saw earlier), these pages were
    # computed over KV that never arrived and must not be stored.
    after: tuple[int, ...] = ()
    group_blocks: tuple[np.ndarray, ...] = ()    # as LoadSpec's


@dataclasses.dataclass(frozen=True, slots=True)
class StepMeta:
    loads: tuple[LoadSpec, ...] = ()
    saves: tuple[SaveSpec, ...] = ()
    # The scheduler half found the store not answering (its breaker is open): the
    # workers skip this step's saves and loads instead of each waiting out a timeout.
    store_down: bool = False
    # Outcomes the scheduler half has learnt since the last plan, of loads that saves
    # may name in `after`: a worker holds such a save's commit until every load it names
    # is known good, and drops it if one failed -- on any rank, which is why the word
    # comes from the scheduler (it hears every rank's failures) and not from the worker.
    loads_ok: tuple[int, ...] = ()
    loads_failed: tuple[int, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.loads and not self.saves
