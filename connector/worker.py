"""The worker half: moves pages between the store and the engine's paged KV tensors.

Per step, in the order engines call it (docs/dev/vllm-0.33-connector-api.md, section 5):

    bind(meta)             reserve store slots for this step's saves (before the forward)
    start_load(meta)       pin the pages to load (Acquire) and start copying them, every
                           layer on a side stream with one event per layer
    wait_for_layer(name)   the compute stream waits for that layer's copies only
    save_layer(name)       that layer's pages to save are gathered and copied out (D2H)
    wait_for_save()        every save copy has landed: commit the reservations
    finished(ids)          loads whose copies are done release their pins; async loads are
                           reported as received
    load_errors()          block ids whose load failed (the engine recomputes them)

No page computed over a failed load is stored. A save that names loads in
SaveSpec.after (its request's prefix reads their blocks) is committed only when every
one of them is known good, from this worker (its own loads) or from the scheduler half
(StepMeta.loads_ok, the word of every rank); until then it is held, written but not
committed, and it is dropped if one of them failed (connector.outcomes). A load's own
failure (at Acquire, or in its copies, found at the latest in wait_for_save) is known
here at once; another rank's, one or two steps later through the scheduler half.

A store that does not answer costs the step that meets it at most one call's `timeout`:
that call opens the breaker (connector.breaker), and while it is open, or while the
scheduler half reports the store down (StepMeta.store_down), the worker makes no call to
the store: saves are skipped (their reservations expire in the store), loads fail at once
(the engine recomputes). The breaker's probe runs on its own thread, never in a step.

On the store's host the pages move straight between the shared pool (registered with
CUDA once) and the GPU; elsewhere they go through a pinned buffer and gRPC. All CUDA
work is in connector.transfer; this module only plans it.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc
import numpy as np

from kvstore_client import KVStoreClient, KVStoreError, PageLayout

from .breaker import Breaker
from .config import ConnectorConfig, open_client
from .hostmem import Mappings
from .meta import LoadSpec, SaveSpec, StepMeta
from .outcomes import LoadOutcomes, Verdict
from .transfer import KVTransfer, LoadHandle, TransferError, pinned_empty

__all__ = ["WorkerHalf", "layer_order"]

log = logging.getLogger(__name__)

# Errors that mean the store is not answering (as opposed to a missing page).
_NOT_ANSWERING = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)


def layer_order(names: Sequence[str]) -> list[str]:
    """Layer names in model order: by the first number in the name (model.layers.7...),
    falling back to the order given."""
    def index(item):
        pos, name = item
        match = re.search(r"\.(\d+)\.", name) or re.search(r"(\d+)", name)
        return (int(match.group(1)) if match else pos, pos)
    return [name for _, name in sorted(enumerate(names), key=index)]


@dataclasses.dataclass(slots=True)
class _Load:
    spec: LoadSpec
    handle: LoadHandle
    release: Callable[[], object]   # ends the pin on the source pages
    region: object = None     # the pool mapping the offsets belong to (None: a buffer)


@dataclasses.dataclass(slots=True)
class _Save:
    spec: SaveSpec
    host: np.ndarray          # where the slabs go: the shared pool or a pinned buffer
    offsets: np.ndarray       # page offsets in host (-1: already stored, skipped)
    commit: Callable[[], object]    # Commit the reservation, or Put the buffer (gRPC)
    abort: Callable[[], object]     # give the reserved slots back
    region: object = None     # the pool mapping the offsets belong to (None: a buffer)
    held: int = 0             # steps its commit has waited on loads' outcomes


# Steps a save may wait for the outcomes of the loads it names; the scheduler half
# reports them within max_concurrent_batches steps, so a save still waiting is given up.
_HOLD_STEPS = 8


class WorkerHalf:
    """Engine-agnostic worker logic over kv5 views of the engine's KV tensors."""

    def __init__(self, config: ConnectorConfig, layout: PageLayout, layers: Mapping[str, Any],
                 *, saves: bool = True, client: KVStoreClient | None = None) -> None:
        """layers: layer name -> kv5 view [kv_factor, blocks, block_size, heads, head]."""
        names = layer_order(list(layers))
        if len(names) != layout.num_layers:
            raise ValueError(f"layout has {layout.num_layers} layers, the engine registered "
                             f"{len(names)}")
        self.config = config
        self.layout = layout
        self._index = {name: i for i, name in enumerate(names)}
        views = [layers[name] for name in names]
        self.device = views[0].device
        self.transfer = KVTransfer(views, layout.page_tokens, self.device)
        self.saves_enabled = saves and config.role.saves
        self.client = client or open_client(config, config.timeout,
                                            shared_memory=config.shared_memory)
        self._ns = None                            # registered on first use
        self._mappings = Mappings()                # pool mappings registered with CUDA
        self._last_region = None                   # the newest mapping used
        self._loads: list[_Load] = []              # this step's layer-wise loads
        self._async: dict[str, _Load] = {}         # loads reported when done
        self._saves: list[_Save] = []
        self._errors: set[int] = set()
        self._failed_async: set[str] = set()
        self._outcomes = LoadOutcomes()            # of the loads saves name (after)
        self._held: list[_Save] = []               # written, waiting on loads' outcomes
        # Usually the scheduler half finds a hung store first (StepMeta.store_down); a
        # call of ours that meets it opens this one, probed back on its own thread.
        self.breaker = Breaker(config.probe_interval, self._probe)
        self._store_down = False                   # this step's StepMeta.store_down
        self._stats = self._zero_stats()

    @property
    def ns(self):
        """The layout's handle; registering lazily lets an engine start while the store
        is down (its loads and saves then fail softly until it is back)."""
        if self._ns is None:
            self._ns = self.client.register_layout(self.layout)
        return self._ns

    # -- host memory ------------------------------------------------------------------
    def _shared(self) -> bool:
        """Whether pages move through the store's shared pool (else gRPC and buffers)."""
        return self.client.region() is not None

    def _mem(self, region) -> np.ndarray:
        """The bytes of the mapping that issued a reservation's or acquisition's offsets:
        never another one, which after a restart holds other pages at those offsets."""
        mem = self._mappings.mem(region)
        self._last_region = region
        return mem

    def _buffer(self, n_pages: int) -> np.ndarray:
        """A pinned host buffer for n pages (no shared pool: pages cross the socket)."""
        return pinned_empty(n_pages * self.ns.page_bytes, self.device)

    # -- loads --------------------------------------------------------------------------
    def start_load(self, meta: StepMeta) -> None:
        for spec in meta.loads:
            try:
                if not self._may_call():
                    raise KVStoreError(grpc.StatusCode.UNAVAILABLE,
                                       "the store is not answering (waiting for a probe)")
                load = self._start_one(spec)
                self.breaker.succeeded()
            except (KVStoreError, KeyError, OSError, RuntimeError, ValueError) as exc:
                self._trip(exc)
                self._load_failed(spec, exc)
                continue
            self._stats["pages_loaded"] += len(spec.keys)
            self._stats["bytes_loaded"] += len(spec.keys) * self.ns.page_bytes
            if spec.is_async:
                self._async[spec.req_id] = load
            else:
                self._loads.append(load)

    def _start_one(self, spec: LoadSpec) -> _Load:
        lb = self.ns.layer_bytes
        if self._shared():
            acquired = self.client.acquire(self.ns, spec.keys)
            try:
                pool = self._mem(acquired.region)
                handle = self.transfer.load(pool, acquired.offsets, lb, spec.block_ids)
            except BaseException:
                acquired.release()
                raise
            return _Load(spec, handle, acquired.release, acquired.region)
        host = self._buffer(len(spec.keys))
        self.client.get_into(self.ns, spec.keys, host)
        offsets = np.arange(len(spec.keys), dtype=np.int64) * self.ns.page_bytes
        handle = self.transfer.load(host, offsets, lb, spec.block_ids)
        return _Load(spec, handle, lambda: None)

    def _load_failed(self, spec: LoadSpec, exc: Exception) -> None:
        log.warning("load of %d pages for %s failed, the engine recomputes them: %s",
                    len(spec.keys), spec.req_id, exc)
        self._stats["load_failures"] += 1
        self._errors.update(int(b) for b in spec.block_ids.reshape(-1))
        if spec.is_async:
            self._failed_async.add(spec.req_id)
        self._outcomes.failed([spec.load_id])
        # Pages computed over blocks that were never filled may not be stored, whichever
        # request computed them (its own, or one sharing its blocks).
        self._cancel_saves(spec)
        self._settle_held()

    def _probe(self) -> bool:
        """The breaker's probe (on its own thread): does the store answer?"""
        try:
            self.client.register_layout(self.layout)
        except KVStoreError as exc:
            return exc.code not in _NOT_ANSWERING
        return True

    def _may_call(self) -> bool:
        """Whether to call the store now: not while the scheduler half reports it hung,
        nor while our own breaker is open (but for its probes)."""
        return not self._store_down and self.breaker.allow()

    def _trip(self, exc: Exception) -> None:
        """A call that timed out or found the store unreachable opens the breaker."""
        if isinstance(exc, KVStoreError) and exc.code in _NOT_ANSWERING:
            self.breaker.failed()

    def wait_for_layer(self, name: str) -> None:
        layer = self._index[name]
        for load in self._loads:
            load.handle.wait_layer(layer)

    # -- saves --------------------------------------------------------------------------
    def bind(self, meta: StepMeta) -> None:
        """Reserve the store's slots for this step's saves before the forward starts, so
        no RPC waits inside the layers."""
        self._saves.clear()
        self._store_down = meta.store_down
        self._outcomes.succeeded(meta.loads_ok)
        self._outcomes.failed(meta.loads_failed)
        self._settle_held(step=True)
        if not self.saves_enabled:
            return
        for spec in meta.saves:
            if self._outcomes.verdict(spec.after) is Verdict.DROP:
                log.info("not saving %d pages of %s: computed over a failed load",
                         len(spec.keys), spec.req_id)
                continue
            if not self._may_call():
                continue                  # the store is not answering: a miss later
            try:
                self._saves.append(self._reserve(spec))
                self.breaker.succeeded()
            except (KVStoreError, OSError, RuntimeError) as exc:
                self._trip(exc)
                log.warning("not saving %d pages of %s: %s", len(spec.keys), spec.req_id, exc)

    def _reserve(self, spec: SaveSpec) -> _Save:
        if self._shared():
            res = self.client.reserve(self.ns, spec.keys)
            try:
                pool = self._mem(res.region)
            except BaseException:
                res.abort()
                raise
            return _Save(spec, pool, res.offsets, res.commit, res.abort, res.region)
        host = self._buffer(len(spec.keys))
        offsets = np.arange(len(spec.keys), dtype=np.int64) * self.ns.page_bytes
        keys = spec.keys
        return _Save(spec, host, offsets,
                     lambda: self.client.put(self.ns, keys,
                                             host.reshape(len(keys), self.ns.page_bytes)),
                     lambda: None)

    def _cancel_saves(self, failed: LoadSpec) -> None:
        """Abort the step's saves computed over the failed load's blocks."""
        keep = []
        for save in self._saves:
            if save.spec.req_id == failed.req_id or failed.load_id in save.spec.after:
                if not self._may_call():
                    continue                    # not answering: the reservation expires
                try:
                    save.abort()
                except KVStoreError as exc:     # the reservation expires by itself
                    log.debug("aborting the save of %s failed: %s", save.spec.req_id, exc)
            else:
                keep.append(save)
        self._saves = keep

    def _settle_held(self, step: bool = False) -> None:
        """Commit held saves whose loads all succeeded, abort those over a failed one (or
        waiting too long); step: a step has passed."""
        waiting = []
        for save in self._held:
            save.held += step
            verdict = self._outcomes.verdict(save.spec.after)
            if verdict is Verdict.HOLD and save.held <= _HOLD_STEPS:
                waiting.append(save)
            else:
                self._finish_save(save, verdict is Verdict.COMMIT)
        self._held = waiting

    def _finish_save(self, save: _Save, commit: bool) -> None:
        if not self._may_call():
            # The store is not answering: neither commit nor abort (each would wait its
            # timeout); the reservation expires in the store, the pages are a miss later.
            log.info("not saving %d pages of %s: the store is not answering",
                     len(save.spec.keys), save.spec.req_id)
            return
        try:
            if not commit:
                save.abort()
                return
            save.commit()
            stored = int((save.offsets >= 0).sum())
            self._stats["pages_saved"] += stored
            self._stats["bytes_saved"] += stored * self.ns.page_bytes
        except KVStoreError as exc:
            self._trip(exc)
            log.warning("finishing the save of %d pages of %s failed: %s",
                        len(save.spec.keys), save.spec.req_id, exc)

    def save_layer(self, name: str) -> None:
        layer = self._index[name]
        for save in self._saves:
            self.transfer.save_layer(layer, save.host, save.offsets, save.spec.block_ids)

    def wait_for_save(self) -> None:
        self._check_loads()
        if not self._saves:
            return
        try:
            self.transfer.finish_save()
            ok = True
        except RuntimeError as exc:
            log.warning("saving pages failed, they are not stored: %s", exc)
            ok = False
        for save in self._saves:
            verdict = self._outcomes.verdict(save.spec.after) if ok else Verdict.DROP
            if verdict is Verdict.HOLD:
                self._held.append(save)       # committed once its loads are known good
            else:
                self._finish_save(save, verdict is Verdict.COMMIT)
        self._saves.clear()

    # -- completion ---------------------------------------------------------------------
    def _check_loads(self) -> None:
        """Finish this step's layer-wise loads (the forward waited on every layer), so a
        copy that failed on the device is known before any save of the step commits."""
        for load in self._loads:
            try:
                load.handle.synchronize()
            except (TransferError, RuntimeError) as exc:
                self._load_failed(load.spec, exc)
            load.release()
        self._loads.clear()

    def finished(self) -> set[str]:
        """Release finished loads' pins; return ids of async loads now complete."""
        self._check_loads()
        done = set(self._failed_async)
        self._failed_async.clear()
        for req_id, load in list(self._async.items()):
            try:
                landed = load.handle.done()
            except (TransferError, RuntimeError) as exc:
                self._load_failed(load.spec, exc)
                self._failed_async.discard(req_id)
                landed = True
            if landed:
                load.release()
                del self._async[req_id]
                done.add(req_id)
        # A step boundary: mappings of a server that restarted can go once no copy uses them.
        self._mappings.keep_only([self._last_region, *(x.region for x in self._async.values()),
                                  *(x.region for x in (*self._saves, *self._held))])
        return done

    @staticmethod
    def _zero_stats() -> dict[str, int]:
        return {"pages_loaded": 0, "bytes_loaded": 0, "load_failures": 0,
                "pages_saved": 0, "bytes_saved": 0}

    def take_stats(self) -> dict[str, int]:
        """Counters since the last call (pages and bytes loaded and saved, failures)."""
        stats, self._stats = self._stats, self._zero_stats()
        return stats

    def load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def close(self) -> None:
        for load in [*self._loads, *self._async.values()]:
            load.handle.synchronize()
            load.release()
        self._loads.clear()
        self._async.clear()
        for save in self._held:               # their loads' outcomes will never come
            self._finish_save(save, commit=False)
        self._held.clear()
        self._mappings.close()
        self.breaker.close()
        self.client.close()
