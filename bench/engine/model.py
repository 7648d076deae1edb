"""A Llama-shaped decoder with random weights that runs vLLM-style steps over a paged KV cache.

One step serves a batch of requests, each bringing new token ids, the number of its tokens
whose K/V is already in the cache (computed by an earlier step, or loaded by a KV connector),
and its block table. Prefill, chunked prefill and decode are one code path: per layer the new
tokens' K/V are written into their slots, then attention reads the whole context back from the
cache. So a request whose prefix was loaded into other blocks computes bit for bit what it would
have computed had the engine cached that prefix itself; against one full prefill it differs only
by GEMM-shape rounding (below 1e-5 in fp32, a few bf16 ulps in bf16).

Per layer, the connector is called where vLLM's attention layer calls it::

    write new K/V -> wait_for_layer_load(name) -> gather + attend -> save_kv_layer(name, kv)

Writing before the wait is safe: a load fills whole pages below ``num_computed_tokens`` and new
tokens sit at or after it, so they never share a slot (newer vLLM splits the cache write out of
the attention op the same way).

The weights are random; nothing is downloaded. Every matrix is drawn from N(0, 1/fan_in), so
each projection keeps unit scale and attention scores have unit variance (neither uniform nor
one-hot), and the two residual branches are further scaled by 1/sqrt(2 * num_layers), so the
residual stream stays O(1) at any depth (GPT-2's scheme). RoPE is the standard Llama rotation
(HF ``rotate_half`` convention) without Llama 3's long-context frequency scaling, which only
changes frequencies and not the cost or the cache layout.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .graphs import GraphedLayers
from .paged_cache import (
    PagedCacheSpec,
    SeqStep,
    StepMetadata,
    check_kv_caches,
    layer_name,
    paged_attention,
    prepare_step,
    write_kv,
)

__all__ = [
    "NO_HOOKS",
    "PRESETS",
    "LayerHooks",
    "LlamaModel",
    "ModelConfig",
    "NoLayerHooks",
    "SeqStep",
    "StepOutput",
]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shape of a Llama-style model."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float = 500_000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False  # Llama 3.2 1B shares the embedding with the LM head

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_size",
                      "intermediate_size", "vocab_size"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of "
                             f"num_kv_heads {self.num_kv_heads}")
        if self.head_size % 2:
            raise ValueError(f"RoPE needs an even head_size, got {self.head_size}")

    @staticmethod
    def preset(name: str) -> ModelConfig:
        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(
                f"unknown model preset {name!r}; choose from {sorted(PRESETS)}"
            ) from None

    def cache_spec(self, num_blocks: int, block_size: int) -> PagedCacheSpec:
        return PagedCacheSpec(self.num_layers, num_blocks, block_size, self.num_kv_heads,
                              self.head_size)


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig("tiny", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                        head_size=16, intermediate_size=128, vocab_size=512, rope_theta=10_000.0),
    # meta-llama/Llama-3.2-1B
    "1b": ModelConfig("llama-3.2-1b", num_layers=16, hidden_size=2048, num_heads=32,
                      num_kv_heads=8, head_size=64, intermediate_size=8192, vocab_size=128256,
                      tie_word_embeddings=True),
    # meta-llama/Meta-Llama-3-8B
    "8b": ModelConfig("llama-3-8b", num_layers=32, hidden_size=4096, num_heads=32,
                      num_kv_heads=8, head_size=128, intermediate_size=14336, vocab_size=128256),
}


class LayerHooks(Protocol):
    """What the model calls per layer: the worker half of a KV connector, or nothing."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block (the compute stream) until this layer's loaded K/V are in the cache."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        """This layer's K/V for the step are in ``kv_layer``; start saving what should be."""


class NoLayerHooks:
    """The null hooks: a step with no connector."""

    __slots__ = ()

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        pass


NO_HOOKS = NoLayerHooks()


@dataclass(frozen=True, slots=True)
class StepOutput:
    logits: torch.Tensor  # [num_seqs, vocab] fp32, for each request's last new token
    all_logits: torch.Tensor | None  # [num_new_tokens, vocab] fp32 in batch order, if asked


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama RoPE on ``x`` ``[T, heads, head]``; ``cos``, ``sin`` are ``[T, 1, head / 2]``."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _weight(*shape: int, device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)


class _DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        self.name = layer_name(index)
        h, d = cfg.hidden_size, cfg.head_size
        w = {"device": device, "dtype": dtype}
        self.input_norm = _weight(h, **w)
        # Fused like vLLM's qkv_proj and gate_up_proj: one GEMM instead of three or two.
        self.qkv_proj = _weight((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h, **w)
        self.o_proj = _weight(h, cfg.num_heads * d, **w)
        self.post_attention_norm = _weight(h, **w)
        self.gate_up_proj = _weight(2 * cfg.intermediate_size, h, **w)
        self.down_proj = _weight(h, cfg.intermediate_size, **w)

    def project(self, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Norm, QKV projection and RoPE: ``q`` ``[T, heads, d]``, ``k``/``v`` ``[T, kv_heads, d]``."""
        cfg, t = self.cfg, x.shape[0]
        h = F.rms_norm(x, (cfg.hidden_size,), self.input_norm, cfg.rms_norm_eps)
        q, k, v = F.linear(h, self.qkv_proj).split(
            [cfg.num_heads * cfg.head_size, cfg.num_kv_heads * cfg.head_size,
             cfg.num_kv_heads * cfg.head_size], dim=-1)
        q = _rotate(q.view(t, cfg.num_heads, cfg.head_size), cos, sin)
        k = _rotate(k.view(t, cfg.num_kv_heads, cfg.head_size), cos, sin)
        return q, k, v.view(t, cfg.num_kv_heads, cfg.head_size)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: StepMetadata,
               kv_layer: torch.Tensor, hooks: LayerHooks) -> torch.Tensor:
        """Write the new K/V, wait for this layer's load, attend, offer the layer to save."""
        write_kv(kv_layer, meta.slots, k, v)
        hooks.wait_for_layer_load(self.name)
        attn = paged_attention(q, kv_layer, meta)
        hooks.save_kv_layer(self.name, kv_layer)
        return attn

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output projection, norm and MLP with their residuals: the next layer's input."""
        cfg = self.cfg
        x = x + F.linear(attn, self.o_proj)
        h = F.rms_norm(x, (cfg.hidden_size,), self.post_attention_norm, cfg.rms_norm_eps)
        gate, up = F.linear(h, self.gate_up_proj).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, self.down_proj)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: StepMetadata,
                kv_layer: torch.Tensor, hooks: LayerHooks) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        return self.finish(x, self.attend(q, k, v, meta, kv_layer, hooks))


class LlamaModel(nn.Module):
    """A Llama decoder with seeded random weights; ``forward`` runs one step over the cache.

    ``dtype`` defaults to bfloat16 on CUDA and float32 elsewhere. Weights are drawn on
    ``device`` from a generator seeded with ``seed``: the same (config, seed, device type,
    dtype) always gives the same weights, but CPU and CUDA draw different numbers.

    On CUDA, steps of up to ``graphs.BUCKETS[-1]`` tokens replay piecewise CUDA graphs
    (``graphs.py`` says why); ``cuda_graphs=False`` runs every step eagerly.
    """

    def __init__(self, config: ModelConfig, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype | None = None, seed: int = 0, cuda_graphs: bool = True):
        super().__init__()
        self.config = config
        self.device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0", to compare
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        w = {"device": self.device, "dtype": self.dtype}
        self.embed_tokens = _weight(config.vocab_size, config.hidden_size, **w)
        self.layers = nn.ModuleList(_DecoderLayer(config, i, self.device, self.dtype)
                                    for i in range(config.num_layers))
        self.norm = _weight(config.hidden_size, **w)
        self.lm_head = (self.embed_tokens if config.tie_word_embeddings
                        else _weight(config.vocab_size, config.hidden_size, **w))
        half = torch.arange(0, config.head_size, 2, dtype=torch.float64) / config.head_size
        inv_freq = (1.0 / config.rope_theta**half).to(torch.float32)
        self.register_buffer("inv_freq", inv_freq.to(self.device), persistent=False)
        self._init_weights(seed)
        self.graphs: GraphedLayers | None = None
        if cuda_graphs and self.device.type == "cuda":
            c = config
            shapes = {"x": (c.hidden_size,), "rope": (1, c.head_size // 2),
                      "q": (c.num_heads, c.head_size), "kv": (c.num_kv_heads, c.head_size),
                      "attn": (c.num_heads * c.head_size,)}
            self.graphs = GraphedLayers([layer.project for layer in self.layers],
                                        [layer.finish for layer in self.layers],
                                        shapes, self.dtype, self.device)

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        branch_scale = 1.0 / math.sqrt(2 * self.config.num_layers)
        for name, p in self.named_parameters():  # registration order: deterministic
            if p.dim() == 1:  # RMSNorm gains
                p.fill_(1.0)
                continue
            std = 1.0 / math.sqrt(p.shape[1])
            if name.endswith(("o_proj", "down_proj")):
                std *= branch_scale
            p.normal_(0.0, std, generator=gen)

    def cache_spec(self, num_blocks: int, block_size: int) -> PagedCacheSpec:
        return self.config.cache_spec(num_blocks, block_size)

    @torch.no_grad()
    def forward(self, seqs: Sequence[SeqStep], kv_caches: Mapping[str, torch.Tensor],
                hooks: LayerHooks = NO_HOOKS, *, all_logits: bool = False) -> StepOutput:
        """Run one step: write the new tokens' K/V into ``kv_caches`` and return logits.

        ``kv_caches`` maps ``layer_name(i)`` to ``[2, num_blocks, block_size, kv_heads,
        head_size]`` tensors of this model's dtype, on its device.
        """
        cfg = self.config
        num_blocks, block_size = check_kv_caches(kv_caches, cfg.num_layers, cfg.num_kv_heads,
                                                 cfg.head_size)
        first = kv_caches[layer_name(0)]
        if first.dtype != self.dtype or first.device != self.device:
            raise ValueError(f"kv_caches are {first.dtype} on {first.device}; the model is "
                             f"{self.dtype} on {self.device}")
        meta = prepare_step(seqs, num_blocks, block_size, self.device, cfg.num_kv_heads)
        freqs = meta.positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos = freqs.cos().to(self.dtype).unsqueeze(1)  # [T, 1, head_size / 2]
        sin = freqs.sin().to(self.dtype).unsqueeze(1)
        x = F.embedding(meta.input_ids, self.embed_tokens)
        if self.graphs is not None and x.shape[0] <= self.graphs.max_tokens:
            layers = self.layers

            def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
                return layers[i].attend(q, k, v, meta, kv_caches[layers[i].name], hooks)
            x = self.graphs.run(x, cos, sin, attend)
        else:
            for layer in self.layers:
                x = layer(x, cos, sin, meta, kv_caches[layer.name], hooks)
        last = self._logits(x.index_select(0, meta.last_index))
        return StepOutput(logits=last, all_logits=self._logits(x) if all_logits else None)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        x = F.rms_norm(x, (self.config.hidden_size,), self.norm, self.config.rms_norm_eps)
        return F.linear(x, self.lm_head).float()
