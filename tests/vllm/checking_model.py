"""A fake model that checks every attention read, for ``harness.WorkerDriver``.

Each token's KV at each layer is a function of the request's prompt up to that token
(a rolling hash), the position and the layer; generated tokens count by position only,
since under async scheduling a step runs before the token it writes is known here. Per
layer and per scheduled request, before writing the step's KV, the model reads what
attention would read -- every earlier position of the request through its block table --
and compares it with the expected KV. A request that read wrong KV writes poisoned KV
(negative values) for the tokens it computed, as a real model would write garbage, and
samples ``WRONG_TOKEN`` instead of ``GOOD_TOKEN`` if the step completes its prefill. So:

- a wrong read in a step the engine accepts ends, at the latest, in a sampled
  ``WRONG_TOKEN``, unless the engine recomputed the poisoned KV first;
- a page computed over a wrong read holds negative values, which ``expected_page``
  never does, so a poisoned page in the store is found by comparing bytes.

Values are small integers plus multiples of 1/128, exact in float32.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = ["GOOD_TOKEN", "WRONG_TOKEN", "CheckingModel", "Read"]

GOOD_TOKEN = 100
WRONG_TOKEN = 999
_MOD = 60_000


@dataclass(frozen=True, slots=True)
class Read:
    """One request's wrong read: at which step and layer, and how many positions."""

    step: int
    req_id: str
    layer: int
    positions: int


@dataclass
class CheckingModel:
    """The LayerWriter of a WorkerDriver (set ``driver.writer = model``)."""

    prompts: dict[str, list[int]]               # req id -> prompt token ids
    num_heads: int
    head_size: int                              # C = 2 * head_size per head in the cache
    block_tables: object = None                 # req id -> block ids (the driver's)
    step: int = 0
    wrong: list[Read] = field(default_factory=list)
    wrong_now: set[str] = field(default_factory=set)   # requests with a wrong read this step
    reads: int = 0                              # positions compared, over the run
    _hashes: dict[str, np.ndarray] = field(default_factory=dict)

    # -- expected values ------------------------------------------------------------------
    def _prefix_hash(self, req_id: str, upto: int) -> np.ndarray:
        h = self._hashes.get(req_id)
        if h is None or len(h) < upto:
            prompt = self.prompts[req_id]
            n = max(upto, len(prompt))
            h = np.zeros(n, dtype=np.int64)
            acc = 17
            for i in range(n):
                tok = prompt[i] if i < len(prompt) else -1
                acc = (acc * 1_000_003 + tok + 7) % 2_147_483_647
                h[i] = acc
            self._hashes[req_id] = h
        return h[:upto]

    def values(self, req_id: str, layer: int, positions: np.ndarray) -> torch.Tensor:
        """Expected KV [n, H, C] of the request's tokens at positions, for one layer."""
        h = self._prefix_hash(req_id, int(positions.max()) + 1)[positions]
        base = (h * 7 + layer * 13 + positions) % _MOD
        grid = torch.arange(self.num_heads * 2 * self.head_size, dtype=torch.float32)
        grid = grid.view(self.num_heads, 2 * self.head_size) / 128
        return torch.as_tensor(base, dtype=torch.float32).view(-1, 1, 1) + grid

    def expected_page(self, req_id: str, first: int, page_tokens: int, num_layers: int
                      ) -> np.ndarray:
        """The bytes the store should hold for the page at token `first`: layer-major
        slabs [K/V, page_tokens, heads, head_size] (kvstore_protocol.layout)."""
        positions = np.arange(first, first + page_tokens)
        slabs = []
        for layer in range(num_layers):
            kv = self.values(req_id, layer, positions)           # [T, H, 2D]
            k, v = kv[..., : self.head_size], kv[..., self.head_size:]
            slabs.append(torch.stack([k, v]).contiguous().reshape(-1))
        return torch.cat(slabs).numpy().view(np.uint8)

    # -- the model ----------------------------------------------------------------------------
    def begin_step(self) -> None:
        self.step += 1
        self.wrong_now = set()

    def __call__(self, layer_name: str, kv_layer: torch.Tensor,
                 slots: list[tuple[str, int, int, int, int]]) -> None:
        layer = int(layer_name.split(".")[3])
        by_req: dict[str, list[tuple[int, int, int]]] = {}
        for req_id, position, block, offset, _ in slots:
            by_req.setdefault(req_id, []).append((position, block, offset))
        block_size = kv_layer.shape[2]
        for req_id, mine in by_req.items():
            start = min(p for p, _, _ in mine)
            ok = True
            if start:
                table = torch.as_tensor(self.block_tables(req_id)[: -(-start // block_size)])
                positions = np.arange(start)
                pos = torch.as_tensor(positions)
                got = kv_layer[table[pos // block_size], :, pos % block_size, :]
                want = self.values(req_id, layer, positions)
                bad = (got != want).flatten(1).any(dim=1)
                self.reads += start
                if bool(bad.any()):
                    ok = False
                    self.wrong.append(Read(self.step, req_id, layer, int(bad.sum())))
                    self.wrong_now.add(req_id)
            positions = np.array([p for p, _, _ in mine])
            kv = self.values(req_id, layer, positions)
            if not ok:
                kv = -(kv + 1)
            blocks = torch.as_tensor([b for _, b, _ in mine])
            offsets = torch.as_tensor([o for _, _, o in mine])
            kv_layer[blocks, :, offsets, :] = kv
