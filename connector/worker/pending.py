"""Saves in flight: pages copied (or being copied) into reserved store slots, and when their
reservation may be committed.

A step's saves are reserved together (one Reserve for every request's pages: a Reserve
is a round trip of the step's host time, so one per request made a step of many
requests pay it many times; it is made beside the forward, connector.worker.reserving) and
copied together, layer by layer, on the save stream. A reservation enters the queue when
its Reserve has answered. The step that produced the pages does not wait for those
copies: the worker polls their event at later step boundaries. A reservation is finished
once

  1. its copies have landed (a slot may not be committed, nor freed for another page,
     while a copy still writes it), and
  2. every part (one request's pages) is decided: its loads are known good (COMMIT) or one
     failed (DROP: the pages were computed over KV that never arrived; connector.worker.outcomes).

A reservation is committed or aborted as a whole (Commit takes a lease id), so a part that
must not be stored is first taken out by deleting its reserved keys: the store marks a
slot deleted while it is being written and frees it at Commit instead of publishing it
(kvstore_server.store: DOOMED). Dropping parts is rare (a failed load); the usual step
makes one Reserve and one Commit.

Pure bookkeeping: no RPC, no device. Not thread-safe: the worker's thread only.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

import numpy as np

from ..meta import LoadSpec, SaveSpec
from .outcomes import LoadOutcomes, Verdict

__all__ = ["HOLD_STEPS", "Part", "PendingSave", "SaveQueue", "Settle"]


@dataclasses.dataclass(slots=True)
class Part:
    """One request's pages in a reservation: rows [lo, hi) of its offsets."""

    spec: SaveSpec
    lo: int
    hi: int
    dropped: bool = False      # not to be stored (computed over a failed load)


class Settle(enum.Enum):
    WAIT = "wait"              # copies in flight, or a part waits on its loads' outcomes
    COMMIT = "commit"          # every part is to be stored
    PARTIAL = "partial"        # forget the dropped parts' keys, then commit
    ABORT = "abort"            # nothing is to be stored


@dataclasses.dataclass(slots=True)
class PendingSave:
    """One reservation's pages: a step's saves (shared pool) or one request's (a buffer)."""

    parts: list[Part]
    host: np.ndarray           # where the slabs go: the shared pool or a pinned buffer
    offsets: np.ndarray        # page offsets in host, every part's rows (-1: already stored)
    block_ids: np.ndarray      # (pages, blocks_per_page): where the pages are in the engine
    commit: Callable[[], object]      # Commit the reservation (or Put the buffer)
    abort: Callable[[], object]       # give the reserved slots back
    # Delete some reserved keys before the commit (they are then never published); None:
    # the reservation cannot lose parts (one part only), a dropped part aborts it.
    forget: Callable[[list[bytes]], object] | None = None
    region: object = None      # the pool mapping the offsets belong to (None: a buffer)
    # Its pages planned for the transfer (transfer.SaveBatch) at its first layer's copy,
    # for every later layer of the step; dropped once the step's copies are enqueued.
    batch: Any = None
    handle: Any = None      # the copies' SaveHandle, once the step enqueued them all
    landed: bool = False       # the copies have landed (or failed: then all dropped)
    held: int = 0              # steps it has waited on loads' outcomes since landing

    @classmethod
    def of(cls, spec: SaveSpec, host: np.ndarray, offsets: np.ndarray, commit, abort,
           region=None) -> PendingSave:
        """One request's save in a reservation of its own."""
        return cls([Part(spec, 0, len(spec.keys))], host, offsets, spec.block_ids, commit,
                   abort, None, region)

    @property
    def req_ids(self) -> set[str]:
        return {part.spec.req_id for part in self.parts}

    def stored_pages(self) -> int:
        """Pages a commit makes visible: the live parts' rows with a slot."""
        return sum(int((self.offsets[p.lo:p.hi] >= 0).sum()) for p in self.parts
                   if not p.dropped)

    def drop_over(self, failed: LoadSpec) -> None:
        """Drop the parts computed over the failed load's blocks: its own request's, and
        every part whose prefix reads them (SaveSpec.after)."""
        for part in self.parts:
            if part.spec.req_id == failed.req_id or failed.load_id in part.spec.after:
                part.dropped = True

    def drop_all(self) -> None:
        for part in self.parts:
            part.dropped = True

    def settle(self, outcomes: LoadOutcomes, give_up: bool) -> Settle:
        """What to do now. give_up: parts still waiting on their loads' outcomes are
        dropped (they waited too long, or the worker is closing)."""
        if not self.landed:
            return Settle.WAIT
        waiting = False
        for part in self.parts:
            if part.dropped:
                continue
            verdict = outcomes.verdict(part.spec.after)
            if verdict is Verdict.DROP or (verdict is Verdict.HOLD and give_up):
                part.dropped = True
            elif verdict is Verdict.HOLD:
                waiting = True
        if waiting:
            return Settle.WAIT
        dropped = sum(part.dropped for part in self.parts)
        if dropped == len(self.parts) or (dropped and self.forget is None):
            return Settle.ABORT
        return Settle.PARTIAL if dropped else Settle.COMMIT

    def dropped_keys(self) -> list[bytes]:
        """The keys this reservation took for dropped parts (offset -1: taken by no one
        here, not to be deleted)."""
        keys = []
        for part in self.parts:
            if part.dropped:
                rows = np.flatnonzero(self.offsets[part.lo:part.hi] >= 0).tolist()
                keys += [part.spec.keys[i] for i in rows]
        return keys


# Steps a save may wait for the outcomes of the loads it names; the scheduler half
# reports them within max_concurrent_batches steps, so a save still waiting is given up.
HOLD_STEPS = 8


class SaveQueue:
    """A worker's saves from reservation to commit or abort, in three stages."""

    def __init__(self) -> None:
        self.step: list[PendingSave] = []       # this step's, copied layer by layer
        self.inflight: list[PendingSave] = []   # copies enqueued, not known to have landed
        self.held: list[PendingSave] = []       # landed, waiting on loads' outcomes

    def __iter__(self):
        return iter((*self.step, *self.inflight, *self.held))

    def __len__(self) -> int:
        """Saves not finished yet, in any stage."""
        return len(self.step) + len(self.inflight) + len(self.held)

    def enqueued(self, handle) -> None:
        """The step's copies are all enqueued: `handle` says when they have landed."""
        for save in self.step:
            save.handle = handle
            save.batch = None
        self.inflight += self.step
        self.step = []

    def drop_over(self, failed: LoadSpec) -> None:
        for save in self:
            save.drop_over(failed)

    def keys(self) -> set[bytes]:
        """Keys the saves not finished yet are to store (their live parts' rows with a
        slot)."""
        out: set[bytes] = set()
        for save in self:
            for part in save.parts:
                if not part.dropped:
                    rows = np.flatnonzero(save.offsets[part.lo:part.hi] >= 0).tolist()
                    out.update(part.spec.keys[i] for i in rows)
        return out

    def busy(self) -> set[str]:
        """Requests with a save whose copies may still read their blocks."""
        out: set[str] = set()
        for save in (*self.step, *self.inflight):
            out |= save.req_ids
        return out

    def poll(self, outcomes: LoadOutcomes, step: bool = False,
             on_error: Callable[[PendingSave, Exception], None] | None = None,
             ) -> list[tuple[PendingSave, Settle]]:
        """The saves to finish now and how (never waits); step: a step has passed. A save
        whose copies failed on the device (its handle raised) drops every part."""
        still = []
        for save in self.inflight:
            try:
                if not save.handle.done():
                    still.append(save)
                    continue
            except RuntimeError as exc:            # transfer.TransferError
                if on_error is not None:
                    on_error(save, exc)
                save.drop_all()
            save.landed = True
            self.held.append(save)
        self.inflight = still
        return self.settle(outcomes, step)

    def settle(self, outcomes: LoadOutcomes, step: bool = False,
               give_up: bool = False) -> list[tuple[PendingSave, Settle]]:
        ready: list[tuple[PendingSave, Settle]] = []
        waiting: list[PendingSave] = []
        for save in self.held:
            save.held += step
            what = save.settle(outcomes, give_up or save.held > HOLD_STEPS)
            if what is Settle.WAIT:
                waiting.append(save)
            else:
                ready.append((save, what))
        self.held = waiting
        return ready

    def land_all(self, wait: Callable[[PendingSave], object]) -> None:
        """Every copy waited for (`wait(save)` blocks until it has landed or raises):
        nothing is given back under a copy still running."""
        for save in (*self.step, *self.inflight):
            try:
                wait(save)
            except RuntimeError:
                save.drop_all()
            save.landed = True
        self.held += self.step + self.inflight
        self.step, self.inflight = [], []
