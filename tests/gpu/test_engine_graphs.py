"""The reference model's piecewise CUDA graphs compute what its eager steps compute.

Run on the GPU machine (marked ``gpu``; skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from kvstore_bench.engine.graphs import BUCKETS
from kvstore_bench.engine.model import LlamaModel, ModelConfig, SeqStep
from kvstore_bench.engine.paged_cache import allocate_kv_caches

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BLOCK = 16


def _models():
    cfg = ModelConfig.preset("tiny")
    graphed = LlamaModel(cfg, device="cuda", dtype=torch.bfloat16, seed=7)
    eager = LlamaModel(cfg, device="cuda", dtype=torch.bfloat16, seed=7, cuda_graphs=False)
    assert graphed.graphs is not None and eager.graphs is None
    return graphed, eager


def _run(model, prompt, split, caches):
    """Prefill ``prompt[:split]``, then the rest in one step; the second step's logits."""
    blocks = list(range(-(-len(prompt) // BLOCK)))
    model([SeqStep(prompt[:split], 0, blocks)], caches)
    return model([SeqStep(prompt[split:], split, blocks)], caches, all_logits=True)


@pytest.mark.parametrize("new_tokens", [1, 7, 16, 100, 512, 700, 1024, 2100])
def test_graphed_steps_match_eager_steps(new_tokens):
    graphed, eager = _models()
    gen = torch.Generator().manual_seed(new_tokens)
    prompt = torch.randint(0, graphed.config.vocab_size, (300 + new_tokens,), generator=gen)
    spec = graphed.cache_spec(-(-len(prompt) // BLOCK) + 2, BLOCK)
    outs = []
    for model in (graphed, eager):
        caches = allocate_kv_caches(spec, dtype=model.dtype, device=model.device)
        outs.append((_run(model, prompt, 300, caches), caches))
    (g, g_caches), (e, e_caches) = outs
    if new_tokens in BUCKETS:   # same GEMM shapes: the same bits
        assert torch.equal(g.all_logits, e.all_logits)
        for name in g_caches:
            assert torch.equal(g_caches[name], e_caches[name])
    else:                       # padded rows change GEMM tiling only: bf16 rounding
        torch.testing.assert_close(g.all_logits, e.all_logits, atol=0.1, rtol=0.05)
    assert torch.equal(g.all_logits.argmax(-1), e.all_logits.argmax(-1))


def test_a_step_over_the_largest_bucket_runs_eagerly():
    graphed, _ = _models()
    with pytest.raises(ValueError, match="graphed step takes"):
        graphed.graphs.run(torch.zeros(BUCKETS[-1] + 1, graphed.config.hidden_size,
                                       device="cuda", dtype=torch.bfloat16),
                           None, None, None)
