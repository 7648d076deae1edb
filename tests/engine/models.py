"""Tiny models for the engine tests, written from transformers configs with random weights.

Nothing is downloaded: each model is a config and random weights saved to a folder, which
vLLM loads like any local model (token-id prompts, no tokenizer). Random weights give an
almost flat next-token distribution, where greedy decoding is decided by rounding and two
correct engines can disagree: the final norm's weight is scaled up so that the logits, and
the margins between them, are eight times larger and greedy decoding is decisive.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["VOCAB", "write_gemma3", "write_llama"]

VOCAB = 2048
# The logits' scale: large enough that the top token wins by far more than float32 noise.
LOGIT_SCALE = 8.0


def write_llama(folder: Path, seed: int = 0) -> Path:
    """A 4-layer Llama with grouped-query attention (8 query heads, 2 KV heads)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=32, max_position_embeddings=4096,
                         tie_word_embeddings=False, torch_dtype="float32")
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.norm.weight.mul_(LOGIT_SCALE)
    model.save_pretrained(folder)
    return folder


def write_gemma3(folder: Path, seed: int = 0) -> Path:
    """A 4-layer Gemma 3 text model: three sliding-window layers (64 tokens), one full."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                              num_hidden_layers=4, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=64, sliding_window=64,
                              layer_types=["sliding_attention"] * 3 + ["full_attention"],
                              max_position_embeddings=4096, torch_dtype="float32")
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():
        # Gemma's RMSNorm multiplies by (1 + weight).
        weight = model.model.norm.weight
        weight.copy_((1 + weight) * LOGIT_SCALE - 1)
    model.save_pretrained(folder)
    return folder
