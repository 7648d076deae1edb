"""A toy vLLM 0.33 KV connector that claims a fixed prefix hit and "loads" it a step later.

It moves no bytes. It exists to prove the harness: that vLLM's real scheduler walks a
request through WAITING -> WAITING_FOR_REMOTE_KVS -> RUNNING on the strength of a
connector's answers, and that the worker-role instance built by vLLM's factory receives
the metadata the scheduler-role instance built. Both roles record what they were told,
so tests can assert on the calls.

Loaded by vLLM through ``kv_connector_module_path="toy_connector"`` (tests/vllm is on
``sys.path`` under pytest). ``kv_connector_extra_config`` keys:

    hit_tokens      tokens the "store" holds for every prompt (default 32); the claim is
                    capped one token short of the prompt and is 0 when the engine
                    already has that many locally
    async_load      claim the hit as an asynchronous load (default True)
    defer_lookups   answer ``None`` ("ask again later") this many times per request
                    before answering (default 0)
    load_steps      worker steps between ``start_load_kv`` taking a load and
                    ``get_finished`` reporting it (default 1: the next step)
    fail_load       report every loaded block as failed (default False)
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["AllocCall", "ToyConnector", "ToyMetadata"]


@dataclass(frozen=True, slots=True)
class AllocCall:
    """One ``update_state_after_alloc`` call, as the scheduler made it."""

    req_id: str
    block_ids: tuple[int, ...]  # all of the request's blocks (group 0) at the call
    num_external_tokens: int


@dataclass
class ToyMetadata(KVConnectorMetadata):
    """What the scheduler half hands the worker half for one step."""

    loads: dict[str, list[int]] = field(default_factory=dict)  # req id -> block ids
    new_req_ids: list[str] = field(default_factory=list)
    cached_req_ids: list[str] = field(default_factory=list)
    step: int = 0


class ToyConnector(KVConnectorBase_V1):
    """Both halves of the toy connector; ``role`` says which one this instance is."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.hit_tokens = int(extra.get("hit_tokens", 32))
        self.async_load = bool(extra.get("async_load", True))
        self.defer_lookups = int(extra.get("defer_lookups", 0))
        self.load_steps = int(extra.get("load_steps", 1))
        self.fail_load = bool(extra.get("fail_load", False))
        self.block_size = vllm_config.cache_config.block_size

        # Scheduler half.
        self.lookups: list[tuple[str, int]] = []  # (req id, num_computed_tokens)
        self.alloc_calls: list[AllocCall] = []
        self.finished: list[tuple[str, list[int]]] = []  # request_finished calls
        self.built: list[ToyMetadata] = []
        self._defers_left: defaultdict[str, int] = defaultdict(
            lambda: self.defer_lookups
        )
        self._pending_loads: dict[str, list[int]] = {}
        # req id -> local hit at its last lookup
        self._local_tokens: dict[str, int] = {}
        # req id -> blocks of its load in flight
        self._loading: dict[str, set[int]] = {}
        # Requests whose load failed. vLLM's "recompute" policy sends such a request
        # back through get_num_new_matched_tokens; claiming the hit again would loop.
        self.failed_req_ids: set[str] = set()

        # Worker half.
        self.calls: list[str] = []  # every worker call, in order
        self.bound: list[ToyMetadata] = []
        self.kv_caches: dict[str, torch.Tensor] = {}
        # req id -> (get_finished calls left before reporting, block ids)
        self._loads_in_flight: dict[str, tuple[int, list[int]]] = {}
        self._failed_blocks: set[int] = set()

    # ---- scheduler half ------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self.lookups.append((request.request_id, num_computed_tokens))
        self._local_tokens[request.request_id] = num_computed_tokens
        if request.request_id in self.failed_req_ids:
            return 0, False
        if self._defers_left[request.request_id] > 0:
            self._defers_left[request.request_id] -= 1
            return None, False
        # Never claim the last prompt token: vLLM must compute one to sample.
        claimable = min(self.hit_tokens, request.num_tokens - 1)
        hit = max(0, claimable - num_computed_tokens)
        return hit, self.async_load and hit > 0

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        (block_ids,) = blocks.get_block_ids()
        self.alloc_calls.append(
            AllocCall(request.request_id, tuple(block_ids), num_external_tokens)
        )
        if num_external_tokens > 0:
            # The external tokens follow the locally cached ones, which only the
            # lookup was told about (request.num_computed_tokens is still 0 here).
            local = self._local_tokens[request.request_id]
            first = local // self.block_size
            end = -(-(local + num_external_tokens) // self.block_size)
            self._pending_loads[request.request_id] = list(block_ids[first:end])
            self._loading[request.request_id] = set(block_ids[first:end])

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ToyMetadata:
        cached = scheduler_output.scheduled_cached_reqs
        meta = ToyMetadata(
            loads=self._pending_loads,
            new_req_ids=[r.req_id for r in scheduler_output.scheduled_new_reqs],
            cached_req_ids=list(cached.req_ids),
            step=len(self.built),
        )
        self._pending_loads = {}
        self.built.append(meta)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        # Called after vLLM has handled invalid_block_ids for this step.
        for req_id in connector_output.finished_recving or ():
            blocks = self._loading.pop(req_id, set())
            if blocks & connector_output.invalid_block_ids:
                self.failed_req_ids.add(req_id)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.finished.append((request.request_id, list(block_ids)))
        return False, None

    # ---- worker half ---------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.calls.append("register_kv_caches")
        self.kv_caches = dict(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self.calls.append("handle_preemptions")

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self.calls.append("bind_connector_metadata")
        assert isinstance(connector_metadata, ToyMetadata)
        self.bound.append(connector_metadata)
        super().bind_connector_metadata(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.calls.append("start_load_kv")
        meta = self._get_connector_metadata()
        assert isinstance(meta, ToyMetadata)
        for req_id, block_ids in meta.loads.items():
            self._loads_in_flight[req_id] = (self.load_steps, block_ids)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.calls.append(f"wait_for_layer_load:{layer_name}")

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: Any,
        **kwargs: Any,
    ) -> None:
        self.calls.append(f"save_kv_layer:{layer_name}")

    def wait_for_save(self) -> None:
        self.calls.append("wait_for_save")

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        self.calls.append("get_finished")
        done: set[str] = set()
        for req_id, (steps_left, block_ids) in list(self._loads_in_flight.items()):
            if steps_left <= 0:
                done.add(req_id)
                del self._loads_in_flight[req_id]
                if self.fail_load:
                    self._failed_blocks.update(block_ids)
            else:
                self._loads_in_flight[req_id] = (steps_left - 1, block_ids)
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        self.calls.append("get_block_ids_with_load_errors")
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def clear_connector_metadata(self) -> None:
        self.calls.append("clear_connector_metadata")
        super().clear_connector_metadata()
