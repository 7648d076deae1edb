"""The worker half: moves pages between the store and the engine's paged KV tensors.

Per step, in the order engines call it (docs/dev/vllm-0.33-connector-api.md, section 5):

    bind(meta)             ask for store slots for every save of the step in one call
                           (Reserve) on the reserve thread, and return without its
                           answer;
                           finish earlier steps' saves whose copies have landed
    start_load(meta)       pin every page the step loads in one call (Acquire) and start
                           copying them, every layer on a side stream with one event per
                           layer; then take the Reserve's answer
    wait_for_layer(name)   the compute stream waits for that layer's copies only
    save_layer(name)       that layer's pages to save are gathered and copied out (D2H),
                           or, while the device is less than two hooks behind the
                           host, the layer waits for a later hook; while the Reserve
                           is unanswered the layer is owed instead, and copied (in
                           order) by the first hook that finds the answer in
    wait_for_save()        the hooks put off are run; the Reserve's answer is waited for
                           if still out, the layers owed are copied; the step's save
                           copies are recorded, not waited for; the step's loads are
                           checked (a failed one is reported this step)
    finished(ids)          loads whose copies are done release their pins; async loads are
                           reported as received
    sent(ids)              finished requests none of whose save copies is still running:
                           their blocks may be reused (vLLM's finished_sending)
    load_errors()          block ids whose load failed (the engine recomputes them)

The Reserve runs beside the forward (connector.worker.reserving says why and why a copy
launched after its layer's hook is still right): made in bind, its round trip delayed
the forward by all of it. Without the pool the same thread asks which of the step's
pages the store holds (one Exists): only the others are copied to a pinned buffer per
request and sent by its Put, so a page crosses the network once. The Reserve and the step's
Acquire go over two connections of the fast path (kvstore_client.fastpath's lease
lanes), so neither waits for the other, and start_load takes the Reserve's answer once
its loads are launched, before the forward. A Reserve whose answer no hook took by the
next bind belongs to a step that never reached wait_for_save: its slots are given
back, nothing stored.

Saves are asynchronous: the step that produced pages never waits for their copies or
their Commit. The copies run on the save stream beside the next steps; a later step
boundary (bind, finished, sent) polls their event and commits the reservation once they
have landed and every load they were computed over is known good (connector.worker.pending).
Until then the engine must not reuse the blocks they read: a finished request's blocks
are held by the engine until `sent` names it (the adapters answer request_finished
"delay the free" for every request a save was planned for), and the next step's compute
stream waits on the device for the copies still running (bind), which also covers blocks
an engine frees without asking (a preemption). A copy that fails commits nothing.

No page computed over a failed load is stored. A save that names loads in
SaveSpec.after (its request's prefix reads their blocks) is committed only when every
one of them is known good, from this worker (its own loads) or from the scheduler half
(StepMeta.loads_ok, the word of every rank); until then it is held, written but not
committed, and it is dropped if one of them failed (connector.worker.outcomes). A load's own
failure (at Acquire, or in its copies, found at the latest in wait_for_save) is known
here at once; another rank's, one or two steps later through the scheduler half.

A store that does not answer costs the step that meets it at most one call's `timeout`
(a Reserve's is waited for at wait_for_save, or in start_load, so the wait ends when the
call would have ended inline): that call opens the breaker
(connector.breaker), and while it is open, or while the scheduler half reports the store
down (StepMeta.store_down), the worker makes no call to the store: saves are skipped
(their reservations expire in the store), loads fail at once (the engine recomputes).
The breaker's probe runs on its own thread, never in a step.

On the store's host the pages move straight between the shared pool (registered with
CUDA once) and the GPU. Elsewhere a load is received layer by layer into a ring of
pinned slabs and each layer copied to the GPU as it lands (remote), so the forward's first
layer waits for the first layer's bytes only (its deadline follows its progress:
deadline); saves go through a pinned buffer and a Put. All CUDA work is in
connector.transfer; this module only plans it.

Over 400 lines because it is the one place that reads in the order an engine calls it
(loads, saves, completion); each part with an idea of its own is a module beside it
(loading, remote, reserving, pending, outcomes, hostmem, and the shared breaker).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import grpc
import numpy as np

from kvstore_client import (
    KVStoreClient,
    KVStoreError,
    LayoutHandle,
    PageLayout,
    PutResult,
)
from kvstore_client.shm import Reservation, SharedRegion

from ..breaker import Breaker, not_answering
from ..config import ConnectorConfig, open_client
from ..meta import LoadSpec, SaveSpec, StepMeta
from ..transfer import KVTransfer, TransferError, pinned_empty
from .hostmem import Mappings
from .loading import no_release, start_step_loads
from .outcomes import LoadOutcomes, Verdict
from .pending import Part, PendingSave, SaveQueue, Settle
from .putting import Puts
from .remote import RemoteLoadFailed, RemoteLoads
from .reserving import StepReserve
from .sending import Held, to_send

__all__ = ["SharedStore", "WorkerHalf", "WorkerStats", "layer_order"]

log = logging.getLogger(__name__)

# A layer's save hook copies the layers held so far out only while the device is still
# short of where the engine's stream was this many hooks before (save_layer says why:
# measured against 1 and 3).
_SAVE_LEAD_HOOKS = 2


def layer_order(names: Sequence[str]) -> list[str]:
    """Layer names in model order: by the first number in the name (model.layers.7...),
    falling back to the order given."""
    def index(item):
        pos, name = item
        match = re.search(r"\.(\d+)\.", name) or re.search(r"(\d+)", name)
        return (int(match.group(1)) if match else pos, pos)
    return [name for _, name in sorted(enumerate(names), key=index)]


@dataclasses.dataclass(slots=True)
class WorkerStats:
    """What the worker half moved since the stats were last taken (vLLM's connector stats)."""

    pages_loaded: int = 0
    bytes_loaded: int = 0
    load_failures: int = 0
    pages_saved: int = 0
    bytes_saved: int = 0
    loads_pinned: int = 0         # loads that copied under the lookup's lease, no Acquire


class Landing(Protocol):
    """A load's copies in flight: a transfer.LoadHandle (from the shared pool), or its
    part of a step's remote load (connector.worker.remote), whose layers land as bytes arrive."""

    def wait_layer(self, layer: int) -> None: ...
    def done(self) -> bool: ...
    def synchronize(self) -> None: ...


@dataclasses.dataclass(frozen=True, slots=True)
class _Load:
    """One load under way, until its copies have landed and its pin is released."""

    spec: LoadSpec
    handle: Landing                 # its copies (one handle may serve several loads)
    release: Callable[[], None]     # ends the pin on the source pages
    region: SharedRegion | None = None   # the pool mapping of its offsets (None: a buffer)


# One request's save in a reservation of its own (the buffer path).
_Save = PendingSave.of


def _store_answers(client: KVStoreClient, layout: PageLayout) -> bool:
    """A breaker's probe (on its own thread): does the store answer?"""
    try:
        client.register_layout(layout)
    except KVStoreError as exc:
        return not not_answering(exc)
    return True


@dataclasses.dataclass(frozen=True, slots=True)
class SharedStore:
    """What the worker halves of one process share, made once for all of them: the
    client (its connections and its mapping of the store's pool), the pool mappings
    registered with CUDA, and the breaker (it is one store that answers or does not).
    Each registration pins the whole pool again (cudaHostRegister takes time per GiB:
    connector.worker.hostmem), so a hybrid model's groups must not each make their own. Its owner
    (connector.worker.groupworkers) closes it after every worker half that uses it."""

    client: KVStoreClient
    mappings: Mappings
    breaker: Breaker

    @classmethod
    def open(cls, config: ConnectorConfig, probe_layout: PageLayout) -> SharedStore:
        client = open_client(config, config.timeout, shared_memory=config.shared_memory,
                             data_connections=config.remote_connections)
        return cls(client, Mappings(),
                   Breaker(config.probe_interval, lambda: _store_answers(client, probe_layout)))

    def keep_only(self, regions: Iterable[object]) -> None:
        """Close the registrations no worker half still copies through."""
        self.mappings.keep_only(regions)

    def close(self) -> None:
        self.mappings.close()
        self.breaker.close()
        self.client.close()


class WorkerHalf:
    """Engine-agnostic worker logic over kv5 views of the engine's KV tensors."""

    def __init__(self, config: ConnectorConfig, layout: PageLayout, layers: Mapping[str, Any],
                 *, saves: bool = True, client: KVStoreClient | None = None,
                 shared: SharedStore | None = None) -> None:
        """layers: layer name -> kv5 view [kv_factor, blocks, block_size, heads, head].
        shared: the client, mappings and breaker of every worker half of the process
        (a hybrid model's groups); its owner closes it. Else this worker has its own."""
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
        self._shared_store = shared
        if shared is not None:
            self.client = shared.client
        else:
            self.client = client or open_client(config, config.timeout,
                                                shared_memory=config.shared_memory,
                                                data_connections=config.remote_connections)
        self._ns: LayoutHandle | None = None       # registered on first use
        # Pool mappings registered with CUDA (the process's one table when shared).
        self._mappings = shared.mappings if shared is not None else Mappings()
        self._remote = RemoteLoads(self.client, self.transfer, config.remote_staging_bytes)
        self._last_region = None                   # the newest mapping used
        self._loads: list[_Load] = []              # this step's layer-wise loads
        self._layer_handles: list[Landing] = []    # their distinct handles (wait_for_layer)
        self._async: dict[str, _Load] = {}         # loads reported when done
        self._saves = SaveQueue()                  # reserved, copying, waiting to commit
        self._puts = Puts()                        # the buffer path's Puts, under way
        self._reserving = StepReserve()            # the step's Reserve, until answered
        self._unsaved: list[int] = []              # layers whose save hooks were put off
        self._errors: set[int] = set()
        self._failed_async: set[str] = set()
        # Async loads that failed, until taken: a hybrid engine hears of a failure per
        # request (vLLM's failed_recving), as block ids are not unique across groups.
        self._failed_recving: set[str] = set()
        self._outcomes = LoadOutcomes()            # of the loads saves name (after)
        # Requests a save was planned for (in any plan this worker was handed): when one
        # finishes, the engine holds its blocks until `sent` names it.
        self._saving: set[str] = set()
        self._finishing: set[str] = set()          # finished, a save copy still running
        # Usually the scheduler half finds a hung store first (StepMeta.store_down); a
        # call of ours that meets it opens this one, probed back on its own thread.
        self.breaker = (shared.breaker if shared is not None
                        else Breaker(config.probe_interval, self._probe))
        self._store_down = False                   # this step's StepMeta.store_down
        self._stats = WorkerStats()
        # The testing hook (ConnectorConfig.fail_loads) and the requests it has failed.
        self._fail_loads = re.compile(config.fail_loads) if config.fail_loads else None
        self._hook_failed: set[str] = set()

    @property
    def step_reserve(self) -> StepReserve:
        """The step's Reserve (worker.reserving): whether one is asked and answered,
        read by tests."""
        return self._reserving

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
        if not meta.loads:
            return
        # The step's Reserve, asked for in bind, runs beside the Acquire (on a lane of
        # its own); its answer is taken here, once the loads are launched, before the
        # forward. Left to the save hooks during the forward instead (likely contending
        # for the GIL with the forward's launches), a short hit was slower in e2e runs.
        # A store that does not answer costs the step one timeout: the Acquire and the
        # Reserve wait for it side by side.
        try:
            self._start_loads(meta)
        finally:
            self._take_reserve()

    def _start_loads(self, meta: StepMeta) -> None:
        specs = self._hook_failures(meta.loads)
        if not specs:
            return
        meta = dataclasses.replace(meta, loads=tuple(specs))
        if not self._may_call():
            exc = KVStoreError(grpc.StatusCode.UNAVAILABLE,
                               "the store is not answering (waiting for a probe)")
            for spec in meta.loads:
                self._load_failed(spec, exc)
            return
        try:
            shared = self._shared()
        except (KVStoreError, OSError) as exc:
            self._trip(exc)
            for spec in meta.loads:
                self._load_failed(spec, exc)
            return
        if shared:
            self._start_shared(list(meta.loads))
        else:
            self._start_remote(list(meta.loads))

    def _hook_failures(self, specs: Sequence[LoadSpec]) -> list[LoadSpec]:
        """The loads to start: the testing hook `fail_loads` fails the first load of each
        request it names, before any call, as a store fault would (ConnectorConfig)."""
        if not self._fail_loads:
            return list(specs)
        out = []
        for spec in specs:
            if spec.req_id not in self._hook_failed and self._fail_loads.search(spec.req_id):
                self._hook_failed.add(spec.req_id)
                self._load_failed(spec, KVStoreError(grpc.StatusCode.UNAVAILABLE,
                                                     "failed by the fail_loads test hook"))
            else:
                out.append(spec)
        return out

    def _started(self, loads: list[_Load]) -> None:
        for load in loads:
            spec = load.spec
            self._stats.pages_loaded += len(spec.keys)
            self._stats.bytes_loaded += len(spec.keys) * self.ns.page_bytes
            if spec.is_async:
                self._async[spec.req_id] = load
            else:
                self._loads.append(load)
                if not any(h is load.handle for h in self._layer_handles):
                    self._layer_handles.append(load.handle)

    def _start_shared(self, specs: list[LoadSpec]) -> None:
        """Every load of the step under one Acquire (connector.worker.loading)."""
        lb = self.ns.layer_bytes
        began = time.monotonic()
        started, failed = start_step_loads(
            specs, lambda keys: self.client.acquire(self.ns, keys), self._mem,
            lambda pool, offsets, blocks: self.transfer.load(pool, offsets, lb, blocks),
            self._pinned)
        self._stats.loads_pinned += sum(x.release is no_release for x in started)
        tripped = False
        for spec, exc in failed:
            tripped |= self._trip(exc)
            self._load_failed(spec, exc)
        if not tripped:
            self.breaker.succeeded(began)
        self._started([_Load(x.spec, x.handle, x.release, x.region) for x in started])

    def _pinned(self, spec: LoadSpec):
        """(region, offsets) when the scheduler's lookup lease pins the spec's pages in
        the pool this worker maps, in time; else None (the load acquires them)."""
        pins = spec.pins
        if pins is None or time.time() >= pins.use_by:
            return None
        region = self.client.region()
        offsets = pins.offsets.get(self.ns.layout_id)
        if region is None or region.id != pins.region_id or offsets is None:
            return None                   # another pool (a restart, another host)
        if len(offsets) != len(spec.keys) or not len(offsets):
            return None
        # -1: a page the lookup counted on the tier below; Acquire reads it back.
        if offsets.min() < 0 or offsets.max() + self.ns.page_bytes > region.size:
            return None
        return region, offsets

    def _start_remote(self, specs: list[LoadSpec]) -> None:
        """No shared pool: one pipelined Get for the step's layer-wise loads, one for each
        async load (connector.worker.remote); a failure is known at wait_for_save or finished."""
        layerwise = [spec for spec in specs if not spec.is_async]
        for group in ([layerwise] if layerwise else []) + [[s] for s in specs if s.is_async]:
            keys = [key for spec in group for key in spec.keys]
            blocks = np.concatenate([s.block_ids.reshape(len(s.keys), -1) for s in group])
            try:
                load = self._remote.start(self.ns, keys, blocks, [len(s.keys) for s in group])
            except (KVStoreError, OSError, RuntimeError, ValueError) as exc:
                self._trip(exc)
                for spec in group:
                    self._load_failed(spec, exc)
                continue
            self._started([_Load(s, part, lambda: None) for s, part in zip(group, load.parts(), strict=True)])

    def _load_failed(self, spec: LoadSpec, exc: Exception) -> None:
        # What the engine does next is its kv_load_failure_policy's: "recompute" (what every
        # configuration we show sets) recomputes these blocks, "fail" fails the request.
        log.warning("load of %d pages for %s failed, reported to the engine (its "
                    "kv_load_failure_policy recomputes or fails the request): %s",
                    len(spec.keys), spec.req_id, exc)
        self._stats.load_failures += 1
        self._errors.update(int(b) for b in spec.block_ids.reshape(-1))
        if spec.is_async:
            self._failed_async.add(spec.req_id)
            self._failed_recving.add(spec.req_id)
        self._outcomes.failed([spec.load_id])
        # Pages computed over blocks that were never filled may not be stored, whichever
        # request computed them (its own, or one sharing its blocks): their parts are
        # dropped, and the reservation finished once its copies have landed.
        self._saves.drop_over(spec)
        self._finish_saves(self._saves.settle(self._outcomes))

    def _remote_failed(self, exc: Exception) -> None:
        """A remote load's Get that timed out or lost the store opens the breaker, as
        any call of ours that meets it does."""
        if isinstance(exc, RemoteLoadFailed) and isinstance(exc.cause, Exception):
            self._trip(exc.cause)

    def _probe(self) -> bool:
        """The breaker's probe (on its own thread): does the store answer?"""
        return _store_answers(self.client, self.layout)

    def _may_call(self) -> bool:
        """Whether to call the store now: not while the scheduler half reports it hung,
        nor while our own breaker is open (but for its probes)."""
        return not self._store_down and self.breaker.allow()

    def _trip(self, exc: Exception) -> bool:
        """A call that found the store not answering (connector.breaker.not_answering)
        opens the breaker (True)."""
        if not_answering(exc):
            self.breaker.failed()
            return True
        return False

    def wait_for_layer(self, name: str) -> None:
        layer = self._index[name]
        for handle in self._layer_handles:
            handle.wait_layer(layer)

    # -- saves --------------------------------------------------------------------------
    def bind(self, meta: StepMeta) -> None:
        """Start reserving the store's slots for this step's saves (on the reserve thread,
        so the forward does not wait for the round trip); finish earlier saves whose
        copies have landed."""
        self._store_down = meta.store_down
        self._remote.pace.step()          # remote loads' deadlines follow the engine's pace
        self._unsaved.clear()             # put off by a step that never reached its end
        self.transfer.forget_mark()
        self._drop_unfinished_reserve()
        self._outcomes.succeeded(meta.loads_ok)
        self._outcomes.failed(meta.loads_failed)
        self._saving.update(spec.req_id for spec in meta.saves)
        if self._saves.inflight:
            # Blocks read by copies still running may be rewritten only after them.
            self.transfer.fence_saves()
        self._poll_saves(step=True)
        if not self.saves_enabled or not meta.saves:
            return
        specs = []
        for spec in meta.saves:
            if self._outcomes.verdict(spec.after) is Verdict.DROP:
                log.info("not saving %d pages of %s: computed over a failed load",
                         len(spec.keys), spec.req_id)
            else:
                specs.append(spec)
        if not specs or not self._may_call():
            return                        # the store is not answering: a miss later
        try:
            shared = self._shared()
        except (KVStoreError, OSError) as exc:
            self._trip(exc)
            log.warning("not saving this step's pages: %s", exc)
            return
        if shared:
            self._start_reserve(specs)
        else:
            self._start_exists(specs)

    def _reserve_failed(self, specs: list[SaveSpec], exc: Exception) -> None:
        self._trip(exc)
        log.warning("not saving %d pages of %s: %s", sum(len(s.keys) for s in specs),
                    ", ".join(s.req_id for s in specs), exc)

    def _start_reserve(self, specs: list[SaveSpec]) -> None:
        """The step's saves in one reservation (one Reserve), asked for on the reserve
        thread (connector.worker.reserving); the step takes it in start_load, a save hook or
        at its end."""
        try:
            ns = self.ns                  # registered on first use, here as for loads
        except (KVStoreError, OSError, RuntimeError) as exc:
            self._reserve_failed(specs, exc)
            return
        keys = [key for spec in specs for key in spec.keys]
        self._reserving.start(lambda: self.client.reserve(ns, keys), specs)

    def _start_exists(self, specs: list[SaveSpec]) -> None:
        """No shared pool: which of the step's pages the store holds (one Exists, on the
        reserve thread, as a Reserve is); only the others are copied out and sent
        (connector.worker.sending)."""
        try:
            ns = self.ns
        except (KVStoreError, OSError, RuntimeError) as exc:
            self._reserve_failed(specs, exc)
            return
        keys = [key for spec in specs for key in spec.keys]
        sending = frozenset(self._saves.keys())
        self._reserving.start(lambda: Held(self.client.exists(ns, keys), sending), specs)

    def _take_reserve(self) -> None:
        """The step's reservation, once its Reserve has answered (waited for if need be:
        the client's timeout bounds the wait), joins the step's saves and the layers it
        owes are copied, in order. A Reserve that failed is handled as it was inline: the
        step's pages are not saved."""
        answer = self._reserving.take()
        if answer is None:
            return
        try:
            got = answer.reservation()
            saves = ([self._reserve(spec, rows) for spec, rows in to_send(answer.specs, got)]
                     if isinstance(got, Held) else [self._step_save(answer.specs, got)])
        except (KVStoreError, OSError, RuntimeError) as exc:
            self._reserve_failed(answer.specs, exc)
            return
        self.breaker.succeeded(answer.began)
        self._saves.step += saves
        for layer in answer.owed:
            for save in saves:
                self._save_layer(save, layer)

    def _drop_unfinished_reserve(self) -> None:
        """A Reserve not taken by the start of a step (or by close) is of a step that never
        reached wait_for_save: none of its layers was copied and its blocks may be reused
        now, so it saves nothing and its slots are given back."""
        answer = self._reserving.take()
        if answer is None:
            return
        try:
            res = answer.reservation()
        except (KVStoreError, OSError, RuntimeError) as exc:
            self._reserve_failed(answer.specs, exc)
            return
        self.breaker.succeeded(answer.began)
        if isinstance(res, Held):
            return                        # an Exists: nothing was reserved
        log.info("not saving %d pages: their step ended before its saves",
                 sum(len(s.keys) for s in answer.specs))
        if not self._may_call():
            return                        # not answering: the reservation expires there
        try:
            res.abort()
        except KVStoreError as exc:
            self._trip(exc)
            log.warning("giving back %d reserved slots failed (they expire): %s",
                        len(res.offsets), exc)

    def _step_save(self, specs: list[SaveSpec], res: Reservation) -> PendingSave:
        """The step's reservation as one pending save, each request's pages a part of it
        (connector.worker.pending)."""
        try:
            pool = self._mem(res.region)
        except BaseException:
            res.abort()
            raise
        parts, lo = [], 0
        for spec in specs:
            parts.append(Part(spec, lo, lo + len(spec.keys)))
            lo += len(spec.keys)
        blocks = np.concatenate([spec.block_ids.reshape(len(spec.keys), -1) for spec in specs])
        ns = self.ns
        return PendingSave(parts, pool, res.offsets, blocks, res.commit, res.abort,
                           lambda dropped: self.client.delete(ns, dropped), res.region)

    def _reserve(self, spec: SaveSpec, rows: list[int]) -> PendingSave:
        """A pinned buffer for the spec's pages at `rows` (the others are not copied:
        offset -1), sent by a Put at commit."""
        page_bytes = self.ns.page_bytes
        host = self._buffer(len(rows))
        offsets = np.full(len(spec.keys), -1, dtype=np.int64)
        offsets[rows] = np.arange(len(rows), dtype=np.int64) * page_bytes
        keys = [spec.keys[i] for i in rows]
        ns = self.ns
        return _Save(spec, host, offsets,
                     lambda: self.client.put(ns, keys, host.reshape(len(keys), page_bytes)),
                     lambda: None)

    def _poll_saves(self, step: bool = False) -> None:
        """Finish the saves whose copies have landed (never waits)."""
        self._finish_saves(self._saves.poll(self._outcomes, step, self._copy_failed))
        self._count_puts(self._puts.done())

    def _count_puts(self, finished: list[tuple[PendingSave, object]]) -> None:
        """The buffer path's Puts that have returned (connector.worker.putting)."""
        for save, got in finished:
            if isinstance(got, KVStoreError):
                self._trip(got)
                log.warning("saving %d pages of %s failed: %s", len(save.offsets),
                            ", ".join(sorted(save.req_ids)), got)
            elif isinstance(got, BaseException):
                raise got                 # as a Put on this thread raised it
            else:
                self._count_saved(save, got)

    def _count_saved(self, save: PendingSave, got: object) -> None:
        # A Put answers what it stored (a page another engine stored meanwhile is
        # skipped there); a Reservation's commit, the slots this save filled.
        stored = got.stored if isinstance(got, PutResult) else save.stored_pages()
        self._stats.pages_saved += stored
        self._stats.bytes_saved += stored * self.ns.page_bytes

    @staticmethod
    def _copy_failed(save: PendingSave, exc: Exception) -> None:
        log.warning("saving %d pages failed on the device, they are not stored: %s",
                    len(save.offsets), exc)

    def _finish_saves(self, ready: list[tuple[PendingSave, Settle]]) -> None:
        for save, what in ready:
            self._finish_save(save, what)

    def _finish_save(self, save: PendingSave, what: Settle) -> None:
        if not self._may_call():
            # The store is not answering: neither commit nor abort (each would wait its
            # timeout); the reservation expires in the store, the pages are a miss later.
            log.info("not saving %d pages: the store is not answering", len(save.offsets))
            return
        try:
            if what is Settle.ABORT:
                save.abort()
                return
            dropped = save.dropped_keys() if what is Settle.PARTIAL else []
            if dropped:
                assert save.forget is not None   # PARTIAL only where parts can be forgotten
                save.forget(dropped)          # never published: see connector.worker.pending
            if save.region is None:       # a buffer: its Put goes on a thread (putting)
                self._puts.start(save)
                return
            self._count_saved(save, save.commit())
        except KVStoreError as exc:
            self._trip(exc)
            log.warning("finishing the save of %d pages of %s failed: %s",
                        len(save.offsets), ", ".join(sorted(save.req_ids)), exc)

    def save_layer(self, name: str) -> None:
        """Copy the layer's pages of the step's saves out, unless the device is less than
        _SAVE_LEAD_HOOKS hooks behind the host: then the layer waits for a later hook (or
        the end of the step), as the host work of a save (taking the Reserve's answer, a
        first plan, a piece's launches) would hold the next layer's launch back.
        A lead of one hook still left the forward's stream idle at the first save in a
        profiler trace of a short miss; a deeper lead made short misses cheaper against a
        recompute. Held layers go out together at a later hook, so a deeper lead costs no
        copy time, only a later start.
        transfer.save_layer orders a copy after the engine's stream as it is at the copy's
        launch, past the layer's compute, and a layer's KV is not rewritten within a step."""
        if not self._saves.step and not self._reserving.pending:
            return                        # nothing to save this step
        self._reserving.nudge()           # its thread reads the answer (connector.worker.reserving)
        layer = self._index[name]
        self._unsaved.append(layer)
        if self.transfer.behind(_SAVE_LEAD_HOOKS) or layer == len(self._index) - 1:
            self._save_unsaved()

    def _save_unsaved(self) -> None:
        """The save hooks put off so far, in order; while the step's Reserve is unanswered
        a layer is owed instead (copied when it is answered), so no hook waits for the
        store."""
        layers, self._unsaved = self._unsaved, []
        for layer in layers:
            if self._reserving.pending:
                if self._reserving.ready():
                    self._take_reserve()
                else:
                    self._reserving.owe(layer)
            for save in self._saves.step:
                self._save_layer(save, layer)

    def _save_layer(self, save: PendingSave, layer: int) -> None:
        """The layer's copy of the save's pages: planned at its first layer, once a step
        (transfer.save_batch), so a hook costs no per-layer checks or lookups."""
        batch = save.batch
        if batch is None:
            batch = save.batch = self.transfer.save_batch(save.host, save.offsets,
                                                          save.block_ids)
        self.transfer.save_into(batch, layer)

    def wait_for_save(self) -> None:
        """Take the step's reservation (waiting for its Reserve if it is still out) and
        copy the layers it owes; check the step's loads; hand the step's save copies to
        the poll, unwaited. The Puts started since the last one (no shared pool) have
        had this step's forward to go out; they are waited for now (putting.py)."""
        self._count_puts(self._puts.done(wait=True))
        self._save_unsaved()
        self.transfer.forget_mark()
        self._take_reserve()
        self._check_loads()
        if self._saves.step:
            self._saves.enqueued(self.transfer.finish_save(wait=False))
        self._poll_saves()

    # -- completion ---------------------------------------------------------------------
    def _check_loads(self) -> None:
        """Finish this step's layer-wise loads (the forward waited on every layer), so a
        copy that failed on the device is reported in the step that made it (the
        scheduler half counts a load good when its step reports no failure)."""
        for load in self._loads:
            try:
                load.handle.synchronize()
            except (TransferError, RuntimeError) as exc:
                self._remote_failed(exc)
                self._load_failed(load.spec, exc)
            load.release()
        self._loads.clear()
        self._layer_handles.clear()

    def finished(self) -> set[str]:
        """Release finished loads' pins; return ids of async loads now complete."""
        self._take_reserve()              # a load failing below drops parts of it
        self._check_loads()
        done = set(self._failed_async)
        self._failed_async.clear()
        for req_id, load in list(self._async.items()):
            try:
                landed = load.handle.done()
            except (TransferError, RuntimeError) as exc:
                self._remote_failed(exc)
                self._load_failed(load.spec, exc)
                self._failed_async.discard(req_id)
                landed = True
            if landed:
                load.release()
                del self._async[req_id]
                done.add(req_id)
        self._poll_saves()
        # A step boundary: mappings of a server that restarted can go once no copy uses
        # them. A shared table is pruned by its owner, over every worker's regions.
        if self._shared_store is None:
            self._mappings.keep_only(self.regions_in_use())
        return done

    def regions_in_use(self) -> list[object]:
        """The pool mappings this worker's copies may still read or write."""
        return [self._last_region, *(x.region for x in self._async.values()),
                *(x.region for x in self._saves)]

    def sent(self, finished_req_ids: Iterable[str] = ()) -> set[str]:
        """Of the finished requests a save was planned for, those whose save copies have
        all landed (and been committed, unless waiting on loads' outcomes or given up):
        the engine may now free their blocks. Every request named is reported once."""
        self._take_reserve()              # its requests' blocks are busy until copied
        for req_id in finished_req_ids:
            if req_id in self._saving:
                self._saving.discard(req_id)
                self._finishing.add(req_id)
        if not self._finishing:
            return set()
        self._poll_saves()
        done = self._finishing - self._saves.busy() - self._puts.busy()
        self._finishing -= done
        return done

    def take_stats(self) -> WorkerStats:
        """Counters since the last call."""
        stats, self._stats = self._stats, WorkerStats()
        return stats

    def take_failed_recving(self) -> set[str]:
        """Requests whose async load failed since the last call."""
        failed, self._failed_recving = self._failed_recving, set()
        return failed

    def load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def close(self) -> None:
        self._drop_unfinished_reserve()
        self._reserving.close()
        self._remote.close()                       # stops receives still running
        for load in [*self._loads, *self._async.values()]:
            with contextlib.suppress(RemoteLoadFailed):   # stopped above: nothing to report
                load.handle.synchronize()
            load.release()
        self._loads.clear()
        self._async.clear()
        # Copies still running land first: a slot is never given back under a copy.
        self._saves.land_all(lambda save: save.handle.synchronize() if save.handle
                             else self.transfer.finish_save(wait=True))
        # Loads' outcomes not known now never come: those saves are dropped.
        self._finish_saves(self._saves.settle(self._outcomes, give_up=True))
        try:
            self._count_puts(self._puts.done(wait=True))     # each bounded by its timeout
        finally:
            self._puts.close()
        if self._shared_store is not None:
            return                # the owner closes it after every worker that uses it
        self._mappings.close()
        self.breaker.close()
        self.client.close()
