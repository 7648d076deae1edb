"""A full hit of a hybrid model (sliding-window and full-attention layers) through the
connector's worker halves: bytes moved and load time with windowed loads (a sliding
group loads only the pages its window reaches) against loading every page of every layer.

The model is Gemma-3-shaped by default: 36 layers, every 6th full attention, the rest
sliding with a 1,024-token window; 8 KV heads of 128, bf16, 16-token pages. Its groups are
cut as vLLM's hybrid KV-cache manager cuts them (one group per full-attention layer set,
the sliding layers in groups of the same size), each a layout of its own in a real
kvstore-server's shared pool that holds every page of every group, as the connector's saves
leave it (connector/groups.py says why a sliding group saves every page).

For each prompt length the hit is every page of the prompt. Two plans move it, through
the same GroupWorkers over one client and one CUDA registration of the pool:

    windowed     the connector's own: a sliding group's rows hold vLLM's null block
                 before the window, and connector.groups.for_group loads only the
                 window's pages (at most ceil((window - 1) / page_tokens) + 1 a layer)
    every page   the sliding groups declared full attention with a real block for every
                 page: what a connector without windowed loads moves

Each hit is planned by the connector's scheduler half (its leased Lookup over every
group's layout, the engine's blocks, the load's pins) and timed on the host from bind to
the last layer landed (the copies synchronized; the pages are read where the Lookup pinned
them, no Acquire), as an engine's layer-wise load with nothing to hide behind; the two plans and, on CUDA, a pinned cudaMemcpy of each plan's bytes run in
turn, round after round (medians of --reps after a warm-up). The first round's copies are
checked against the pool (the first and last layer of every group, every page loaded) and
the engine's null block must stay untouched. Without CUDA (or --device cpu) the same runs
on CPU tensors, with no pinned-copy baseline; --quick is a small shape for that.

    kvstore-bench hybrid [--tokens 4096,16384,32768] [--reps 9] [--window 1024]
        [--layers 36] [--full-every 6] [--device cuda|cpu] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import numpy as np

__all__ = ["Shape", "main", "plan_bytes", "run"]

_SHIFT = 1040          # page i of a group: source bytes from i*_SHIFT (every page differs)


@dataclasses.dataclass(frozen=True, slots=True)
class Shape:
    """The hybrid model: which layers slide, and each layer's KV shape."""

    layers: int = 36
    full_every: int = 6            # layer i is full attention when (i + 1) % full_every == 0
    window: int = 1024             # sliding_window in tokens
    kv_heads: int = 8
    head: int = 128
    dtype: str = "bfloat16"
    page_tokens: int = 16

    def kinds(self) -> list[str]:
        return ["full" if (i + 1) % self.full_every == 0 else "sliding"
                for i in range(self.layers)]

    def groups(self) -> list[tuple[str, list[int]]]:
        """(kind, layer indices) per KV-cache group, as vLLM's planner groups them: the
        full layers one group, the sliding ones in groups of that size."""
        kinds = self.kinds()
        full = [i for i, k in enumerate(kinds) if k == "full"]
        sliding = [i for i, k in enumerate(kinds) if k == "sliding"]
        if not full:
            raise ValueError("a hybrid shape needs full-attention layers")
        size = len(full)
        return [("full", full)] + [("sliding", sliding[i:i + size])
                                   for i in range(0, len(sliding), size)]

    @property
    def layer_bytes(self) -> int:
        item = 4 if self.dtype == "float32" else 2
        return 2 * self.page_tokens * self.kv_heads * self.head * item

    def describe(self) -> str:
        n_full = sum(k == "full" for k in self.kinds())
        return (f"{self.layers} layers ({n_full} full attention, {self.layers - n_full} "
                f"sliding, window {self.window}), {self.kv_heads} KV heads of {self.head}, "
                f"{self.dtype}, {self.page_tokens}-token pages; "
                f"{len(self.groups())} KV-cache groups")


QUICK = Shape(layers=6, full_every=3, window=64, kv_heads=2, head=64)


def _layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def plan_bytes(shape: Shape, pages: int, windowed: bool) -> tuple[int, int]:
    """(bytes a full hit of `pages` pages moves, pages a sliding layer loads)."""
    from kvstore_connector.groups import CacheGroup, GroupKind
    group = CacheGroup(0, GroupKind.SLIDING, (), shape.kv_heads, shape.head, shape.dtype,
                       False, reach=shape.window - 1)
    sliding_pages = pages - group.first_page(pages, shape.page_tokens) if windowed else pages
    n_full = sum(k == "full" for k in shape.kinds())
    layer_pages = n_full * pages + (shape.layers - n_full) * sliding_pages
    return layer_pages * shape.layer_bytes, sliding_pages


class _Model:
    """The engine's side: per-layer paged caches and the connector's worker halves."""

    def __init__(self, shape: Shape, address: str, device: str, num_blocks: int) -> None:
        import torch

        from kvstore_client import PageLayout
        from kvstore_connector.config import ConnectorConfig, LookupMode
        from kvstore_connector.groups import CacheGroup, GroupKind
        from kvstore_connector.kvviews import KVKind, kv5
        from kvstore_connector.scheduler import SchedulerHalf
        from kvstore_connector.worker import SharedStore

        self.torch, self.shape, self.device = torch, shape, device
        dtype = getattr(torch, shape.dtype)
        # vLLM 0.33's per-layer cache: [blocks, heads, block, 2*head] over LBNHC memory.
        self.caches = [torch.zeros(num_blocks, shape.page_tokens, shape.kv_heads,
                                   2 * shape.head, dtype=dtype, device=device)
                       .permute(0, 2, 1, 3) for _ in range(shape.layers)]
        self.views = [kv5(t, KVKind.VLLM_4D) for t in self.caches]
        self.config = ConnectorConfig(server=address, timeout=30.0, lookup_timeout=30.0,
                                      lookups=LookupMode.SYNC)
        self.spec = shape.groups()
        self.layouts = [PageLayout(model="bench-hybrid", num_layers=len(layers),
                                   page_tokens=shape.page_tokens, num_kv_heads=shape.kv_heads,
                                   head_size=shape.head, dtype=shape.dtype,
                                   salt=f"#bench:g{g}:{kind}:w{shape.window}")
                        for g, (kind, layers) in enumerate(self.spec)]
        self.shared = SharedStore.open(self.config, self.layouts[0])
        self.plans = {}
        self.schedulers = {}
        for windowed in (True, False):
            groups = [CacheGroup(g, GroupKind.SLIDING if kind == "sliding" and windowed
                                 else GroupKind.FULL,
                                 tuple(_layer_name(i) for i in layers), shape.kv_heads,
                                 shape.head, shape.dtype, False,
                                 reach=shape.window - 1 if kind == "sliding" else 0,
                                 scope=f"g{g}", block_size=shape.page_tokens)
                      for g, (kind, layers) in enumerate(self.spec)]
            self.plans[windowed] = self._workers(groups)
            self.schedulers[windowed] = SchedulerHalf(self.config, self.layouts,
                                                      shape.page_tokens, groups=groups)

    def _workers(self, groups):
        from kvstore_connector.worker import WorkerHalf
        from kvstore_connector.worker.groupworkers import GroupWorkers
        workers = [WorkerHalf(self.config, layout,
                              {_layer_name(i): self.views[i] for i in layers},
                              shared=self.shared)
                   for layout, (_, layers) in zip(self.layouts, self.spec)]
        # The shared store is closed here (close()), after both plans' workers.
        return GroupWorkers(groups, workers, self.shape.page_tokens)

    def sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def close(self) -> None:
        try:
            for sched in self.schedulers.values():
                sched.close()
            for plan in self.plans.values():
                plan.close()
        finally:
            self.shared.close()


def _fill(client, model: _Model, keys: list[bytes], source: np.ndarray) -> None:
    """Every page of every group into the pool (as the connector's saves leave it)."""
    for g, layout in enumerate(model.layouts):
        ns = client.register_layout(layout)
        with client.reserve(ns, keys) as res:
            for i, view in enumerate(res.views):
                start = _SHIFT * i + 97 * g
                view[:] = source[start:start + ns.page_bytes]


def _step(model: _Model, tokens: np.ndarray, windowed: bool, req: int):
    """The step plan of a full hit of the prompt, made by the connector's scheduler half:
    its leased Lookup over every group's layout, the engine's blocks for the hit (a
    sliding group's null block before its window where the plan is windowed), and the
    load's pins, so the workers copy from the pool without an Acquire."""
    from kvstore_connector.groups import NULL_BLOCK
    sched, shape = model.schedulers[windowed], model.shape
    pages = (len(tokens) - 1) // shape.page_tokens
    req_id = f"hybrid-{req}"
    hit = sched.hit(req_id, tokens, 0)
    if hit != pages * shape.page_tokens:
        raise SystemExit(f"hybrid bench: the scheduler half found {hit} tokens, not "
                         f"{pages * shape.page_tokens}")
    first = pages - plan_bytes(shape, pages, True)[1]
    blocks = []
    for kind, _ in model.spec:
        row = list(range(1, pages + 1))
        if windowed and kind == "sliding":
            row[:first] = [NULL_BLOCK] * first
        blocks.append(row)
    sched.allocated(req_id, blocks, hit)
    return req_id, sched.build()


def _load(model: _Model, tokens: np.ndarray, windowed: bool, req: int) -> tuple[float, int]:
    """One full hit through the worker halves: (host seconds from bind to the last layer
    landed, bytes the workers moved)."""
    workers = model.plans[windowed]
    req_id, step = _step(model, tokens, windowed, req)
    model.sync()
    t0 = time.perf_counter()
    workers.bind(step)
    workers.start_load(step)
    for i in range(model.shape.layers):
        workers.wait_for_layer(_layer_name(i))
    model.sync()
    seconds = time.perf_counter() - t0
    workers.wait_for_save()
    workers.finished()
    sched = model.schedulers[windowed]
    sched.finished(req_id)
    sched.build()                         # the lookup's lease goes back
    stats = workers.take_stats()
    if stats.load_failures:
        raise SystemExit(f"hybrid bench: {stats.load_failures} loads failed")
    if stats.loads_pinned != len(model.spec):
        raise SystemExit(f"hybrid bench: {stats.loads_pinned} of {len(model.spec)} groups' "
                         f"loads read the lookup's pins (the rest acquired)")
    return seconds, stats.bytes_loaded


def _check(model: _Model, pages: int, windowed: bool, source: np.ndarray) -> None:
    """The first and last layer of each group hold the pool's bytes in every block the
    plan loads; the null block is untouched."""
    torch, shape = model.torch, model.shape
    first = pages - plan_bytes(shape, pages, True)[1]
    lb = shape.layer_bytes
    for g, (kind, layers) in enumerate(model.spec):
        lo = first if (windowed and kind == "sliding") else 0
        for at in sorted({0, len(layers) - 1}):
            view = model.views[layers[at]]
            got = view[:, 1 + lo:1 + pages].transpose(0, 1).contiguous() \
                .view(torch.uint8).reshape(pages - lo, lb).cpu().numpy()
            for p in range(lo, pages):
                start = _SHIFT * p + 97 * g + at * lb
                if not np.array_equal(got[p - lo], source[start:start + lb]):
                    raise SystemExit(f"hybrid bench: group {g} layer {layers[at]} page {p} "
                                     f"differs from the pool")
            if view[:, 0].abs().sum().item() != 0:
                raise SystemExit(f"hybrid bench: layer {layers[at]} wrote the null block")


def run(shape: Shape, tokens: list[int], reps: int, device: str) -> dict:
    import torch

    from kvstore_client import KVStoreClient
    from kvstore_testing.serverproc import ServerProcess

    max_pages = max(tokens) // shape.page_tokens
    total = shape.layers * shape.layer_bytes * max_pages
    dram_gib = -(-total * 100 // 85 // (1 << 30)) + 1
    rng = np.random.default_rng(0)
    largest = max(len(layers) for _, layers in shape.groups()) * shape.layer_bytes
    source = rng.integers(0, 256, largest + _SHIFT * max_pages + 97 * len(shape.groups()),
                          dtype=np.uint8)
    prompt = rng.integers(0, 32000, max_pages * shape.page_tokens + 1).astype(np.int32)
    out: dict = {"shape": shape.describe(), "device": device, "dram_gib": dram_gib,
                 "sizes": []}
    cuda = device == "cuda"
    t0 = time.perf_counter()
    with ServerProcess(dram=f"{dram_gib}GiB").start(wait=300) as srv, \
            KVStoreClient(srv.address, shared_memory=True, timeout=120) as client:
        model = _Model(shape, srv.address, device, max_pages + 1)
        try:
            from kvstore_connector.scheduler.hashing import page_keys
            _fill(client, model, page_keys(prompt[:-1], shape.page_tokens,
                                           model.layouts[0].chain_seed), source)
            out["setup_s"] = time.perf_counter() - t0
            if cuda:
                pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
                pinned.numpy()[:] = 1
                device_buf = torch.empty(total, dtype=torch.uint8, device="cuda")
            req = 0
            for n_tokens in tokens:
                pages = n_tokens // shape.page_tokens
                # One token past the pages: the engine computes at least the last one.
                tokens = prompt[:n_tokens + 1]
                times: dict[str, list[float]] = {"windowed": [], "every": [], "h2d_windowed": [],
                                                 "h2d_every": []}
                moved = {}
                for rep in range(reps + 1):
                    for windowed, name in ((True, "windowed"), (False, "every")):
                        for view in model.views:
                            view.zero_()
                        req += 1
                        seconds, nbytes = _load(model, tokens, windowed, req)
                        if rep == 0:
                            _check(model, pages, windowed, source)
                            moved[name] = nbytes
                        else:
                            times[name].append(seconds)
                        if cuda:
                            dev, host = device_buf[:nbytes], pinned[:nbytes]
                            torch.cuda.synchronize()
                            t1 = time.perf_counter()
                            dev.copy_(host, non_blocking=True)
                            torch.cuda.synchronize()
                            if rep:
                                times["h2d_" + name].append(time.perf_counter() - t1)
                med = {k: statistics.median(v) for k, v in times.items() if v}
                size: dict = {"tokens": n_tokens, "pages": pages,
                              "sliding_pages": plan_bytes(shape, pages, True)[1]}
                for name in ("windowed", "every"):
                    expect = plan_bytes(shape, pages, name == "windowed")[0]
                    if moved[name] != expect:
                        raise SystemExit(f"hybrid bench: {name} moved {moved[name]} bytes, "
                                         f"the plan says {expect}")
                    size[name] = {"bytes": moved[name], "load_ms": med[name] * 1e3,
                                  "gbps": moved[name] / med[name] / 1e9,
                                  "h2d_gbps": (moved[name] / med["h2d_" + name] / 1e9
                                               if cuda else None)}
                out["sizes"].append(size)
        finally:
            model.close()
    return out


def report(r: dict) -> str:
    lines = [f"bench-hybrid on {r['device']}: {r['shape']}; pool {r['dram_gib']} GiB, "
             f"setup {r['setup_s']:.1f} s", "",
             "A full hit of every page of the prompt through the connector's worker halves "
             "(bind to the last layer landed, host-timed; pages read from the scheduler "
             "half's pins); windowed: a sliding group "
             "loads the pages its window reaches; every page: the sliding groups loaded as "
             "full attention.", "",
             ("| tokens | plan | sliding pages/layer | MiB | load ms | load GB/s "
              "| pinned H2D GB/s | load/H2D |"), "|---|---|---|---|---|---|---|---|"]
    for s in r["sizes"]:
        for name, label, sliding in (("windowed", "windowed", s["sliding_pages"]),
                                     ("every", "every page", s["pages"])):
            m = s[name]
            h2d = f"{m['h2d_gbps']:.1f}" if m["h2d_gbps"] else "-"
            ratio = f"{m['gbps'] / m['h2d_gbps']:.0%}" if m["h2d_gbps"] else "-"
            lines.append(f"| {s['tokens']} | {label} | {sliding} | {m['bytes'] / 2**20:.1f} | "
                         f"{m['load_ms']:.2f} | {m['gbps']:.1f} | {h2d} | {ratio} |")
    lines.append("")
    for s in r["sizes"]:
        w, e = s["windowed"], s["every"]
        lines.append(f"windowed / every page at {s['tokens']} tokens: bytes "
                     f"{w['bytes'] / e['bytes']:.0%}, load time {w['load_ms'] / e['load_ms']:.0%}"
                     f" (every page takes {e['load_ms'] / w['load_ms']:.1f}x the time)")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvstore-bench hybrid", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=_ints, default=None,
                   help="prompt lengths, comma-separated (default 4096,16384,32768; "
                        "--quick: 256,1024)")
    p.add_argument("--reps", type=int, default=None, help="timed runs per figure (median; "
                   "default 9, --quick 3)")
    default = Shape()
    p.add_argument("--layers", type=int, default=default.layers)
    p.add_argument("--full-every", type=int, default=default.full_every,
                   help="every Nth layer is full attention, the rest slide")
    p.add_argument("--window", type=int, default=default.window, help="sliding window, tokens")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="default: cuda where there is one")
    p.add_argument("--quick", action="store_true",
                   help=f"a small shape for a machine without a GPU ({QUICK.describe()})")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("kvstore-bench hybrid: --device cuda needs a CUDA device", file=sys.stderr)
        return 2
    if args.quick:
        shape = QUICK
        tokens, reps = args.tokens or [256, 1024], args.reps or 3
    else:
        shape = Shape(layers=args.layers, full_every=args.full_every, window=args.window)
        tokens, reps = args.tokens or [4096, 16384, 32768], args.reps or 9
    if any(t <= 0 or t % shape.page_tokens for t in tokens):
        p.error(f"--tokens must be positive multiples of {shape.page_tokens}")
    if shape.full_every < 2 or shape.window < 1:
        p.error("--full-every must be >= 2 and --window >= 1")
    r = run(shape, tokens, reps, device)
    print(json.dumps(r, indent=2) if args.json else report(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
