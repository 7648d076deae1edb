# device probe (not committed): where the 16-token "rest" step's time goes
import sys, time, statistics, torch
from kvstore_bench.engine.model import LlamaModel, ModelConfig, PRESETS
from kvstore_bench.engine.paged_cache import allocate_kv_caches, SeqStep
torch.manual_seed(0)
cfg = PRESETS["8b"]
model = LlamaModel(cfg, device="cuda")
ctxs = [int(x) for x in sys.argv[1].split(",")] if len(sys.argv) > 1 else [256, 4096, 32768]
nblocks = max(ctxs) // 16 + 8
caches = allocate_kv_caches(model.cache_spec(nblocks, 16), dtype=model.dtype, device="cuda")
model.graphs.capture([16, 256])
import numpy as np
for ctx in ctxs:
    toks = np.random.randint(0, 1000, size=ctx).astype(np.int64)
    blocks = list(range(-(-ctx // 16)))
    hit = ctx - 16
    def step():
        out = model([SeqStep(toks[hit:], hit, blocks)], caches).logits.argmax(-1)
        return out.tolist()
    for _ in range(3): step()
    torch.cuda.synchronize()
    wall = []
    for _ in range(7):
        t0 = time.perf_counter(); step(); wall.append(time.perf_counter() - t0)
    # device time of one step
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    dev = []
    for _ in range(5):
        torch.cuda.synchronize(); s.record(); model([SeqStep(toks[hit:], hit, blocks)], caches); e.record(); e.synchronize(); dev.append(s.elapsed_time(e))
    # host time to enqueue (no sync)
    enq = []
    for _ in range(5):
        torch.cuda.synchronize(); t0 = time.perf_counter(); model([SeqStep(toks[hit:], hit, blocks)], caches); enq.append(time.perf_counter() - t0); torch.cuda.synchronize()
    print(f"ctx {ctx}: step wall {statistics.median(wall)*1e3:.2f} ms, device {statistics.median(dev):.2f} ms, host enqueue {statistics.median(enq)*1e3:.2f} ms", flush=True)
    if ctx == ctxs[0]:
        from torch.profiler import profile, ProfilerActivity
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
