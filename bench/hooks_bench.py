"""The worker half's host time per step: a miss that saves every page, hook by hook.

A short prompt's forward is bound by the host (its launches), so every microsecond the
connector's hooks spend in Python on the engine's thread is a microsecond of the step.
This bench drives a WorkerHalf as an engine does (bind, start_load, per layer
wait_for_layer and save_layer, wait_for_save, finished) against a real kvstore-server on
this host (the shared pool: one Reserve a step, on the reserve thread, and one Commit at
a later step), over CPU caches of the 1B preset's shape (16 layers, 8 KV heads, head 64,
bf16, 16-token pages). Each layer's compute is a stand-in: a busy wait of `--layer-us`
holding the GIL, as the engine's launches do. Steps alternate, one without the
connector, then one with it; a figure is the median over `--steps` of each.

Two figures per length: with the CPU copies (torch copy_ per page slab: what a CPU engine
pays, far more than a kernel launch on CUDA) and with the copy itself left out (the
connector's own planning, bookkeeping and calls alone: what the hooks cost an engine
whose copies are one launch).

    kvstore-bench hooks [--tokens 256,1024] [--steps 40] [--layer-us 400]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import numpy as np
import torch

from kvstore_client import PageLayout
from kvstore_connector.config import ConnectorConfig
from kvstore_connector.meta import SaveSpec, StepMeta
from kvstore_connector.transfer import copies
from kvstore_connector.worker import WorkerHalf
from kvstore_testing.serverproc import ServerProcess

__all__ = ["main"]

LAYOUT = PageLayout(model="bench-hooks-1b", num_layers=16, page_tokens=16, num_kv_heads=8,
                    head_size=64, dtype="bfloat16")
BLOCK = 16
HOOKS = ("bind", "start_load", "save_layer", "wait_for_save", "finished")


def _spin(us: float) -> None:
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


@contextlib.contextmanager
def _no_copies(on: bool):
    """The CPU copy of a layer left out (the connector's host work alone)."""
    real = copies.copy_layer
    if on:
        copies.copy_layer = lambda *args, **kwargs: None
    try:
        yield
    finally:
        copies.copy_layer = real


class _Steps:
    """One worker half over CPU caches and the steps it runs."""

    def __init__(self, address: str, tokens: int) -> None:
        self.pages = tokens // LAYOUT.page_tokens
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYOUT.num_layers)]
        shape = (2, self.pages + 8, BLOCK, LAYOUT.num_kv_heads, LAYOUT.head_size)
        caches = {n: torch.zeros(shape, dtype=torch.bfloat16) for n in self.names}
        self.worker = WorkerHalf(ConnectorConfig(server=address, timeout=5.0,
                                                 shared_memory=True), LAYOUT, caches)
        self.blocks = np.arange(self.pages, dtype=np.int64).reshape(-1, 1)
        self.n = 0

    def step(self, layer_us: float, connector: bool) -> tuple[float, dict[str, float]]:
        """One miss+save step (or the same forward without hooks): its seconds, and the
        seconds inside each hook."""
        spent = dict.fromkeys(HOOKS, 0.0)
        w = self.worker
        t = time.perf_counter
        start = t()
        if connector:
            self.n += 1
            keys = tuple(f"hooks-{self.n}-{i}".encode().ljust(32, b".")
                         for i in range(self.pages))
            meta = StepMeta(saves=(SaveSpec(f"r{self.n}", keys, self.blocks),))
            a = t()
            w.bind(meta)
            b = t()
            w.start_load(meta)
            c = t()
            spent["bind"] += b - a
            spent["start_load"] += c - b
        for name in self.names:
            _spin(layer_us)
            if connector:
                a = t()
                w.wait_for_layer(name)
                w.save_layer(name)
                spent["save_layer"] += t() - a
        if connector:
            a = t()
            w.wait_for_save()
            b = t()
            w.finished()
            w.sent([f"r{self.n}"])
            spent["wait_for_save"] += b - a
            spent["finished"] += t() - b
        return t() - start, spent

    def close(self) -> None:
        self.worker.close()


def run(tokens: list[int], steps: int, layer_us: float) -> list[dict]:
    # One thread for torch's CPU copies, as an engine's host thread is one: on a shared
    # machine torch's thread pool made the copies' time swing from run to run.
    torch.set_num_threads(1)
    out = []
    with ServerProcess(dram="1GiB").start(wait=60) as srv:
        for n in tokens:
            for stub in (False, True):
                rig = _Steps(srv.address, n)
                try:
                    with _no_copies(stub):
                        for _ in range(3):                  # warm: first plans, threads
                            rig.step(layer_us, True)
                        base: list[float] = []
                        conn: list[float] = []
                        hooks: dict[str, list[float]] = {h: [] for h in HOOKS}
                        for _ in range(steps):
                            base.append(rig.step(layer_us, False)[0])
                            took, spent = rig.step(layer_us, True)
                            conn.append(took)
                            for h in HOOKS:
                                hooks[h].append(spent[h])
                finally:
                    rig.close()
                out.append({"tokens": n, "copies": not stub,
                            "base_us": statistics.median(base) * 1e6,
                            "step_us": statistics.median(conn) * 1e6,
                            "hooks_us": {h: statistics.median(v) * 1e6
                                         for h, v in hooks.items()}})
    return out


def report(rows: list[dict], steps: int, layer_us: float, load: tuple[float, float]) -> str:
    lines = [f"1B-shaped pages ({LAYOUT.num_layers} layers, {LAYOUT.layer_bytes // 1024} KiB "
             f"a layer slab), CPU caches, shared pool; a miss that saves every page; each "
             f"layer's compute a {layer_us:.0f} us busy wait; medians of {steps} steps of each "
             "side, alternated", "",
             "| tokens | copies | step without | step with | connector per step | "
             + " | ".join(HOOKS) + " |",
             "|---|---|---|---|---|" + "---|" * len(HOOKS)]
    for r in rows:
        lines.append(f"| {r['tokens']} | {'cpu' if r['copies'] else 'left out'} | "
                     f"{r['base_us']:.0f} | {r['step_us']:.0f} | "
                     f"{r['step_us'] - r['base_us']:.0f} | "
                     + " | ".join(f"{r['hooks_us'][h]:.0f}" for h in HOOKS) + " |")
    lines += ["", "(us; connector per step = step with - step without)",
              f"load average (1 min) at start / end: {load[0]:.1f} / {load[1]:.1f}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvstore-bench hooks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="256,1024", help="comma-separated prompt lengths")
    p.add_argument("--steps", type=int, default=40, help="steps of each side")
    p.add_argument("--layer-us", type=float, default=400.0,
                   help="each layer's stand-in compute (a 1B forward at 1k tokens on an "
                   "H100 is about 9 ms over 16 layers)")
    p.add_argument("--quick", action="store_true", help="256 tokens, 8 steps")
    args = p.parse_args(argv)
    tokens = [256] if args.quick else [int(x) for x in args.tokens.split(",") if x]
    steps = 8 if args.quick else args.steps
    if steps < 1 or args.layer_us < 0 or any(t < LAYOUT.page_tokens
                                             or t % LAYOUT.page_tokens for t in tokens):
        p.error(f"steps >= 1, layer-us >= 0, tokens multiples of {LAYOUT.page_tokens}")
    before = os.getloadavg()[0]
    rows = run(tokens, steps, args.layer_us)
    print(report(rows, steps, args.layer_us, (before, os.getloadavg()[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
