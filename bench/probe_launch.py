# device probe (not committed): host cost of a load's launches
import time, statistics, torch, numpy as np, inspect
import triton
from kvstore_connector.transfer import KVTransfer
from kvstore_connector.transfer import kernel as K
print("triton", triton.__version__)
L, H, D, BS = 32, 8, 128, 16
nb = 4096
caches = [torch.zeros(2, nb, BS, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(L)]
page = L * 2 * 16 * H * D * 2
for pages in (15, 63, 255):
    host = torch.empty(pages * page + 4096, dtype=torch.uint8, pin_memory=True).numpy()
    x = KVTransfer(caches, 16, "cuda")
    offs = np.arange(pages, dtype=np.int64) * page
    blocks = np.random.permutation(nb)[:pages].astype(np.int64)
    for _ in range(3): x.load(host, offs, x.geo.layer_bytes, blocks).synchronize()
    ts = []
    for _ in range(9):
        torch.cuda.synchronize(); t0 = time.perf_counter(); h = x.load(host, offs, x.geo.layer_bytes, blocks); t1 = time.perf_counter(); h.synchronize(); t2 = time.perf_counter(); ts.append((t1 - t0, t2 - t0))
    print(f"pages {pages}: enqueue {statistics.median(a for a,b in ts)*1e3:.2f} ms, done {statistics.median(b for a,b in ts)*1e3:.2f} ms", flush=True)
    plan = x._plan(host, offs, blocks, save=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5): x._plan(host, offs, blocks, save=False)
    print(f"  plan+upload {(time.perf_counter()-t0)/5*1e6:.0f} us")
    t0 = time.perf_counter()
    for layer in range(0, L, 4):
        x._launch(layer, 4, plan, to_cache=True)
    t1 = time.perf_counter()
    print(f"  8 launches {(t1-t0)*1e6:.0f} us = {(t1-t0)/8*1e6:.1f} us each", flush=True)
    from kvstore_connector.transfer.kernel import _spec
    args = (plan.host_t, x._tables[0].base, x._tables[0].deltas, plan.meta, plan.meta, 5, 6, 7, 8, 9, 10, 11, 12)
    t0 = time.perf_counter()
    for _ in range(100): key = tuple(_spec(a) for a in args)
    print(f"  spec key {(time.perf_counter()-t0)*1e4:.1f} us")
    t0 = time.perf_counter()
    for _ in range(100): torch.cuda.current_stream().cuda_stream
    print(f"  current_stream {(time.perf_counter()-t0)*1e4:.1f} us")
    t0 = time.perf_counter()
    s = torch.cuda.current_stream()
    for layer in range(L):
        e = torch.cuda.Event(); e.record(s)
    print(f"  32 events {(time.perf_counter()-t0)*1e6:.0f} us")
    torch.cuda.synchronize()
