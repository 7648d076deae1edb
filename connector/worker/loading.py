"""A step's loads from the store's shared pool under one Acquire.

One Acquire pins every page the step loads (an Acquire is a round trip on the hit's
critical path: one per request would cost each), and its offsets are split per load. Layer-wise
loads then become one transfer: one copy per layer for all of them and one event for the
compute stream to wait on. Async loads stay one transfer each, since each request is
reported received when its own pages have landed. The lease is one too: it ends when the
last load under it has landed, each load's `release` counting down (the loads of a step
run on one stream, in order, so the last to land is the last enqueued).

A page missing at the Acquire (NOT_FOUND) fails the whole call, so the step's loads are
then acquired one by one and only the load missing a page fails.

No Acquire at all for a layer-wise load whose pages the scheduler's lookup lease already
pins in the very pool this worker maps (LoadSpec.pins, checked by the caller's `pinned`):
those go as one transfer of their own from the lookup's offsets, and end no lease (the
scheduler releases its own once the load's outcome is known).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc
import numpy as np

from kvstore_client import KVStoreError
from kvstore_client.shm import SharedRegion

from ..meta import LoadSpec

if TYPE_CHECKING:                   # the scheduler half imports no torch
    from ..transfer import LoadHandle

__all__ = ["Started", "no_release", "start_step_loads"]


@dataclasses.dataclass(frozen=True, slots=True)
class Started:
    """One load under way: the handle of its copies (several loads may share one)."""

    spec: LoadSpec
    handle: LoadHandle            # one launch's copies (several loads may share it)
    release: Callable[[], None]   # this load is done with the lease
    region: SharedRegion          # the pool mapping the offsets belong to


def _counted_release(release: Callable[[], None], users: int) -> Callable[[], None]:
    """A release that ends the lease when the last of `users` loads has called it."""
    left = [users]

    def one() -> None:
        left[0] -= 1
        if left[0] == 0:
            release()
    return one


def no_release() -> None:
    """Loads from the lookup's pins: the scheduler half holds and releases that lease."""


def start_step_loads(specs: list[LoadSpec], acquire, mem, load, pinned=None
                     ) -> tuple[list[Started], list[tuple[LoadSpec, Exception]]]:
    """Start every load of `specs`, under one Acquire or the lookup's pins; (started,
    failed with why).

    acquire(keys) -> kvstore_client Acquired; mem(region) -> the mapping's bytes (registered
    with CUDA); load(pool, offsets, block_ids) -> a transfer.LoadHandle; pinned(spec) ->
    (region, offsets) where the spec's pins may be used, else None.
    """
    direct = [(spec, got) for spec in specs if pinned is not None
              and not spec.is_async and (got := pinned(spec)) is not None]
    if not direct:
        return _acquired(specs, acquire, mem, load)
    region = direct[0][1][0]
    try:
        pool = mem(region)
        handle = load(pool, np.concatenate([offsets for _, (_, offsets) in direct]),
                      np.concatenate([spec.block_ids.reshape(len(spec.keys), -1)
                                      for spec, _ in direct]))
    except (OSError, RuntimeError, ValueError):
        # The same loads go the usual way, under an Acquire: a copy the failed launch may
        # have enqueued writes the same pages' bytes into the same blocks before it.
        return _acquired(specs, acquire, mem, load)
    started = [Started(spec, handle, no_release, region) for spec, _ in direct]
    done = {id(spec) for spec, _ in direct}
    rest = [spec for spec in specs if id(spec) not in done]
    if not rest:
        return started, []
    more, failed = _acquired(rest, acquire, mem, load)
    return started + more, failed


def _acquired(specs: list[LoadSpec], acquire, mem, load
              ) -> tuple[list[Started], list[tuple[LoadSpec, Exception]]]:
    """Every load of `specs` under one Acquire (see start_step_loads)."""
    keys = [key for spec in specs for key in spec.keys]
    try:
        acquired = acquire(keys)
    except KVStoreError as exc:
        if exc.code == grpc.StatusCode.NOT_FOUND and len(specs) > 1:
            started, failed = [], []
            for spec in specs:
                s, f = _acquired([spec], acquire, mem, load)
                started += s
                failed += f
            return started, failed
        return [], [(spec, exc) for spec in specs]
    except (OSError, RuntimeError, ValueError) as exc:
        return [], [(spec, exc) for spec in specs]
    try:
        pool = mem(acquired.region)
    except (OSError, RuntimeError, ValueError) as exc:
        acquired.release()
        return [], [(spec, exc) for spec in specs]
    release = _counted_release(acquired.release, len(specs))
    bounds = np.cumsum([0] + [len(spec.keys) for spec in specs]).tolist()
    layerwise = [i for i, spec in enumerate(specs) if not spec.is_async]
    groups = ([layerwise] if layerwise else []) + [[i] for i, spec in enumerate(specs)
                                                  if spec.is_async]
    started, failed = [], []
    for group in groups:
        offsets = np.concatenate([acquired.offsets[bounds[i]:bounds[i + 1]] for i in group])
        blocks = np.concatenate([specs[i].block_ids.reshape(len(specs[i].keys), -1)
                                 for i in group])
        try:
            handle = load(pool, offsets, blocks)
        except (RuntimeError, ValueError) as exc:
            for i in group:
                release()
                failed.append((specs[i], exc))
            continue
        started += [Started(specs[i], handle, release, acquired.region) for i in group]
    return started, failed
