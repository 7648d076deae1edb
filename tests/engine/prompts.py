"""The prompts every engine test sends (token ids of a 2,048-token vocabulary), 32-token
pages: a prompt shorter than a page, exact page multiples, prompts that share a prefix (a
whole number of pages, and not), and long prompts of many pages."""

from __future__ import annotations

import random

__all__ = ["MAX_TOKENS", "PREEMPT", "ROUND", "SECOND", "THIRD", "key"]

MAX_TOKENS = 8


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 2000) for _ in range(n)]


def _round(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = _tokens(rng, 256)                   # 8 pages
    return [
        _tokens(rng, 20),                        # shorter than a page
        _tokens(rng, 64),                        # exactly 2 pages
        _tokens(rng, 128),                       # exactly 4 pages
        shared + _tokens(rng, 40),               # shared prefix, then part of a page
        shared + _tokens(rng, 64),               # shared prefix, exact multiple (10 pages)
        shared[:100] + _tokens(rng, 200),        # shares 3 pages and part of a fourth
        _tokens(rng, 1500),                      # long
        _tokens(rng, 2000),                      # longer (62 pages and a part)
    ]


# A round, and a second with other prompts (a second engine, a fault mid-round), and a
# third (more pages than a small pool holds, with the others).
ROUND = _round(1)
SECOND = _round(2)
THIRD = _round(3)
# Sixteen prompts of 124 tokens: 4 blocks each, and a fifth once decoding passes token 128;
# in a KV cache of 69 blocks, 16 running requests' fifth blocks do not fit (nor 14's), and
# vLLM preempts.
PREEMPT = [_tokens(random.Random(100 + i), 124) for i in range(16)]


def key(prompt: list[int]) -> tuple[int, ...]:
    return tuple(prompt)
