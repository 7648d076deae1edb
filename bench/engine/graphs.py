"""Piecewise CUDA graphs for the reference model: a step's layers, attention left out.

Why: the reference engine exists to measure the store, so its forward must cost what a real
engine's does. Eager, an 8B forward of 16 new tokens over a resident prefix took several
times its GPU work in host time (torch profiler: dozens of kernel launches a layer, each
paying Python and dispatch), which made every hit look slower than it is. vLLM does
not pay that: it captures everything but attention in CUDA graphs per token count
("piecewise" graphs) and runs attention eagerly, because attention's shape follows each
request's context. This module does the same.

Per layer two graphs, captured once per bucket of token counts::

    x[i % 2] --pre--> q, k, v       (norm, QKV projection, RoPE)
    eager: write K/V, wait_for_layer_load, attention -> attn, save_kv_layer
    x[i % 2], attn --post--> x[(i + 1) % 2]   (output projection, norm, MLP, residuals)

A step of T tokens runs in the smallest bucket >= T: rows past T hold stale finite values,
are never written into the cache and never read back. The residual stream ping-pongs between
two buffers, so no copies stand between the layers.

The buckets reach past vLLM's default capture sizes (512) to 2,048 tokens. Above 512 vLLM
runs its torch.compile'd model, whose fused kernels cost few launches; this model's eager
ops do not fuse, and on the H200 host an eager 8B step of 1,024 tokens took longer to
enqueue than to run on the device: host-bound, so every microsecond a connector hook spent
on the host was added to the step (a miss that saves read well above a recompute). Buckets
step by 128 tokens to 1,024 and by 256 to 2,048, so padding costs at most a sixth of a
step's GEMMs there. Steps longer than the largest bucket run eagerly: at 4,096 tokens and up
an 8B step is compute-bound and launch costs hide behind its GEMMs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

__all__ = ["BUCKETS", "GraphedLayers"]

# Token counts captured: powers of two to 512, then steps of 128 and 256 (see above).
BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 640, 768, 896, 1024,
                            1280, 1536, 1792, 2048)

# pre(x, cos, sin) -> (q, k, v); post(x, attn) -> next x; attend(i, q, k, v) -> attn
PreFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor],
                 tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
PostFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class _Bucket:
    """The static buffers and the 2 * num_layers graphs of one token count."""

    def __init__(self, size: int, pres: Sequence[PreFn], posts: Sequence[PostFn],
                 shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype,
                 device: torch.device, pool) -> None:
        def buf(name: str) -> torch.Tensor:
            return torch.zeros((size, *shapes[name]), dtype=dtype, device=device)

        self.size = size
        self.x = (buf("x"), buf("x"))        # the residual stream, ping-pong
        self.cos, self.sin = buf("rope"), buf("rope")
        self.q, self.k, self.v, self.attn = buf("q"), buf("kv"), buf("kv"), buf("attn")
        self.pre: list[torch.cuda.CUDAGraph] = []
        self.post: list[torch.cuda.CUDAGraph] = []
        # CUDA wants a workload run before it is captured (cuBLAS workspaces, lazy init).
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for i, (pre, post) in enumerate(zip(pres, posts, strict=True)):
                self._pre(pre, i)
                self._post(post, i)
        torch.cuda.current_stream(device).wait_stream(side)
        for i, (pre, post) in enumerate(zip(pres, posts, strict=True)):
            for graphs, body in ((self.pre, lambda: self._pre(pre, i)),
                                 (self.post, lambda: self._post(post, i))):
                g = torch.cuda.CUDAGraph()
                # thread_local: the connector's threads may use CUDA while this captures.
                with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
                    body()
                graphs.append(g)

    def _pre(self, pre: PreFn, i: int) -> None:
        q, k, v = pre(self.x[i % 2], self.cos, self.sin)
        self.q.copy_(q)
        self.k.copy_(k)
        self.v.copy_(v)

    def _post(self, post: PostFn, i: int) -> None:
        self.x[(i + 1) % 2].copy_(post(self.x[i % 2], self.attn))

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            attend: AttendFn) -> torch.Tensor:
        t = x.shape[0]
        self.x[0][:t].copy_(x)
        self.cos[:t].copy_(cos)
        self.sin[:t].copy_(sin)
        for i, (pre, post) in enumerate(zip(self.pre, self.post, strict=True)):
            pre.replay()
            self.attn[:t].copy_(attend(i, self.q[:t], self.k[:t], self.v[:t]))
            post.replay()
        return self.x[len(self.pre) % 2][:t]


class GraphedLayers:
    """A model's layers as piecewise graphs, one bucket captured on first use."""

    def __init__(self, pres: Sequence[PreFn], posts: Sequence[PostFn],
                 shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype,
                 device: torch.device, buckets: Sequence[int] = BUCKETS) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self._args = (list(pres), list(posts), dict(shapes), dtype, device)
        self._buckets = sorted(buckets)
        self._captured: dict[int, _Bucket] = {}
        self._pool = torch.cuda.graph_pool_handle()  # shared: graphs replay one at a time

    @property
    def max_tokens(self) -> int:
        return self._buckets[-1]

    def capture(self, sizes: Sequence[int] | None = None) -> None:
        """Capture the buckets for ``sizes`` (default: all) now, not in a timed step."""
        for n in sizes or self._buckets:
            self._bucket(n)

    def _bucket(self, n: int) -> _Bucket:
        size = next(b for b in self._buckets if b >= n)
        if size not in self._captured:
            self._captured[size] = _Bucket(size, *self._args, pool=self._pool)
        return self._captured[size]

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            attend: AttendFn) -> torch.Tensor:
        """All layers over ``x`` ``[T, hidden]`` (T <= max_tokens); the last layer's output."""
        if not 0 < x.shape[0] <= self.max_tokens:
            raise ValueError(f"a graphed step takes 1..{self.max_tokens} tokens, got {x.shape[0]}")
        return self._bucket(x.shape[0]).run(x, cos, sin, attend)
