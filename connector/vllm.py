"""vLLM adapter: `KVStoreConnector`, a KVConnectorBase_V1 for vLLM 0.33.

    vllm serve MODEL --kv-transfer-config '{"kv_connector":"KVStoreConnector",
        "kv_connector_module_path":"kvstore_connector.vllm","kv_role":"kv_both",
        "kv_load_failure_policy":"recompute",
        "kv_connector_extra_config":{"server":"127.0.0.1:50051"}}'

`kv_connector_extra_config` takes every field of connector.config.ConnectorConfig;
`kv_role` is honoured (a producer only saves, a consumer only loads). This module only
translates vLLM's objects into the engine-agnostic halves (connector.scheduler,
connector.worker); it imports only when vLLM is installed.

Hybrid models: the connector is `SupportsHMA`, so vLLM keeps its hybrid KV cache manager on
(one block table per KV-cache group). Each group is a layout of its own and has a worker
half of its own (connector.groups, connector.worker.groupworkers); a model of one group keeps the
layouts, keys and behaviour it had before. Mamba / linear-attention state in align mode
is a group of its own whose pages are state blocks (connector.scheduler.mamba). Specs the connector
cannot move correctly (Mamba state in other modes, cross-attention, ...) stop the engine
at start-up with one line.

Over 400 lines because vLLM's interface is one class of about 25 methods, most a short
translation onto the halves, and its state (the saves and retains waiting on a request's
finish, the event groups) reads best in one place. How vLLM's config becomes layouts (the
functions above the class: about 75 lines) is a second idea and the next split, beside
connector.groups, which reads vLLM's cache config the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvstore_client import PageLayout

from .config import ConnectorConfig, LoadMode, open_client
from .events import EventFeed, Removed, SavedRun, Stored
from .groups import CacheGroup, GroupKind, UnsupportedCache, cache_groups
from .kvviews import detect_kind, kv5
from .meta import StepMeta
from .revision import resolve
from .scheduler.half import SchedulerHalf
from .scheduler.mamba import StateCheckpoints, mamba_view
from .scheduler.retention import RetainAsk, Retainer, ask_of
from .worker.groupworkers import GroupWorkers
from .worker.half import SharedStore, WorkerHalf

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVStoreConnector", "KVStoreConnectorMetadata", "KVStoreConnectorStats"]

log = logging.getLogger(__name__)


class KVStoreConnectorMetadata(KVConnectorMetadata):
    """One step's plan (connector.meta.StepMeta), sent from the scheduler to workers."""

    def __init__(self, step: StepMeta) -> None:
        self.step = step


class KVStoreConnectorStats(KVConnectorStats):
    """Counters from the workers: pages and bytes loaded and saved, failed loads."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


def _dtype_name(vllm_config: VllmConfig) -> str:
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype and cache_dtype != "auto":
        return {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
                "fp8_e5m2": "float8_e5m2"}.get(cache_dtype, cache_dtype)
    return str(vllm_config.model_config.dtype).removeprefix("torch.")


def _layouts(vllm_config: VllmConfig, config: ConnectorConfig,
             page_tokens: int, revision: str) -> tuple[list[PageLayout], bool]:
    """Every tensor-parallel rank's layout, and whether the model uses MLA."""
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    mla = bool(getattr(model_config, "use_mla", False))
    common = dict(
        model=config.model or model_config.model,
        num_layers=model_config.get_num_layers(parallel),
        page_tokens=page_tokens,
        head_size=model_config.get_head_size(),
        dtype=_dtype_name(vllm_config),
        pp_rank=getattr(parallel, "rank", 0) // max(parallel.tensor_parallel_size, 1)
        if parallel.pipeline_parallel_size > 1 else 0,
        salt=config.salt,
        revision=revision,
    )
    if mla:
        # MLA's latent KV is the same on every TP rank: one layout, loaded by all.
        return [PageLayout(num_kv_heads=1, kv_factor=1, **common)], True
    tp = parallel.tensor_parallel_size
    heads = model_config.get_num_kv_heads(parallel)
    return [PageLayout(num_kv_heads=heads, tp_rank=r, tp_size=tp, **common)
            for r in range(tp)], False


def _group_layouts(vllm_config: VllmConfig, config: ConnectorConfig, page_tokens: int,
                   groups: list[CacheGroup], revision: str = ""
                   ) -> tuple[list[list[PageLayout]], bool]:
    """Every group's layouts (one per rank), and whether the model uses MLA. A model of
    one group keeps the layouts it always had; each group of a hybrid model is its own
    layout: its layers, heads and head size, its scope folded into the salt."""
    if len(groups) == 1:
        layouts, mla = _layouts(vllm_config, config, page_tokens, revision)
        return [layouts], mla
    parallel = vllm_config.parallel_config
    tp = parallel.tensor_parallel_size
    mla = groups[0].mla
    out = []
    for group in groups:
        # A Mamba state page is one block's bytes per layer: one "token" of them.
        state = group.kind is GroupKind.MAMBA
        base = PageLayout(
            model=config.model or vllm_config.model_config.model,
            num_layers=len(group.layer_names), page_tokens=1 if state else page_tokens,
            num_kv_heads=group.num_kv_heads,
            head_size=group.state_bytes if state else group.head_size,
            dtype=group.dtype, kv_factor=1 if mla or state else 2,
            pp_rank=getattr(parallel, "rank", 0) // max(tp, 1)
            if parallel.pipeline_parallel_size > 1 else 0,
            salt=f"{config.salt}#{group.scope}", revision=revision)
        out.append([base] if mla else [dataclasses.replace(base, tp_rank=r, tp_size=tp)
                                       for r in range(tp)])
    return out, mla


def _checkpoints(vllm_config: VllmConfig, block_size: int) -> StateCheckpoints | None:
    """Where vLLM writes a Mamba prefill checkpoint; None where its hits are finer than
    a block (the checkpoint may then lie inside one: never saved as a boundary state)."""
    cache = vllm_config.cache_config
    alignment = getattr(cache, "cache_hit_alignment_tokens", None) or block_size
    hashed = getattr(cache, "hash_block_size", None) or block_size
    if alignment != block_size or hashed != block_size:
        return None
    return StateCheckpoints(alignment, int(getattr(vllm_config, "num_hash_lookahead_tokens",
                                                   0) or 0))


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        return get_tensor_model_parallel_rank()
    except (ImportError, AssertionError, AttributeError, RuntimeError):
        return 0    # not initialised: a single process (tests, CPU harness)


def _block_extra_keys(request: Request, block_size: int, start: int,
                      end: int) -> list[tuple[Any, ...] | None]:
    """vLLM's extra keys of the request's blocks [start, end), one entry a block, as its
    block hasher made them (not the lookahead window of a hash_lookahead engine)."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys
    out: list[tuple[Any, ...] | None] = []
    mm = 0
    for block in range(start, end):
        keys, mm = generate_block_hash_extra_keys(request, block * block_size,
                                                  (block + 1) * block_size, mm)
        out.append(keys)
    return out


def _warn_on_fail_policy(transfer: Any) -> None:
    """Say at start, loudly, that vLLM will fail requests whose load from the store fails.

    vLLM's kv_load_failure_policy defaults to "fail": a load the connector reports failed
    (the store restarted, timed out or lost the pages) then ends its request with an error
    instead of recomputing the blocks, so a store fault becomes a failed request (HTTP 500
    from `vllm serve`). "recompute" is what makes the store a cache. Only a connector that
    loads (kv_both, kv_consumer) is concerned.
    """
    policy = getattr(transfer, "kv_load_failure_policy", None)
    if policy == "fail" and transfer.kv_role != "kv_producer":
        log.warning('kvstore connector: kv_load_failure_policy is "fail": a load from the '
                    "store that fails (a store restart, a timeout) fails its request with "
                    "an error instead of recomputing it; add "
                    '"kv_load_failure_policy":"recompute" to --kv-transfer-config')


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """kvstore as vLLM's KV connector: prefix hits from the store, layer-wise loads."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        self.config = ConnectorConfig.from_mapping(
            dict(transfer.kv_connector_extra_config or {}), role=transfer.kv_role)
        if (vllm_config.max_concurrent_batches > 1
                and self.config.load_mode is LoadMode.LAYERWISE):
            # With batches in flight (AsyncScheduler, pipeline parallelism) the next step
            # is planned over a layer-wise load before anyone knows it failed, and vLLM
            # 0.33 then accepts that step's token and restarts a request sharing the
            # failed blocks at the wrong point (docs/vllm-load-failure-sharing.md): wrong
            # KV in accepted steps. An async load is never computed over before it has
            # landed, and its blocks are not shared until then, so it is safe.
            log.warning("kvstore connector: %d batches in flight, so loads run async "
                        "(WAITING_FOR_REMOTE_KVS) instead of layer-wise",
                        vllm_config.max_concurrent_batches)
            self.config = dataclasses.replace(self.config, load_mode=LoadMode.ASYNC)
        self.block_size = vllm_config.cache_config.block_size
        page_tokens = self.config.page_tokens or self.block_size
        # Refused here, at start-up, with one line: a spec the connector cannot move.
        self.groups = cache_groups(kv_cache_config)
        self.hybrid = len(self.groups) > 1
        if any(g.kind is GroupKind.MAMBA for g in self.groups) and page_tokens != self.block_size:
            raise UnsupportedCache(
                f"kvstore connector: with Mamba state a page is one block: page_tokens "
                f"{page_tokens} must equal the block size {self.block_size}")
        if self.hybrid and self.config.load_mode is LoadMode.LAYERWISE:
            # vLLM 0.33 takes block-level load failures (invalid_block_ids) from one
            # group only (block ids repeat across groups): a hybrid engine hears of a
            # failed load per request (failed_recving), and only of a request that waits
            # for it (WAITING_FOR_REMOTE_KVS). A layer-wise load that failed could not be
            # reported at all, so a hybrid model's loads run async.
            log.info("kvstore connector: %d KV-cache groups, so loads run async "
                     "(WAITING_FOR_REMOTE_KVS): vLLM hears of a failed load only per "
                     "request", len(self.groups))
            self.config = dataclasses.replace(self.config, load_mode=LoadMode.ASYNC)
        # The weights' revision scopes every layout (connector.revision).
        model_config = vllm_config.model_config
        self.revision = resolve(self.config.model_revision, model_config.revision,
                                model_config.model, "vLLM")
        self.group_layouts, self.mla = _group_layouts(vllm_config, self.config, page_tokens,
                                                      self.groups, self.revision.value)
        # Group 0's layouts first: the scheduler's key chain starts from its seed (the
        # first attention group's, where group 0 is Mamba state).
        self.layouts = [layout for layouts in self.group_layouts for layout in layouts]
        self.page_tokens = page_tokens
        self._scheduler: SchedulerHalf | None = None
        self.retainer: Retainer | None = None
        self.events: EventFeed | None = None
        self._event_groups: list[int] = []          # the engine's groups events name
        self._events_after_save: dict[str, SavedRun] = {}
        self._retain_after_save: dict[str, tuple[RetainAsk, list[bytes]]] = {}
        self._worker: GroupWorkers | None = None
        self._requests: dict[str, Request] = {}     # live scheduler objects
        # Requests a save was planned for: their blocks outlive them until the workers
        # report the save copies landed (finished_sending), as saves are asynchronous.
        self._saving: set[str] = set()
        if role == KVConnectorRole.SCHEDULER:
            _warn_on_fail_policy(transfer)
            # A step's outcome comes back max_concurrent_batches builds later (2 under
            # AsyncScheduler): until then its loads count as unconfirmed.
            self._scheduler = SchedulerHalf(self.config, self.layouts, self.block_size,
                                            lag=vllm_config.max_concurrent_batches,
                                            groups=self.groups,
                                            checkpoints=_checkpoints(vllm_config,
                                                                     self.block_size))
            # Session retention asked in kv_transfer_params (connector.scheduler.retention): sent
            # once a request's saves have landed, off the loop.
            self.retainer = Retainer(self._scheduler.store, self._scheduler.gate)
            self.events = self._event_feed(vllm_config)
        log.info("kvstore connector (%s) for %s: server %s, %d-token pages, %s loads, "
                 "KV-cache groups: %s", role.name.lower(), self.layouts[0].model,
                 self.config.server, page_tokens, self.config.load_mode.value,
                 ", ".join(f"{g.kind.value}x{len(g.layer_names)}" for g in self.groups))

    def _event_feed(self, vllm_config: VllmConfig) -> EventFeed | None:
        """The store's side of the engine's KV-event stream (connector.events), while
        the engine publishes one: the full-attention groups' layouts (a hit's reach)."""
        events = vllm_config.kv_events_config
        if not self.config.events or events is None or not events.enable_kv_cache_events:
            return None
        self._event_groups = [g.index for g in self.groups if g.kind is GroupKind.FULL] or [0]
        layouts = [lay for g in self._event_groups for lay in self.group_layouts[g]]
        log.info("kvstore connector: pages the store holds are announced on the KV-event "
                 "stream as medium %s, polled every %.2f s", self.config.events_medium,
                 self.config.events_interval)
        # A client of its own: its calls never queue behind the loop's lookups.
        return EventFeed(open_client(self.config, self.config.timeout, retries=0,
                                     shared_memory=False), layouts,
                         interval=self.config.events_interval, gate=self._sched.gate)

    def take_events(self) -> list[KVCacheEvent]:
        """Store events since the last call (vLLM publishes them with its own)."""
        if self.events is None:
            return []
        from vllm.distributed.kv_events import BlockRemoved, BlockStored
        from vllm.v1.core.kv_cache_utils import (
            maybe_convert_block_hash as export,
            to_event_extra_keys,
        )
        out: list[KVCacheEvent] = []
        medium = self.config.events_medium
        for event in self.events.take():
            for group in self._event_groups:
                if isinstance(event, Stored):
                    out.append(BlockStored(
                        block_hashes=[export(h) for h in event.hashes],
                        parent_block_hash=None if event.parent is None else export(event.parent),
                        token_ids=list(event.tokens), block_size=self.block_size,
                        lora_id=None, medium=medium, lora_name=event.lora_name,
                        extra_keys=None if event.extra_keys is None
                        else to_event_extra_keys(event.extra_keys),
                        group_idx=group))
                elif isinstance(event, Removed):
                    out.append(BlockRemoved(block_hashes=[export(h) for h in event.hashes],
                                            medium=medium, group_idx=group))
        return out

    def _saved_run(self, request: Request, keys: list[bytes]) -> SavedRun | None:
        """The request's pages in the store (keys: stored_keys'), with its block hashes,
        for the events."""
        if not keys:
            return None
        lora = request.lora_request
        # What besides tokens vLLM's block hashes cover, as its own BlockStored says it:
        # worked out on the event thread, for the blocks announced, and only for the
        # requests that have any (nothing more on the loop for the others).
        extra = None
        if (request.mm_features or request.cache_salt or lora is not None
                or getattr(request, "prompt_embeds", None) is not None):
            extra = functools.partial(_block_extra_keys, request, self.block_size)
        # Its token ids as the int32 array its keys were hashed from, not vLLM's list:
        # the GC does not walk it while the run waits for the feed's poll. Its block
        # hashes are vLLM's own list, not a copy: it has finished, vLLM changes them no
        # more (the feed joins them).
        return SavedRun(keys, request.block_hashes,
                        self._sched.stored_tokens(request.request_id),
                        self.page_tokens // self.block_size, self.page_tokens,
                        lora.name if lora is not None else None, extra)

    @property
    def scheduler_half(self) -> SchedulerHalf | None:
        """The scheduler half; None on a worker-role connector."""
        return self._scheduler

    @property
    def group_workers(self) -> GroupWorkers | None:
        """The worker halves of the engine's cache groups; None until KV caches register."""
        return self._worker

    # -- scheduler side -------------------------------------------------------------------
    @property
    def _sched(self) -> SchedulerHalf:
        if self._scheduler is None:
            raise RuntimeError("a scheduler-side call on a worker-role connector")
        return self._scheduler

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        self._requests[request.request_id] = request
        hit = self._sched.hit(request.request_id, request.all_token_ids,
                                  num_computed_tokens)
        if hit is None:
            return None, False
        return hit, hit > 0 and self.config.load_mode is LoadMode.ASYNC

    def update_state_after_alloc(self, request: Request, blocks: Any,
                                 num_external_tokens: int) -> None:
        self._sched.allocated(request.request_id, self._blocks(blocks.get_block_ids()),
                              num_external_tokens)

    def _blocks(self, per_group):
        """vLLM's block ids (one list per group) as the scheduler half takes them."""
        return per_group[0] if len(self.groups) == 1 else per_group

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        sched = self._sched
        counts = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            request = self._requests.get(new.req_id)
            tokens = request.all_token_ids if request is not None else new.prompt_token_ids
            sched.scheduled(new.req_id, tokens, new.num_computed_tokens,
                            counts.get(new.req_id, 0), block_ids=self._blocks(new.block_ids),
                            prompt_len=len(new.prompt_token_ids or tokens))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            request = self._requests.get(req_id)
            if request is None:
                continue
            new_blocks = cached.new_block_ids[i]
            blocks = ([list(b) for b in new_blocks] if new_blocks is not None
                      else [[] for _ in self.groups])
            blocks = self._blocks(blocks)
            resumed = req_id in cached.resumed_req_ids
            sched.scheduled(req_id, request.all_token_ids, cached.num_computed_tokens[i],
                            counts.get(req_id, 0), block_ids=blocks if resumed else None,
                            new_block_ids=() if resumed else blocks,
                            prompt_len=request.num_prompt_tokens)
        step = sched.build()
        self._saving.update(save.req_id for save in step.saves)
        return KVStoreConnectorMetadata(step)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        # Failures first: a failed async load is reported as received too.
        if self.hybrid and connector_output.failed_recving:
            failed = self._sched.load_failed_requests(set(connector_output.failed_recving))
            if failed:
                log.warning("kvstore loads failed for %s: recomputing", failed)
        if connector_output.invalid_block_ids:
            failed = self._sched.load_failed_blocks(set(connector_output.invalid_block_ids))
            if failed:
                log.warning("kvstore loads failed for %s: recomputing", failed)
        for req_id in connector_output.finished_recving or ():
            self._sched.load_finished(req_id)
        if self._retain_after_save and connector_output.finished_sending:
            for req_id in connector_output.finished_sending:
                waiting = self._retain_after_save.pop(req_id, None)
                if waiting is not None and self.retainer is not None:
                    self.retainer.submit(*waiting)
        if self._events_after_save and connector_output.finished_sending:
            for req_id in connector_output.finished_sending:
                run = self._events_after_save.pop(req_id, None)
                if run is not None and self.events is not None:
                    self.events.saved(run)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Saves are asynchronous: the blocks of a request a save was planned for are
        # freed when every worker has reported it in finished_sending (get_finished),
        # once its save copies have landed. The workers track the same plans, so they
        # report exactly these requests.
        self._requests.pop(request.request_id, None)
        delay = request.request_id in self._saving
        retain = self.retainer is not None and bool(request.kv_transfer_params)
        # One list of its stored keys for both, read by their threads only.
        keys = (self._sched.stored_keys(request.request_id)
                if retain or self.events is not None else [])
        if retain:
            self._retain(request, keys, delay)
        if self.events is not None:
            run = self._saved_run(request, keys)
            if run is not None and delay:       # announced once its saves have landed
                self._events_after_save[request.request_id] = run
            elif run is not None:
                self.events.saved(run)
        self._sched.finished(request.request_id)
        self._saving.discard(request.request_id)
        return delay, None

    def _retain(self, request: Request, keys: list[bytes], after_save: bool) -> None:
        """A request's session retention (connector.scheduler.retention) of its stored
        keys: sent now, or once its saves have landed (finished_sending)."""
        if self.retainer is None:
            return
        try:
            ask = ask_of(request.kv_transfer_params)
        except ValueError as exc:
            self.retainer.malformed(request.request_id, exc)
            return
        if ask is None:
            return
        waiting = (ask, keys)
        if after_save:
            self._retain_after_save[request.request_id] = waiting
        else:
            self.retainer.submit(*waiting)

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        # As request_finished: every group's blocks are held until the saves planned
        # for the request have landed in every group's worker (GroupWorkers.sent).
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    @property
    def requires_kv_delivery(self) -> bool:
        return False          # a store is a best-effort cache: a lost save is a miss

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return (extra_config or {}).get("load_mode", "layerwise") == "layerwise"

    # -- worker side ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        saves = not self.mla or _tp_rank() == 0      # MLA: one rank saves for all
        workers = []
        layouts_here = [ls[0] if self.mla else ls[_tp_rank()] for ls in self.group_layouts]
        # A hybrid model's groups share one client, pool mapping and registration
        # (connector.worker.groupworkers); a lone group makes its own, as it always did.
        shared = (SharedStore.open(self.config, layouts_here[0]) if len(self.groups) > 1
                  else None)
        for group, layout in zip(self.groups, layouts_here, strict=True):
            # A lone group takes every layer the engine registers, as it always did.
            names = list(kv_caches) if len(self.groups) == 1 else group.layer_names
            if group.kind is GroupKind.MAMBA:
                views = {name: mamba_view(kv_caches[name], group.state_bytes)
                         for name in names}
            else:
                views = {name: kv5(kv_caches[name], detect_kind(kv_caches[name],
                                                                mla=self.mla))
                         for name in names}
            workers.append(WorkerHalf(self.config, layout, views, saves=saves, shared=shared))
        self._worker = GroupWorkers(self.groups, workers, self.page_tokens, shared)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.bind(connector_metadata.step)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.start_load(self._get_connector_metadata().step)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        received = self._worker.finished()
        sent = self._worker.sent(finished_req_ids)
        return sent or None, received or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # A hybrid model's failed loads go by request (failed_recving); each is also in
        # finished_recving once every group's copies for it have ended.
        sent, received = self.get_finished(finished_req_ids)
        failed = self._worker.failed_recving() if self._worker is not None else set()
        if not self.hybrid:
            failed = set()        # told by block ids (get_block_ids_with_load_errors)
        return KVConnectorTransferResults(finished_sending=set(sent or ()),
                                          finished_recving=set(received or ()),
                                          failed_recving=failed)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is None:
            return None
        stats = KVStoreConnectorStats(data=dataclasses.asdict(self._worker.take_stats()))
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return KVStoreConnectorStats(data=dict(data or {}))

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._worker is None:
            return set()
        errors = self._worker.load_errors()
        return set() if self.hybrid else errors      # hybrid: failed_recving says it

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            if self.retainer is not None:
                self.retainer.close(self.config.timeout + 0.5)
            if self.events is not None:
                self.events.close()
            self._scheduler.close()
