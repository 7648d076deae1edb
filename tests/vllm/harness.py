"""Drive vLLM 0.33's real v1 scheduler and a worker-role KV connector on CPU, with no model.

vLLM's ``GPUModelRunner`` does not run without a GPU, but everything a KV connector talks
to does: the scheduler (``Scheduler``/``AsyncScheduler``), the connector factory and the
forward context. This module builds them from a config-only model folder and plays the
model runner's part itself, making the worker-side calls in the order vLLM makes them
(docs/dev/vllm-0.33-connector-api.md, "The worker side"):

    handle_preemptions -> bind_connector_metadata
      -> start_load_kv                 (here if the step has synchronous loads)
      -> per layer: wait_for_layer_load, the layer writes its KV, save_kv_layer
      -> finish_forward
      -> start_load_kv                 (here otherwise: after the forward is launched)
      -> wait_for_save -> get_transfer_results(finished_req_ids) (wraps get_finished)
      -> get_block_ids_with_load_errors -> stats, events, worker meta
      -> clear_connector_metadata

A step with no scheduled tokens skips the layers (vLLM's ``no_forward``) but still calls
``wait_for_save``. ``start_load_kv`` always runs inside ``set_forward_context``; here its
``attn_metadata`` is ``None``, as in vLLM's no-forward path, so a connector must take
what it loads from its own metadata and registered caches, not from the forward context.

Everything is built per test: no global state besides vLLM's own (``init_none_hash``).
Importing this module needs vLLM; tests guard with ``pytest.importorskip("vllm")``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model folder holds only config.json

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import copy_kv_blocks
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)
from vllm.forward_context import get_forward_context, set_forward_context
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

__all__ = [
    "BLOCK_SIZE",
    "EOS_TOKEN_ID",
    "ConnectorSpec",
    "ModelShape",
    "SchedulerDriver",
    "StepAttentionMetadata",
    "StepResult",
    "WorkerDriver",
    "fill_prompt_kv",
    "make_kv_cache_config",
    "make_request",
    "make_scheduler",
    "make_vllm_config",
    "write_model_dir",
]

BLOCK_SIZE = 16
EOS_TOKEN_ID = 2  # OPT's


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The toy model: a 2-layer OPT, enough for vLLM to derive layers, heads and sizes."""

    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    ffn_dim: int = 128
    vocab_size: int = 50272
    dtype: torch.dtype = torch.float32

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def layer_names(self) -> tuple[str, ...]:
        # The attention layer names vLLM's OPT model registers (and keys kv_caches by).
        return tuple(
            f"model.decoder.layers.{i}.self_attn.attn" for i in range(self.num_layers)
        )


@dataclass(frozen=True, slots=True)
class ConnectorSpec:
    """Which connector vLLM loads, and with what ``--kv-transfer-config``."""

    name: str  # class name, looked up in module_path
    module_path: str | None = None  # None: a connector registered with vLLM's factory
    role: str = "kv_both"  # kv_producer | kv_consumer | kv_both
    extra_config: Mapping[str, Any] = field(default_factory=dict)
    load_failure_policy: str = "fail"  # "fail" | "recompute"

    def to_kv_transfer_config(self) -> KVTransferConfig:
        return KVTransferConfig(
            kv_connector=self.name,
            kv_connector_module_path=self.module_path,
            kv_role=self.role,
            kv_connector_extra_config=dict(self.extra_config),
            kv_load_failure_policy=self.load_failure_policy,
        )


def write_model_dir(directory: Path, shape: ModelShape = ModelShape()) -> Path:
    """Write a config-only OPT model folder (no weights, no tokenizer) and return it."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["OPTForCausalLM"],
        "model_type": "opt",
        "hidden_size": shape.hidden_size,
        "word_embed_proj_dim": shape.hidden_size,
        "num_attention_heads": shape.num_heads,
        "num_hidden_layers": shape.num_layers,
        "ffn_dim": shape.ffn_dim,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": 2048,
        "do_layer_norm_before": True,
        "activation_function": "relu",
        "bos_token_id": 2,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": 1,
        "torch_dtype": str(shape.dtype).removeprefix("torch."),
    }
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


def make_vllm_config(
    model_dir: Path,
    connector: ConnectorSpec,
    *,
    async_scheduling: bool = False,
    block_size: int = BLOCK_SIZE,
    max_num_batched_tokens: int = 512,
    max_num_seqs: int = 16,
    max_model_len: int = 2048,
    enable_prefix_caching: bool = True,
) -> VllmConfig:
    """A CPU ``VllmConfig`` for the model folder, with the connector configured.

    ``async_scheduling`` picks ``AsyncScheduler`` (vLLM's default when the executor
    supports it) over ``Scheduler``; it also makes ``max_concurrent_batches`` 2, which
    turns on deferred block freeing for consumer roles.
    """
    model_config = ModelConfig(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        max_model_len=max_model_len,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=async_scheduling,
    )
    cache_config = CacheConfig(
        block_size=block_size, enable_prefix_caching=enable_prefix_caching
    )
    return VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        kv_transfer_config=connector.to_kv_transfer_config(),
        device_config=DeviceConfig("cpu"),
    )


def make_kv_cache_config(
    vllm_config: VllmConfig, num_blocks: int = 256, shape: ModelShape = ModelShape()
) -> KVCacheConfig:
    """One full-attention group over all layers, as vLLM builds it for a plain decoder."""
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(
        block_size=vllm_config.cache_config.block_size,
        num_kv_heads=shape.num_heads,
        head_size=shape.head_size,
        dtype=shape.dtype,
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(list(shape.layer_names), spec)],
    )


def make_scheduler(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> Scheduler:
    """vLLM's real scheduler (``AsyncScheduler`` when async scheduling is on)."""
    cls = AsyncScheduler if vllm_config.scheduler_config.async_scheduling else Scheduler
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=vllm_config.cache_config.block_size,
        log_stats=True,
    )


_none_hash_ready = False


def make_request(
    request_id: str,
    prompt_token_ids: list[int],
    *,
    max_tokens: int = 8,
    block_size: int = BLOCK_SIZE,
    kv_transfer_params: dict[str, Any] | None = None,
) -> Request:
    """A ``Request`` with vLLM's block hasher (sha256), as the engine core builds it."""
    global _none_hash_ready
    if not _none_hash_ready:
        init_none_hash(sha256)  # vLLM's own once-per-process seed; idempotent
        _none_hash_ready = True
    params = SamplingParams(max_tokens=max_tokens)
    params.update_from_generation_config({}, EOS_TOKEN_ID)
    request = Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )
    request.kv_transfer_params = kv_transfer_params
    return request


@dataclass(frozen=True, slots=True)
class StepAttentionMetadata:
    """Stand-in for a backend's attention metadata, handed to ``save_kv_layer``.

    vLLM passes the attention backend's metadata object (e.g. FlashAttentionMetadata),
    whose type depends on the backend. Its ``slot_mapping`` (block * block_size + offset
    of each scheduled token, in batch order) is the field connectors commonly read.
    """

    slot_mapping: torch.Tensor  # int64 [num_scheduled_tokens]
    num_actual_tokens: int


# layer name, the layer's paged cache [B, H, N, C], token slots written this step:
# (req id, position, block id, offset, token id or -1 for a generated token)
LayerWriter = Callable[[str, torch.Tensor, list[tuple[str, int, int, int, int]]], None]


def fill_prompt_kv(
    layer_name: str, kv_layer: torch.Tensor, slots: list[tuple[str, int, int, int, int]]
) -> None:
    """Write a deterministic K||V for each slot: a function of (layer, position, token).

    Equal prefixes get equal KV in every request, so a connector that stores and loads
    pages can be checked for exactness against what the "model" wrote.
    """
    layer_index = int(layer_name.split(".")[3])
    heads, content = kv_layer.shape[1], kv_layer.shape[3]
    for _, position, block, offset, token in slots:
        base = (layer_index + 1) * 1e6 + position * 1e3 + (token % 997)
        kv_layer[block, :, offset, :] = (
            base
            + torch.arange(heads * content).view(heads, content).to(kv_layer.dtype)
            / 1e3
        )


@dataclass
class _ReqState:
    """What a model runner keeps per request: its block table and known tokens."""

    block_ids: list[int]
    token_ids: list[int]  # prompt tokens; generated ones are unknown here (-1)


class WorkerDriver:
    """Plays vLLM's model runner for a worker-role connector built by vLLM's factory.

    The KV caches are CPU tensors in vLLM 0.33's per-layer view ``[B, H, N, C]``
    (blocks, KV heads, tokens per block, K then V: C = 2 * head_size), stored in the
    default ``LBNHC`` layout: each block is ``[N, H, C]`` contiguous, and each layer
    its own tensor.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        shape: ModelShape = ModelShape(),
        writer: LayerWriter | None = fill_prompt_kv,
    ) -> None:
        self.vllm_config = vllm_config
        self.shape = shape
        self.block_size = vllm_config.cache_config.block_size
        self.writer = writer
        connector = KVConnectorFactory.create_connector(
            vllm_config, KVConnectorRole.WORKER, kv_cache_config
        )
        assert isinstance(connector, KVConnectorBase_V1)
        self.connector: KVConnectorBase_V1 = connector
        self.kv_caches = {
            name: torch.zeros(
                kv_cache_config.num_blocks,
                self.block_size,
                shape.num_heads,
                2 * shape.head_size,
                dtype=shape.dtype,
            ).permute(0, 2, 1, 3)  # physical [B, N, H, C] viewed as [B, H, N, C]
            for name in shape.layer_names
        }
        # As GPUModelRunner.initialize_kv_cache does after allocating the caches.
        self.connector.register_kv_caches(self.kv_caches)
        self.connector.set_host_xfer_buffer_ops(copy_kv_blocks)
        self._requests: dict[str, _ReqState] = {}

    def step(self, scheduler_output: SchedulerOutput) -> KVConnectorOutput:
        """Run one step's connector calls in the model runner's order."""
        self._update_states(scheduler_output)
        connector = self.connector
        meta = scheduler_output.kv_connector_metadata
        assert meta is not None, "the scheduler builds metadata every step"
        connector.handle_preemptions(meta)
        connector.bind_connector_metadata(meta)
        # As MRV2 (vllm/v1/worker/gpu/kv_connector.py): sync loads start before the
        # forward, async ones after it, each inside a forward context.
        sync_loads = scheduler_output.has_sync_kv_loads
        with set_forward_context(None, self.vllm_config):
            if sync_loads:
                connector.start_load_kv(get_forward_context())
            if scheduler_output.total_num_scheduled_tokens > 0:
                self._forward(scheduler_output)
        connector.finish_forward()
        if not sync_loads:
            with set_forward_context(None, self.vllm_config):
                connector.start_load_kv(get_forward_context())
        connector.wait_for_save()
        results = connector.get_transfer_results(scheduler_output.finished_req_ids)
        output = KVConnectorOutput(
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            failed_recving=results.failed_recving,
            invalid_block_ids=connector.get_block_ids_with_load_errors(),
            kv_connector_stats=connector.get_kv_connector_stats(),
            kv_cache_events=connector.get_kv_connector_kv_cache_events(),
            kv_connector_worker_meta=connector.build_connector_worker_meta(),
        )
        connector.clear_connector_metadata()
        return output

    def _forward(self, scheduler_output: SchedulerOutput) -> None:
        slots = self._scheduled_slots(scheduler_output)
        attn_metadata = StepAttentionMetadata(
            slot_mapping=torch.tensor(
                [block * self.block_size + offset for _, _, block, offset, _ in slots],
                dtype=torch.int64,
            ),
            num_actual_tokens=len(slots),
        )
        for name in self.shape.layer_names:
            self.connector.wait_for_layer_load(name)
            if self.writer is not None:
                self.writer(name, self.kv_caches[name], slots)
            self.connector.save_kv_layer(name, self.kv_caches[name], attn_metadata)

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self._requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self._requests[new.req_id] = _ReqState(
                block_ids=list(new.block_ids[0]),
                token_ids=list(new.prompt_token_ids or []),
            )
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks in zip(cached.req_ids, cached.new_block_ids):
            state = self._requests[req_id]
            blocks = list(new_blocks[0]) if new_blocks is not None else []
            if req_id in cached.resumed_req_ids:
                state.block_ids = blocks
            else:
                state.block_ids.extend(blocks)

    def _scheduled_slots(
        self, so: SchedulerOutput
    ) -> list[tuple[str, int, int, int, int]]:
        computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        slots = []
        for req_id, count in so.num_scheduled_tokens.items():
            state = self._requests[req_id]
            for position in range(computed[req_id], computed[req_id] + count):
                block = state.block_ids[position // self.block_size]
                token = (
                    state.token_ids[position] if position < len(state.token_ids) else -1
                )
                slots.append(
                    (req_id, position, block, position % self.block_size, token)
                )
        return slots


@dataclass(frozen=True, slots=True)
class StepResult:
    """One engine step: what was scheduled, what the worker reported, what came out."""

    scheduler_output: SchedulerOutput
    kv_connector_output: KVConnectorOutput | None
    engine_outputs: dict[int, EngineCoreOutputs]


class SchedulerDriver:
    """Steps a real vLLM scheduler: schedule -> (worker) -> ModelRunnerOutput -> update.

    ``step`` runs one step to completion. For async-scheduling overlap, call
    ``schedule`` twice before ``finish`` as the engine core's batch queue does.
    """

    def __init__(
        self, scheduler: Scheduler, worker: WorkerDriver | None = None
    ) -> None:
        self.scheduler = scheduler
        self.worker = worker

    @property
    def connector(self) -> KVConnectorBase_V1:
        """The scheduler-role connector vLLM built."""
        connector = self.scheduler.get_kv_connector()
        assert connector is not None
        return connector

    def add(self, *requests: Request) -> None:
        for request in requests:
            self.scheduler.add_request(request)

    def status(self, req_id: str) -> RequestStatus:
        return self.scheduler.requests[req_id].status

    def request(self, req_id: str) -> Request:
        return self.scheduler.requests[req_id]

    def schedule(self) -> SchedulerOutput:
        return self.scheduler.schedule()

    def finish(
        self,
        scheduler_output: SchedulerOutput,
        *,
        finished_sending: Iterable[str] = (),
        finished_recving: Iterable[str] = (),
        invalid_block_ids: Iterable[int] = (),
        failed_recving: Iterable[str] = (),
        token_id: int = 100,
        eos_for: Iterable[str] = (),
    ) -> StepResult:
        """Run the worker (if any), merge injected connector results, update the scheduler.

        Every request whose prefill completes this step samples ``token_id`` (or EOS for
        the ids in ``eos_for``); partial prefill chunks sample nothing, as in vLLM.
        """
        kv_output = (
            self.worker.step(scheduler_output) if self.worker is not None else None
        )
        injected = KVConnectorOutput(
            finished_sending=set(finished_sending) or None,
            finished_recving=set(finished_recving) or None,
            invalid_block_ids=set(invalid_block_ids),
            failed_recving=set(failed_recving),
        )
        kv_output = _merge(kv_output, injected)
        eos = set(eos_for)
        req_ids = list(scheduler_output.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = self.scheduler.requests.get(req_id)
            done_prefill = request is not None and not request.is_prefill_chunk
            sampled.append(
                [EOS_TOKEN_ID if req_id in eos else token_id] if done_prefill else []
            )
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_output,
        )
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        return StepResult(scheduler_output, kv_output, outputs)

    def step(self, **finish_kwargs: Any) -> StepResult:
        return self.finish(self.schedule(), **finish_kwargs)


def _merge(
    worker: KVConnectorOutput | None, injected: KVConnectorOutput
) -> KVConnectorOutput | None:
    if worker is None:
        return None if injected.is_empty() else injected
    worker.finished_sending = (worker.finished_sending or set()) | (
        injected.finished_sending or set()
    ) or None
    worker.finished_recving = (worker.finished_recving or set()) | (
        injected.finished_recving or set()
    ) or None
    worker.invalid_block_ids |= injected.invalid_block_ids
    worker.failed_recving |= injected.failed_recving
    return worker
