"""Page slabs <-> paged KV caches: the connector's one package of streams, events and kernels.

Lifecycle (one KVTransfer per worker, used from the engine's thread; not thread-safe)::

    reg = HostRegistration(client.region().mem)     once at attach: cudaHostRegister the
                                                    whole pool mapping (never per request)
    xfer = KVTransfer([kv5(t, kind) for t in caches], page_tokens, device)

    load:  acq = client.acquire(ns, keys)           pages pinned in the pool
           h = xfer.load(pool, acq.offsets, ns.layer_bytes, block_ids)
                                                    every layer enqueued on the load stream,
                                                    one event per layer; returns at once
           h.wait_layer(l)                          before layer l's attention: the CURRENT
                                                    stream waits on layer l's event only
           h.done() / h.synchronize()               then acq.release()
    load, layer by layer (no shared pool: connector.worker.remote):
           xfer.order_loads()                       engine's thread: the load stream waits
                                                    for the current stream's work so far
           b = xfer.load_blocks(block_ids)          then, on the receiving thread, as each
           ev = xfer.load_layer(l, slab, b)         layer's slab (pages back to back) lands:
                                                    its copy on the load stream, its event;
                                                    the current stream waits on ev
    save:  res = client.reserve(ns, keys)           offsets, -1 = already stored
           xfer.save_layer(l, pool, res.offsets, block_ids)   after layer l wrote its KV:
                                                    the save stream waits for the current
                                                    stream's work so far, then copies out
           (or b = xfer.save_batch(pool, res.offsets, block_ids) once, then
            xfer.save_into(b, l) per layer: the pages checked and planned once)
           h = xfer.finish_save(wait=False)         a handle on every save enqueued since
                                                    the last finish_save (one event);
           h.done() / h.synchronize()               then res.commit()
           xfer.fence_saves()                       the current stream waits (on the device)
                                                    for the saves in flight before it reuses
                                                    the blocks they read
    reg.close()                                     at detach

`block_ids` is (pages, k) int64: page p's tokens [j*block_size, (j+1)*block_size) live in
engine block block_ids[p, j]; page_tokens = k * block_size. A page in host memory is
num_layers slabs back to back, a slab [kv_factor, page_tokens, kv_heads, head_size]
contiguous (kvstore_protocol.layout.PageLayout); the caches are kv5 views
[kv_factor, blocks, block_size, kv_heads, head_size] (connector.kvviews).

How a layer moves, and why (docs/connector.md has the measurements):
a layer's slabs of P pages sit at P scattered places in the pool (page p's slab at
offsets[p] + l * layer_bytes), 64 KiB each for an 8B-shaped 16-token page. One cudaMemcpy
per slab is slow at that size, and a pinned staging copy needs the slabs contiguous in
host memory first (a CPU gather, no faster than memcpy). So the GPU path is one Triton
kernel per layer that reads the registered pool directly through its UVA address and
writes each head straight into its engine block (for saves the reverse: reads the blocks,
writes the pool) -- no staging buffer, no CPU copy, one launch per layer
(CopyMethod.KERNEL).

What the kernel leaves on loads is the SMs' own PCIe reads against the copy engine's
DMA. The kernel is capped at a number of persistent programs: 32 for saves and for loads
of rows of 256 bytes or more, more for shorter rows, whose reads move less a program
(kernel.load_ctas). Few as they are, they hold their SMs for as long as the bytes take on
PCIe, and the model's GEMMs (persistent kernels that want every SM) wait behind them: a
copy by the kernel does not overlap the forward (core._DMA_SAVE_MIN_RUN).

So a load whose pages lie in runs of adjacent slots (the usual case: a request's pages
are reserved together) and whose layers reach 4 MiB goes by the copy engine instead
(CopyMethod.DMA), in pieces of ~8 MiB: per piece, one cudaMemcpy2DAsync per run (rows of
the piece's layers of one page, back to back in the pool; pitch page_bytes) into a device
staging buffer, then the same kernel scatters the buffer into the blocks, device to
device, on a second stream while the next piece copies. At 16k tokens of the 8B preset a
load so reaches 98% of a pinned cudaMemcpy (docs/perf/load-e21a8ae119.json).

Saves of layers of 4 MiB and up whose pages lie in runs go the same way in reverse, in
pieces of ~8 MiB launched as their layers are computed: the kernel gathers a piece's
layers into a device staging buffer (microseconds, device to device), and a 2D copy per
run writes it to the pool, so the bytes cross PCIe without holding the SMs the forward is
using (core._DMA_SAVE_MIN_RUN says when).

On CPU tensors (CI) and with CopyMethod.COPIES the same API runs torch copies: per
slab `copy_` into a staging tensor and one indexed write per layer (and the reverse);
there are no streams on CPU and every call completes before it returns.

The package, one idea a module: `plan` (geometry and page checks: numpy, no device),
`runtime` (CUDA runtime calls, host registration, pinned buffers, events), `handles`
(what a caller waits on), `kernel` (the Triton copy kernel and its launch), `copies`
(torch copies: CPU and the CUDA fallback), `dma` (the copy-engine paths), `core`
(KVTransfer: streams, save bookkeeping and the choice of path).
"""

from .core import KVTransfer, SaveBatch
from .handles import LoadHandle, SaveHandle
from .plan import CopyMethod
from .runtime import HostRegistration, TransferError, pinned_empty

__all__ = ["CopyMethod", "HostRegistration", "KVTransfer", "LoadHandle", "SaveBatch",
           "SaveHandle", "TransferError", "pinned_empty"]
