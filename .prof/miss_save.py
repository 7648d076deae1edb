"""Where a miss+save's extra time goes on the GPU: variants of the save path, side by side
with recompute in rounds, and a torch profiler of one miss (for development only)."""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

from kvstore_bench import e2e_bench
from kvstore_testing.serverproc import ServerProcess
import kvstore_connector.worker as worker_mod
import kvstore_connector.transfer.core as core_mod

OUT = os.environ.get("OUT", "/tmp/out")
p = argparse.ArgumentParser()
p.add_argument("--presets", default="1b,8b")
p.add_argument("--lens", default="1024,4096")
p.add_argument("--reps", type=int, default=9)
p.add_argument("--profile", action="store_true")
a = p.parse_args()

args = e2e_bench.main.__globals__  # noqa
parser_argv = ["--device", os.environ.get("DEV", "cuda"), "--preset", a.presets, "--prompt-lens", a.lens,
               "--reps", str(a.reps), "--disk", "0", "--multi", "0", "--decode-steps", "0"]

# Build the args namespace as the bench does.
import argparse as _ap
ns = None
orig_run = e2e_bench.run


def grab(args):
    global ns
    ns = args
    return {"ttft": []}


e2e_bench.run = grab
e2e_bench.report = lambda r: ""
e2e_bench.acceptance = lambda r: None
e2e_bench.main(parser_argv)
e2e_bench.run = orig_run

VARIANTS = {
    "base": {},
    "lead100": {"lead": 100},
    "dma_all": {"dma_min": 0},
    "ctas16": {"ctas": 16},
}

res = {}
srv = ServerProcess(dram="12GiB").start(wait=600)
try:
    for preset in ns.preset:
        bench = e2e_bench._Bench(ns, preset, srv.address, clear=True)
        bench.warm_up()
        xfer = bench.store.worker_half.transfer
        base_ctas = xfer.save_ctas
        for n in ns.prompt_lens:
            tokens = bench.prompt(n)
            store = bench.engine(True)
            for name, v in VARIANTS.items():
                worker_mod._SAVE_LEAD_HOOKS = v.get("lead", 2)
                core_mod._DMA_SAVE_MIN_LAYER_BYTES = v.get("dma_min", 4 << 20)
                core_mod._DMA_SAVE_MIN_RUN = 0 if "dma_min" in v else 4
                xfer.save_ctas = v.get("ctas", base_ctas)
                point, _ = bench.rounds(tokens, ns.reps, store)
                key = f"{preset} {n} {name}"
                res[key] = {"recompute": point["recompute_s"] * 1e3,
                            "miss": point["miss_save_s"] * 1e3,
                            "hit": point["dram_hit_s"] * 1e3,
                            "ratio": point["miss_save_ratio"]}
                print(key, json.dumps(res[key]), flush=True)
            worker_mod._SAVE_LEAD_HOOKS = 2
            core_mod._DMA_SAVE_MIN_LAYER_BYTES = 4 << 20
            core_mod._DMA_SAVE_MIN_RUN = 4
            xfer.save_ctas = base_ctas
            if a.profile and preset == "1b" and n == 1024:
                from torch.profiler import ProfilerActivity, profile
                rec = bench.engine(False)
                for mode in ("recompute", "miss"):
                    eng = rec if mode == "recompute" else store
                    for _ in range(3):
                        bench.clear()
                        bench.serve(eng, [tokens])
                    bench.clear()
                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                        bench.serve(eng, [tokens])
                    prof.export_chrome_trace(f"{OUT}/trace_{mode}.json")
                    with open(f"{OUT}/prof_{mode}.txt", "w") as f:
                        f.write(prof.key_averages().table(sort_by="self_cpu_time_total",
                                                          row_limit=60))
        bench.close()
        torch.cuda.is_available() and torch.cuda.empty_cache()
finally:
    srv.__exit__(None, None, None)
with open(f"{OUT}/variants.json", "w") as f:
    json.dump(res, f, indent=1)
