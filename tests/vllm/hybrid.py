"""Hybrid models for the vLLM harness: KV-cache groups built as vLLM builds them.

A model here is a list of layer kinds (full, sliding, mla, sliding_mla, draft, mamba:
Mamba state in vLLM's "align" cache mode, with a prefill checkpoint as vLLM's Mamba2 and
GDN layers ask for). vLLM's own
planner (``get_global_kv_cache_groups`` and ``get_kv_cache_configs``, as the engine core
calls them) groups the layers and sizes the pool; the hybrid KV cache manager is on, as
it is on a GPU or CPU platform (this machine's "unspecified" platform turns it off, so it
is set back after the config is built, before anything reads it).

``HybridWorker`` plays the model runner with one block table per group, and
``HybridModel`` checks every attention read: per layer and request it compares what
attention reads (the whole prefix for full attention, the window's reach for a sliding
layer) with the deterministic KV the model writes, a function of the prompt's prefix,
the position and the layer. A Mamba layer reads its state as vLLM's align mode does
(from the block of the chunk's first position - 1) and writes the state at the chunk's
end (and at the prefill checkpoint, where vLLM gave it a block); the state is a
deterministic function of the prefix too. A wrong read is recorded and poisons what that
step writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from harness import (
    BLOCK_SIZE,
    ConnectorSpec,
    ModelShape,
    SchedulerDriver,
    WorkerDriver,
    make_scheduler,
    make_vllm_config,
    write_model_dir,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import copy_kv_blocks
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)
from vllm.v1.worker.utils import allocate_kv_cache

__all__ = ["HybridModel", "HybridShape", "HybridWorker", "build_hybrid"]

HEADS, HEAD = 4, 16           # attention layers: 4 KV heads of 16
MLA_HEAD = 64                 # MLA layers: one 64-wide latent (the same page size)
# Mamba layers: a conv state and an SSM state (6,912 bytes), padded to the attention page
# (8,192 bytes) as vLLM pads a hybrid model's state pages.
MAMBA_SHAPES = ((3, 64), (4, 16, 24))
MAMBA_BYTES = 4 * sum(int(np.prod(s)) for s in MAMBA_SHAPES)


@dataclass(frozen=True, slots=True)
class HybridShape:
    """Layer kinds in model order; `window`: the sliding layers' window in tokens."""

    kinds: tuple[str, ...]
    window: int = 40

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(f"model.decoder.layers.{i}.self_attn.attn" for i in range(len(self.kinds)))

    def spec(self, kind: str) -> KVCacheSpec:
        f32 = torch.float32
        if kind == "full":
            return FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS,
                                     head_size=HEAD, dtype=f32)
        if kind == "sliding":
            return SlidingWindowSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS,
                                     head_size=HEAD, dtype=f32, sliding_window=self.window)
        if kind == "draft":
            # An MTP/EAGLE head's attention: is_draft never splits a group, so vLLM puts
            # it in the target's full-attention group and marks that group.
            return FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS,
                                     head_size=HEAD, dtype=f32, is_draft=True)
        if kind == "mla":
            return MLAAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1,
                                    head_size=MLA_HEAD, dtype=f32)
        if kind == "mamba":
            return MambaSpec(block_size=BLOCK_SIZE, shapes=MAMBA_SHAPES, dtypes=(f32, f32),
                             page_size_padded=2 * HEADS * HEAD * BLOCK_SIZE * 4,
                             mamba_cache_mode="align", num_prefill_checkpoint_blocks=1,
                             prefill_checkpoint_alignment=1)
        if kind == "sliding_mla":
            return SlidingWindowMLASpec(block_size=BLOCK_SIZE, num_kv_heads=1,
                                        head_size=MLA_HEAD, dtype=f32,
                                        sliding_window=self.window)
        raise ValueError(kind)

    def specs(self) -> dict[str, KVCacheSpec]:
        return {name: self.spec(kind) for name, kind in zip(self.layer_names, self.kinds)}


def build_hybrid(tmp: Path, shape: HybridShape, connector: ConnectorSpec, *,
                 async_scheduling: bool = False, num_blocks: int = 256,
                 specs: dict[str, KVCacheSpec] | None = None
                 ) -> tuple[object, KVCacheConfig]:
    """(VllmConfig with HMA on, the KVCacheConfig vLLM's planner makes for the layers)."""
    model_dir = write_model_dir(tmp, ModelShape(num_layers=len(shape.kinds)))
    config = make_vllm_config(model_dir, connector, async_scheduling=async_scheduling)
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    if "mamba" in shape.kinds:
        config.cache_config.mamba_cache_mode = "align"
    specs = specs if specs is not None else shape.specs()
    resolve_kv_cache_layout(config, [["LBNHC"]], list(specs.values()))
    groups = get_global_kv_cache_groups(config, [specs])
    if "draft" in shape.kinds:
        # As vLLM marks them under an EAGLE/MTP speculative config (kv_cache_planning).
        for group in groups:
            group.is_eagle_group = any(specs[n].is_draft for n in group.layer_names)
    page = max(g.kv_cache_spec.page_size_bytes for g in groups)
    kv_cache_config = get_kv_cache_configs(
        config, [specs], [page * num_blocks * len(groups)], groups)[0]
    config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    return config, kv_cache_config


@dataclass
class HybridModel:
    """Writes deterministic KV and checks every read, per group's block table."""

    prompts: dict[str, list[int]]
    shape: HybridShape
    step: int = 0
    wrong: list[tuple[int, str, str, int]] = field(default_factory=list)
    reads: int = 0
    # Where each request's first computed chunk started: what the engine and the
    # connector supplied before it (a fresh engine has no prefix cache of its own).
    loaded: dict[str, int] = field(default_factory=dict)

    def values(self, req_id: str, layer: int, positions: np.ndarray, width: int,
               heads: int) -> torch.Tensor:
        prompt = self.prompts[req_id]
        acc, h = 17, []
        for i in range(int(positions.max()) + 1):
            tok = prompt[i] if i < len(prompt) else -1
            acc = (acc * 1_000_003 + tok + 7) % 2_147_483_647
            h.append(acc)
        base = (np.asarray(h)[positions] * 7 + layer * 13 + positions) % 60_000
        grid = torch.arange(heads * width, dtype=torch.float32).view(heads, width) / 128
        return torch.as_tensor(base, dtype=torch.float32).view(-1, 1, 1) + grid

    def state(self, req_id: str, layer: int, position: int) -> torch.Tensor:
        """The Mamba state after the first `position` tokens: MAMBA_BYTES bytes."""
        prompt = self.prompts[req_id]
        acc = 29 + layer
        for i in range(position):
            tok = prompt[i] if i < len(prompt) else -1
            acc = (acc * 1_000_003 + tok + 7) % 2_147_483_647
        grid = torch.arange(MAMBA_BYTES // 4, dtype=torch.float32) / 64
        return (grid + float(acc % 60_000) + position).view(torch.int8)

    def mamba(self, name: str, layer: int, cache: torch.Tensor, table,
              chunks: dict[str, tuple[int, int]]) -> None:
        """A Mamba layer in align mode: read the state at each chunk's start from block
        (start-1)//block, write the state at its end (and at the prefill checkpoint)."""
        block = BLOCK_SIZE
        for req_id, (start, end) in chunks.items():
            self.loaded.setdefault(req_id, start)
            blocks = table(req_id)
            ok = True
            if start > 0:
                got = cache[blocks[(start - 1) // block], 0, 0, :MAMBA_BYTES]
                self.reads += 1
                if blocks[(start - 1) // block] == 0 or \
                        not torch.equal(got, self.state(req_id, layer, start)):
                    ok = False
                    self.wrong.append((self.step, req_id, name, start))
            writes = [(end, (end - 1) // block)]
            # vLLM's checkpoint block: the column before the chunk's last, where it gave
            # the request a block of its own beyond the state it started from.
            mark = (end + block - 1) // block - 2
            if mark >= 0 and mark > (start - 1) // block and (mark + 1) * block > start \
                    and mark < len(blocks) and blocks[mark] != 0:
                writes.append(((mark + 1) * block, mark))
            for position, col in writes:
                state = self.state(req_id, layer, position)
                cache[blocks[col], 0, 0, :MAMBA_BYTES] = state if ok else -state

    def expected_state(self, req_id: str, layers: Sequence[int], boundary: int) -> np.ndarray:
        """The bytes a Mamba group's page for the state at `boundary` should hold."""
        return torch.cat([self.state(req_id, layer, boundary) for layer in layers]
                         ).numpy().view(np.uint8)

    def reach(self, layer: int) -> int | None:
        kind = self.shape.kinds[layer]
        return self.shape.window - 1 if kind.startswith("sliding") else None

    def __call__(self, name: str, layer: int, cache: torch.Tensor, table,
                 slots: list[tuple[str, int, int, int]]) -> None:
        heads, block, width = cache.shape[1], cache.shape[2], cache.shape[3]
        by_req: dict[str, list[tuple[int, int, int]]] = {}
        for req_id, position, blk, offset in slots:
            by_req.setdefault(req_id, []).append((position, blk, offset))
        for req_id, mine in by_req.items():
            start = min(p for p, _, _ in mine)
            self.loaded.setdefault(req_id, start)
            reach = self.reach(layer)
            low = 0 if reach is None else max(0, start - reach)
            ok = True
            if start > low:
                positions = np.arange(low, start)
                blocks = torch.as_tensor([table(req_id)[p // block] for p in positions])
                got = cache[blocks, :, torch.as_tensor(positions % block), :]
                want = self.values(req_id, layer, positions, width, heads)
                bad = int((got != want).flatten(1).any(dim=1).sum())
                self.reads += len(positions)
                if bad:
                    ok = False
                    self.wrong.append((self.step, req_id, name, bad))
            positions = np.array([p for p, _, _ in mine])
            kv = self.values(req_id, layer, positions, width, heads)
            if not ok:
                kv = -(kv + 1)
            cache[torch.as_tensor([b for _, b, _ in mine]), :,
                  torch.as_tensor([o for _, _, o in mine]), :] = kv

    def expected_page(self, req_id: str, layers: Sequence[int], first: int,
                      mla: bool) -> np.ndarray:
        """The bytes a group's page at token `first` should hold in the store."""
        positions = np.arange(first, first + BLOCK_SIZE)
        slabs = []
        for layer in layers:
            if mla:
                kv = self.values(req_id, layer, positions, MLA_HEAD, 1)   # [T, 1, D]
                slabs.append(kv.reshape(-1))
            else:
                kv = self.values(req_id, layer, positions, 2 * HEAD, HEADS)
                slabs.append(torch.stack([kv[..., :HEAD], kv[..., HEAD:]]).reshape(-1))
        return torch.cat(slabs).numpy().view(np.uint8)


class HybridWorker(WorkerDriver):
    """WorkerDriver with one block table per KV-cache group and a HybridModel."""

    def __init__(self, vllm_config, kv_cache_config: KVCacheConfig, shape: HybridShape,
                 model: HybridModel) -> None:
        self.vllm_config = vllm_config
        self.block_size = vllm_config.cache_config.block_size
        self.shape_h = shape
        self.model = model
        self.connector = KVConnectorFactory.create_connector(
            vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        self.group_of = {name: g for g, group in enumerate(kv_cache_config.kv_cache_groups)
                         for name in group.layer_names}
        self.kv_caches = {}
        # Mamba layers get their caches as vLLM 0.33's worker makes them: a byte view
        # [blocks, 1, 1, content] of the planner's tensors.
        vllm_caches = allocate_kv_cache(
            kv_cache_config, torch.device("cpu"),
            vllm_config.cache_config.get_resolved_kv_cache_layout()) \
            if "mamba" in shape.kinds else {}
        for name, kind in zip(shape.layer_names, shape.kinds):
            if kind == "mamba":
                self.kv_caches[name] = vllm_caches[name]
                continue
            if kind in ("mla", "sliding_mla"):
                heads, width = 1, MLA_HEAD
            else:
                heads, width = HEADS, 2 * HEAD
            self.kv_caches[name] = torch.zeros(
                kv_cache_config.num_blocks, self.block_size, heads, width,
                dtype=torch.float32).permute(0, 2, 1, 3)
        self.connector.register_kv_caches(self.kv_caches)
        self.connector.set_host_xfer_buffer_ops(copy_kv_blocks)
        self.tables: dict[str, list[list[int]]] = {}
        self.writer = None

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.tables.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.tables[new.req_id] = [list(b) for b in new.block_ids]
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks in zip(cached.req_ids, cached.new_block_ids):
            if new_blocks is None:
                continue
            if req_id in cached.resumed_req_ids:
                self.tables[req_id] = [list(b) for b in new_blocks]
            else:
                for have, more in zip(self.tables[req_id], new_blocks):
                    have.extend(more)

    def _forward(self, so: SchedulerOutput) -> None:
        self.model.step += 1
        computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for layer, name in enumerate(self.shape_h.layer_names):
            g = self.group_of[name]
            if self.shape_h.kinds[layer] == "mamba":
                # As in vLLM 0.33, a Mamba layer calls no connector hook (only attention
                # layers do): the connector saves its states at wait_for_save.
                self.model.mamba(name, layer, self.kv_caches[name],
                                 lambda r, g=g: self.tables[r][g],
                                 {r: (computed[r], computed[r] + n)
                                  for r, n in so.num_scheduled_tokens.items()})
                continue
            slots = []
            for req_id, count in so.num_scheduled_tokens.items():
                table = self.tables[req_id][g]
                for p in range(computed[req_id], computed[req_id] + count):
                    slots.append((req_id, p, table[p // self.block_size],
                                  p % self.block_size))
            self.connector.wait_for_layer_load(name)
            self.model(name, layer, self.kv_caches[name],
                       lambda r, g=g: self.tables[r][g], slots)
            self.connector.save_kv_layer(name, self.kv_caches[name], None)


def hybrid_engine(tmp: Path, shape: HybridShape, connector: ConnectorSpec,
                  prompts: dict[str, list[int]], **kwargs) -> SchedulerDriver:
    config, kv_cache_config = build_hybrid(tmp, shape, connector, **kwargs)
    model = HybridModel(prompts, shape)
    scheduler = make_scheduler(config, kv_cache_config)
    driver = SchedulerDriver(scheduler, HybridWorker(config, kv_cache_config, shape, model))
    return driver
