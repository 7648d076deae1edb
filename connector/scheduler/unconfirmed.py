"""Loads handed to the workers whose outcome the scheduler half does not know yet.

Why a load stays "unconfirmed" for a while, and what that guards. A layer-wise load
planned in one build runs in that step's forward; under vLLM's AsyncScheduler the next
step is planned (and, in the same process, sent to the workers) before that forward has
even started, so the scheduler learns whether the load succeeded only `lag` builds later
(vLLM's max_concurrent_batches: 1 for Scheduler, 2 for AsyncScheduler). Until then:
  - the lookup lease stays held, so the pages cannot be evicted before the worker has
    pinned them itself (Acquire);
  - every page saved by a request whose prefix reads the load's blocks (the request
    itself, or another one that shares them through the engine's prefix cache) names the
    load in SaveSpec.after; the workers commit it only once a later plan reports the
    load good (StepMeta.loads_ok) and drop it if the load failed on any rank
    (StepMeta.loads_failed).

One load's life here:

    add(...)            -> load id; layer-wise: confirmed at build number now + 1 + lag,
                           async: when the workers report it done (async_done)
    step()              -> a build: layer-wise loads due by now are confirmed good
    async_done(req)     -> the request's async loads are good
    fail(blocks)        -> loads that read these blocks failed; returned to the caller
    request_finished(req) -> its async load is confirmed like a layer-wise one, once
                           the steps in flight have come back
Each settled load hands its lease to `take_leases()` and its id to `take_outcomes()`; a
good one whose pages the workers read under the lease's pins (no Acquire, which the store
counts as served itself) names those pages in `take_reads()`, said at the release.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

__all__ = ["Load", "UnconfirmedLoads"]


@dataclasses.dataclass(slots=True)
class Load:
    """A load handed to the workers whose outcome is not known yet."""

    req_id: str
    first_page: int                        # the request's page the load starts at
    blocks: frozenset[int]
    lease_id: int                          # the lookup lease, held until confirmed
    confirm_at: int | None                 # build number that confirms it; None: async
    extra_leases: tuple[int, ...] = ()     # more lookup leases (a hit's Mamba state page)
    read: int = 0                          # pages read under the lease's pins


class UnconfirmedLoads:
    """The loads not yet confirmed, and the outcomes and leases settled since last taken.

    Not thread-safe: only the scheduler's loop calls it."""

    def __init__(self, lag: int) -> None:
        """lag: how many builds later a step's outcome is known (the engine's number of
        batches in flight: vLLM's max_concurrent_batches)."""
        self.lag = max(1, lag)
        self._builds = 0              # builds so far: the clock of Load.confirm_at
        self._next_id = 1
        self._loads: dict[int, Load] = {}    # load id -> load not yet confirmed
        self._ok: list[int] = []          # loads settled since taken: good,
        self._failed: list[int] = []      # ... and failed (StepMeta.loads_ok/_failed)
        self._leases: list[int] = []      # leases of settled loads, to release
        self._reads: dict[int, int] = {}  # ... and pages read under their pins

    def __len__(self) -> int:
        return len(self._loads)

    def add(self, req_id: str, first_page: int, blocks: Iterable[int], lease_id: int,
            is_async: bool, read: int = 0, extra_leases: tuple[int, ...] = ()) -> int:
        """A load planned for the next build; the leases move to it (read: its pages, when
        the workers read them under the lease's pins). Returns its id."""
        load_id, self._next_id = self._next_id, self._next_id + 1
        self._loads[load_id] = Load(req_id, first_page, frozenset(blocks), lease_id,
                                    None if is_async else self._builds + 1 + self.lag,
                                    extra_leases, read)
        return load_id

    def reads(self, prefix_blocks: Iterable[int]) -> tuple[int, ...]:
        """The unconfirmed loads whose blocks lie in a request's prefix."""
        if not self._loads:
            return ()
        prefix = set(prefix_blocks)
        return tuple(load_id for load_id, load in self._loads.items()
                     if not load.blocks.isdisjoint(prefix))

    def step(self) -> None:
        """A build: the layer-wise loads whose step's outcome has come back without a
        failure are good."""
        self._builds += 1
        for load_id, load in list(self._loads.items()):
            if load.confirm_at is not None and load.confirm_at <= self._builds:
                self._settle(load_id, ok=True)

    def async_done(self, req_id: str) -> None:
        """The workers report the request's async load done."""
        for load_id, load in list(self._loads.items()):
            if load.req_id == req_id and load.confirm_at is None:
                self._settle(load_id, ok=True)

    def blocks_of(self, req_ids: set[str]) -> set[int]:
        """The blocks of the requests' loads not confirmed yet."""
        return {b for load in self._loads.values() if load.req_id in req_ids
                for b in load.blocks}

    def fail(self, block_ids: set[int]) -> list[Load]:
        """The workers could not fill these blocks: the loads that had them failed."""
        failed = []
        for load_id, load in list(self._loads.items()):
            if not load.blocks.isdisjoint(block_ids):
                self._settle(load_id, ok=False)
                failed.append(load)
        return failed

    def request_finished(self, req_id: str) -> None:
        """Its async load may still be running in a worker: confirm it like a
        layer-wise one, once the steps in flight have come back."""
        for load in self._loads.values():
            if load.req_id == req_id and load.confirm_at is None:
                load.confirm_at = self._builds + 1 + self.lag

    def fail_all(self) -> None:
        """Closing: no outcome will come; every load's lease goes."""
        for load_id in list(self._loads):
            self._settle(load_id, ok=False)

    def take_outcomes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(good, failed) load ids settled since last taken."""
        ok, failed = tuple(self._ok), tuple(self._failed)
        self._ok.clear()
        self._failed.clear()
        return ok, failed

    def take_leases(self) -> list[int]:
        leases, self._leases = self._leases, []
        return leases

    def take_reads(self) -> dict[int, int]:
        """lease id -> pages read under its pins, of good loads settled since taken."""
        reads, self._reads = self._reads, {}
        return reads

    def _settle(self, load_id: int, ok: bool) -> None:
        load = self._loads.pop(load_id)
        if load.lease_id:
            self._leases.append(load.lease_id)
            if ok and load.read:
                self._reads[load.lease_id] = load.read
        self._leases += load.extra_leases
        (self._ok if ok else self._failed).append(load_id)
