"""The reference engine's paged attention kernel against plain attention in fp32.

Run on the GPU machine (marked ``gpu``; skipped without CUDA or Triton)."""

from __future__ import annotations

import math

import pytest
import torch

from kvstore_bench.engine import paged_attn
from kvstore_bench.engine.paged_cache import SeqStep, gather_kv, prepare_step, write_kv

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or paged_attn.triton is None,
                                 reason="needs CUDA and Triton")]

BLOCK = 16


def _reference(q, kv_layer, seqs):
    """Causal attention per request in fp32, each query at its position in the sequence."""
    out, row = [], 0
    for s in seqs:
        n = len(s.token_ids)
        ctx = s.num_computed_tokens + n
        table = torch.tensor(s.block_ids, device=q.device)
        kv = gather_kv(kv_layer, table, ctx).float()          # [2, ctx, kv_heads, d]
        qs = q[row:row + n].float()                            # [n, heads, d]
        group = q.shape[1] // kv_layer.shape[3]
        k = kv[0].repeat_interleave(group, dim=1)             # [ctx, heads, d]
        v = kv[1].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, k) / math.sqrt(q.shape[2])
        pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        scores = scores.masked_fill(torch.arange(ctx, device=q.device)[None, :] > pos,
                                    float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1))
        row += n
    return torch.cat(out)


@pytest.mark.parametrize("heads,kv_heads,head", [(32, 8, 128), (32, 8, 64), (4, 2, 16)])
@pytest.mark.parametrize("shape", [
    [(16, 240)],                    # the remainder of a hit over a short prefix
    [(16, 32752)],                  # ... over a 32k prefix: split keys, combined
    [(1, 4095)],                    # one decode, split
    [(1, 100), (1, 3000), (1, 17)],  # decodes of different lengths
    [(512, 0)],                     # a fresh prefill as large as the kernel takes
    [(300, 77), (1, 5), (33, 1000)],  # a mixed step
])
def test_matches_plain_attention(heads, kv_heads, head, shape):
    gen = torch.Generator(device="cuda").manual_seed(1)
    total = sum(q + c for q, c in shape)
    num_blocks = total // BLOCK + 4 * len(shape) + 8
    kv_layer = torch.zeros(2, num_blocks, BLOCK, kv_heads, head, dtype=torch.bfloat16,
                           device="cuda")
    # Each request's blocks scattered over the cache, in no order.
    perm = torch.randperm(num_blocks, generator=gen, device="cuda").tolist()
    seqs = []
    for q_len, cached in shape:
        need = -(-(q_len + cached) // BLOCK)
        blocks, perm = perm[:need], perm[need:]
        seqs.append(SeqStep(list(range(q_len)), cached, blocks))
    meta = prepare_step(seqs, num_blocks, BLOCK, torch.device("cuda"), kv_heads)
    assert meta.paged is not None
    kv_layer.normal_(generator=gen)                       # the cached prefixes
    t = sum(q for q, _ in shape)
    q = torch.randn(t, heads, head, generator=gen, device="cuda").to(torch.bfloat16)
    k = torch.randn(t, kv_heads, head, generator=gen, device="cuda").to(torch.bfloat16)
    v = torch.randn(t, kv_heads, head, generator=gen, device="cuda").to(torch.bfloat16)
    write_kv(kv_layer, meta.slots, k, v)
    got = paged_attn.paged_attention_triton(q, kv_layer, meta.block_table, meta.paged)
    want = _reference(q, kv_layer, seqs)
    assert got.shape == want.shape
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    again = paged_attn.paged_attention_triton(q, kv_layer, meta.block_table, meta.paged)
    assert torch.equal(got, again)                        # deterministic


def test_long_prefix_uses_splits():
    p = paged_attn.plan([16], [32768], 8, torch.device("cuda"))
    assert p.splits > 1 and p.splits * p.keys_per_split >= 32768
