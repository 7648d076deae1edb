"""KVTransfer: one worker's streams, its save bookkeeping and the choice of copy path.

Over 400 lines because loads and saves share the streams, the launch grouping, the layer
table and the checked plans, and the choice of path for each is made here from the
constants below (about 50 lines, each with its reason); the paths themselves are
modules beside it (kernel, dma, copies).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import torch

from . import copies, kernel
from .dma import DEFAULT_STAGING_BYTES, DmaLoader, DmaSaver
from .handles import LoadHandle, SaveHandle
from .plan import CopyMethod, Plan, as_tensor, check_pages, geometry, page_runs
from .runtime import on_device, on_stream, query, record
from .uploads import IndexUploads

__all__ = ["KVTransfer", "SaveBatch"]

# When a load goes by the copy engine (dma.py): only when its pages form runs of at least
# this many on average (a lone 64 KiB slab copies too slowly by DMA to pay for it) ...
_DMA_MIN_RUN = 8
# ... and only when a layer of the load is this large: the DMA path costs the host a 2D
# copy per run, a scatter launch and events per piece (_DMA_LOAD_PIECE_BYTES), which a
# short load does not earn back. At 1,024 tokens of the 8B preset (4 MiB a layer) a load
# reaches 92% of a pinned copy (docs/perf/load-e21a8ae119.json).
_DMA_MIN_LAYER_BYTES = 4 << 20
# Saves go by the copy engine on CUDA when their pages form runs of this many on average
# and a layer of the save is at least _DMA_SAVE_MIN_LAYER_BYTES (dma.DmaSaver says why): a
# kernel save holds SMs for as long as its bytes take on PCIe, while the forward's GEMMs
# are persistent kernels that want every SM. But a DMA piece costs the host more, and a
# short prompt's forward is bound by the host: below 4 MiB a layer neither path won
# clearly in interleaved runs, so saves that short stay on the kernel.
_DMA_SAVE_MIN_RUN = 4
_DMA_SAVE_MIN_LAYER_BYTES = 4 << 20
# A DMA save goes out in pieces of about this many bytes, each launched by the hook of its
# last layer: the pieces' copies trail the forward by one piece, so the step's first token
# (whose D2H copy queues behind them on the copy engine) waits for at most one. Each piece
# costs the host a gather, two events and a 2D copy, so smaller pieces trade host time for
# a shorter tail.
_DMA_SAVE_PIECE_BYTES = 8 << 20
# Layers one kernel launch covers (loads and saves by the kernel): at least _GROUP, and
# more while a launch would move under _LAUNCH_BYTES. A launch costs about as much host
# time as a short load's layer needs on PCIe, so launching per layer made short loads
# launch-bound. A wait for layer l waits for its group: at most a launch's bytes more, and
# loads large enough for a group to matter go by DMA, layer by layer. Below a few thousand
# tokens a hit is bound by the host (the engine's launches and the connector's calls), not
# by the copies (the breakdown in docs/perf/e2e-ec25c98d81.json).
_GROUP = 4
_LAUNCH_BYTES = 16 << 20
# Saves wait for nothing of theirs (the next step fences on them), so their launches may
# be larger: a group is launched by its last layer's hook.
_SAVE_LAUNCH_BYTES = 64 << 20
# Programs of a DMA load's scatter (staging -> blocks, on the device): 0 = one per tile.
_SCATTER_CTAS = 0
# A DMA load goes in pieces of about this many bytes: a piece's layers of a run of adjacent
# pages in one 2D copy, scattered by one launch (each piece costs the host a 2D copy per
# run, a launch and two events). A layer's wait is for its piece. Larger pieces cost fewer
# launches but hold the forward longer at its first layers; 8 MiB gave the faster hits of
# the sizes tried at 1,024 and 4,096 tokens.
_DMA_LOAD_PIECE_BYTES = 8 << 20
# A copy-engine piece covers at least this many bytes of a page (its row in the 2D copy):
# layers lie back to back in a pool page, so a piece of several layers is one wider row.
# The copy engine moved the 1B preset's 32 KiB layer rows out of and into the registered
# pool at about 46 GB/s where 64 KiB rows went at the pinned copy's 55 (H100). With two
# layers a row, 1B loads by the copy engine reached 50 / 53 / 53 GB/s at 4k / 16k / 32k
# tokens against 35 / 41 / 44 by the kernel's 128-byte reads, and saves 49 / 52 / 53
# against 43 with one layer a row, all in one run beside a 54-55 GB/s pinned copy.
_DMA_MIN_ROW_BYTES = 64 << 10
# Programs of a DMA save's gather (blocks -> staging, on the device): 0 = one per tile, so
# the gather is over in microseconds and holds no SM for long (see DmaSaver).
_GATHER_CTAS = 0

# A save's pages as save_layer is handed them, layer after layer: the host array's
# identity and every offset and block id (checked and uploaded once per finish_save).
_SaveKey = tuple[int, bytes, bytes, tuple[int, ...]]


@dataclasses.dataclass(slots=True)
class SaveBatch:
    """One save's pages, checked, planned and uploaded once (KVTransfer.save_batch), until
    the next finish_save: each layer's hook then costs the host a few attribute reads, no
    array hashing or dict lookups (a short prompt's forward is bound by the host)."""

    plan: Plan                                # checked pages, index uploaded
    runs: list[tuple[int, int]] | None        # its runs of adjacent pages if it goes by
                                              # DMA; None: by the kernel
    group: int                                # layers one launch (or DMA piece) covers
    epoch: int                                # the finish_save period it belongs to
    held: tuple[int, int] | None = None       # [first, last] layers saved, not launched


class KVTransfer:
    """Moves page slabs between host memory and the engine's paged caches, layer by layer.

    layers: kv5 views in layer order (connector.kvviews.kv5), all of one shape and dtype;
    page_tokens: tokens per store page (a multiple of the views' block_size);
    device: where the views live. max_ctas caps the kernel's programs (0 = one per tile;
    None = by the rows' length for loads, kernel.load_ctas, and DEFAULT_MAX_CTAS for saves);
    method: None = KERNEL on CUDA, COPIES on CPU.
    """

    def __init__(self, layers: Sequence[torch.Tensor], page_tokens: int,
                 device: torch.device | str | None = None, *,
                 max_ctas: int | None = None, method: CopyMethod | None = None,
                 staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        self.layers = list(layers)
        self.geo = geometry(self.layers, page_tokens)
        self.device = torch.device(device) if device is not None else self.layers[0].device
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.layers[0].device != self.device:
            raise ValueError(f"the views are on {self.layers[0].device}, not {self.device}")
        self.cuda = self.device.type == "cuda"
        self.method = method or (CopyMethod.KERNEL if self.cuda else CopyMethod.COPIES)
        if self.method in (CopyMethod.KERNEL, CopyMethod.DMA) and not kernel.available():
            raise ValueError(f"{self.method} needs Triton")
        if self.method is CopyMethod.DMA and not self.cuda:
            raise ValueError("CopyMethod.DMA needs a CUDA device")
        # Unless a method was named, a CUDA load of pages in runs goes by DMA.
        self._dma_auto = method is None and self.cuda
        self._dma = DmaLoader(self.device, staging_bytes)
        self._dma_saver = DmaSaver(self.device, staging_bytes)
        self.load_ctas = kernel.load_ctas(self.geo.unit) if max_ctas is None else max_ctas
        self.save_ctas = kernel.DEFAULT_MAX_CTAS if max_ctas is None else max_ctas
        # Byte views: strides in bytes, a uint8 pointer for the kernel.
        self._bytes = [v.view(torch.uint8) for v in self.layers]
        self._cache_align = math.gcd(self.geo.unit, *(s for b in self._bytes
                                                      for s in b.stride()[:4]),
                                     *(b.data_ptr() for b in self._bytes))
        # One launch covers _GROUP layers when the caches share their strides, else one.
        self._tables: list[kernel.LayerTable] = []
        self._group = 1
        if self.method is not CopyMethod.COPIES:
            try:
                self._tables = [kernel.LayerTable(self._bytes)]
                self._group = _GROUP
            except ValueError:
                self._tables = [kernel.LayerTable([b]) for b in self._bytes]
        self._load_stream = self._save_stream = None
        if self.cuda:
            # Loads gate the model's layers: high priority, so their programs are
            # scheduled ahead of queued compute work. Saves have slack until finish_save.
            self._load_stream = torch.cuda.Stream(self.device, priority=-1)
            self._save_stream = torch.cuda.Stream(self.device)
        # The kernel's page offsets and block ids, on the stream that reads them.
        self._load_uploads = IndexUploads(self.device, self._load_stream) if self.cuda \
            else None
        self._save_uploads = IndexUploads(self.device, self._save_stream) if self.cuda \
            else None
        self._pending_saves = False       # save_layer since the last finish_save
        self._pending_keep: list = []     # what those saves read or write
        self._saves: dict[_SaveKey, SaveBatch] = {}     # save_layer's, until finish_save
        self._batches: list[SaveBatch] = []     # every batch until finish_save
        self._save_epoch = 0                    # finish_save calls so far
        self._dma_saved = False           # a DMA save since the last finish_save
        self._last_save = None            # the newest save event (fence_saves)
        # Recorded on the engine's stream and waited for at once by the load stream
        # (loads) and the save stream (save flushes): _after_current.
        self._load_mark = torch.cuda.Event() if self.cuda else None
        self._save_mark = torch.cuda.Event() if self.cuda else None
        # behind(): events recorded in turn where the current stream was at its last calls
        # (kept, not made anew: an event made and destroyed per call is two more driver
        # calls per layer), and how many calls of this step they mark.
        self._marks: list = []
        self._marked = 0

    # -- loads ---------------------------------------------------------------------------
    def load(self, host: np.ndarray, offsets: np.ndarray, layer_bytes: int,
             block_ids: np.ndarray) -> LoadHandle:
        """Enqueue every layer of pages at `offsets` in `host` into `block_ids`.

        On CUDA the load stream first waits for the current stream's work so far (the
        blocks may have been in use), then copies layer by layer; the host memory must be
        registered (HostRegistration) or pinned, and stay untouched until done(). Keep the
        handle until then: it holds what the copies read.
        """
        if layer_bytes != self.geo.layer_bytes:
            raise ValueError(f"layer_bytes {layer_bytes} does not match the caches: "
                             f"{self.geo.layer_bytes} per layer of a {self.geo.page_tokens}-"
                             f"token page")
        offsets, block_ids = check_pages(self.geo, len(self.layers), host, offsets,
                                         block_ids, save=False)
        runs = self._dma_load_runs(offsets)
        if runs is not None:
            # Host work before the first copy is on a short load's critical path (the
            # device has nothing else to do): the load stream waits for the current one
            # without becoming current, and the copy engine's first two pieces go out
            # before the block ids go up and before any context (dma.DmaLoader.load). The
            # host's speed varies from process to process more than such a change moves a
            # load, so changes here are timed against the code before them in one
            # process, turn by turn (dma.py).
            assert self._load_stream is not None     # DMA is for CUDA alone
            self._after_current(self._load_stream, self._load_mark)
            layer_events, blocks = self._dma.load(
                # A tensor's address is cheaper to read than an array's (ctypes).
                self.geo, len(self.layers), as_tensor(host).data_ptr(), offsets, runs,
                block_ids, self._load_stream, self._cache_align,
                self._scatter, self._dma_load_group(len(offsets)),
                lambda first: self._table(first)[1] * self.geo.layer_bytes)
            return LoadHandle(self.device, layer_events, (host, blocks))
        events: list = []
        with on_stream(self._load_stream, self.device):
            if self._load_uploads is not None:
                self._load_uploads.reset()    # the last load's launches are all queued
            plan = self._checked_plan(host, offsets, block_ids, self._load_uploads)
            if self.method is CopyMethod.COPIES:
                for layer in range(len(self.layers)):
                    copies.copy_layer(self.geo, self.layers[layer], layer, plan,
                                      to_cache=True, device=self.device)
                    events.append(record(self._load_stream))
            else:
                group = self._layers_per_launch(len(offsets))
                for first in range(0, len(self.layers), group):
                    count = min(group, len(self.layers) - first)
                    self._launch(first, count, plan, to_cache=True)
                    events += [record(self._load_stream)] * count
        return LoadHandle(self.device, events if self.cuda else None, (plan,))

    def order_loads(self) -> None:
        """Make the load stream wait (on the device) for the current stream's work so far,
        so that copies enqueued later by load_layer, from another thread, land in blocks
        the engine is done with. Call it on the engine's thread; nothing on CPU."""
        if self._load_stream is not None:
            self._after_current(self._load_stream, self._load_mark)

    def load_blocks(self, block_ids: np.ndarray) -> torch.Tensor:
        """block_ids (pages, k) checked as a load's are (plan.check_pages), on the device,
        for load_layer."""
        block_ids = np.asarray(block_ids, dtype=np.int64)
        pages = len(block_ids) if block_ids.ndim else 0
        # A page's layer alone is checked: the offsets are the slab's rows.
        _, block_ids = check_pages(self.geo, 1, np.empty(self.geo.layer_bytes, np.uint8),
                                   np.zeros(pages, np.int64), block_ids, save=False)
        # On the load stream, where load_layer reads them: no wait for the engine's.
        with on_device(self.device), on_stream(self._load_stream, None):
            return torch.from_numpy(block_ids).to(self.device, non_blocking=True)

    def load_layer(self, layer: int, slab: np.ndarray, blocks: torch.Tensor):
        """Copy layer `layer` of P pages, back to back in `slab` ((P, layer_bytes) uint8,
        pinned), into the blocks `blocks` (load_blocks); the event of the copy is returned
        (None on CPU, where it has landed on return). `slab` must stay untouched until it.

        For pages that arrive layer by layer (connector.worker.remote), from a thread other
        than the engine's: the copy goes on the load stream without waiting for the
        calling thread's stream (order_loads, on the engine's thread, did that). The slab
        is contiguous, so it crosses PCIe as one copy by the copy engine into device
        memory, then one indexed write per K and V puts each page in its blocks on the
        device: torch calls only, no kernel launched from this thread.
        """
        geo = self.geo
        if not 0 <= layer < len(self.layers):
            raise IndexError(f"layer {layer} out of range [0, {len(self.layers)})")
        pages = blocks.shape[0]
        if slab.dtype != np.uint8 or slab.shape != (pages, geo.layer_bytes):
            raise ValueError(f"slab must be uint8 of shape {(pages, geo.layer_bytes)}, got "
                             f"{slab.dtype} {slab.shape}")
        view = self.layers[layer]
        with on_device(self.device), on_stream(self._load_stream, None):
            src = as_tensor(slab).to(self.device, non_blocking=True)
            kv = src.view(geo.dtype).view(pages, geo.kv, geo.k, geo.block_size, geo.heads,
                                          geo.head)
            for c in range(geo.kv):
                view[c][blocks] = kv[:, c]
            return record(self._load_stream)

    def _scatter(self, staging: torch.Tensor, first: int, count: int, pages: int,
                 offs: torch.Tensor, blocks: torch.Tensor, align: int, stream: int) -> None:
        # From device memory: no PCIe to share, so no cap on the programs (the load cap is
        # for reads over PCIe). The last layer's scatter is on a hit's critical path, and
        # a long load's layers are large.
        table, at = self._table(first)
        kernel.launch(self.geo, table, at, count, staging, pages, offs, blocks,
                      self.geo.layer_bytes, align, True, _SCATTER_CTAS, stream)

    def _dma_load_runs(self, offsets: np.ndarray) -> list[tuple[int, int]] | None:
        """The runs of adjacent pages of a load that goes by the copy engine (dma.py), or
        None for a load by the kernel (_DMA_MIN_RUN, _DMA_MIN_LAYER_BYTES).
        Short rows (the 1B preset's 128-byte head rows) go this way too: the scatter
        reorders them device to device, and the copy engine's rows are whole layers
        (_DMA_MIN_ROW_BYTES)."""
        pages = len(offsets)
        if self.method is CopyMethod.DMA:
            return page_runs(offsets, len(self.layers) * self.geo.layer_bytes)
        if not (self._dma_auto and pages * self.geo.layer_bytes >= _DMA_MIN_LAYER_BYTES):
            return None
        runs = page_runs(offsets, len(self.layers) * self.geo.layer_bytes)
        return runs if runs and pages >= _DMA_MIN_RUN * len(runs) else None

    def _dma_load_group(self, pages: int) -> int:
        """Layers one piece of a DMA load covers (_DMA_LOAD_PIECE_BYTES; one layer where
        the layers' caches do not share a table, as a scatter writes one table)."""
        if len(self._tables) != 1:
            return 1
        need = -(-_DMA_LOAD_PIECE_BYTES // max(1, pages * self.geo.layer_bytes))
        return min(len(self.layers), max(need, -(-_DMA_MIN_ROW_BYTES // self.geo.layer_bytes)))

    def _layers_per_launch(self, pages: int, launch_bytes: int = _LAUNCH_BYTES) -> int:
        """Layers one kernel launch of `pages` pages covers (_GROUP, _LAUNCH_BYTES)."""
        if self._group == 1:
            return 1
        need = -(-launch_bytes // max(1, pages * self.geo.layer_bytes))
        return min(len(self.layers), max(self._group, need))

    def _save_group(self, pages: int, runs: list[tuple[int, int]] | None) -> int:
        """Layers one kernel launch of a save covers (_SAVE_LAUNCH_BYTES), or one piece
        of a DMA save (_DMA_SAVE_PIECE_BYTES; one layer where the layers' caches do not
        share a table, as the gather reads one table)."""
        if runs is None:
            return self._layers_per_launch(pages, _SAVE_LAUNCH_BYTES)
        if len(self._tables) != 1:
            return 1
        need = -(-_DMA_SAVE_PIECE_BYTES // max(1, pages * self.geo.layer_bytes))
        return min(len(self.layers), max(need, -(-_DMA_MIN_ROW_BYTES // self.geo.layer_bytes)))

    def _table(self, layer: int) -> tuple[kernel.LayerTable, int]:
        """The layer table holding `layer`, and the layer's index in it."""
        if len(self._tables) == 1:
            return self._tables[0], layer
        return self._tables[layer], 0

    def _launch(self, first: int, count: int, plan: Plan, *, to_cache: bool,
                stream=None) -> None:
        """The kernel over layers [first, first + count) of the plan's pages, on `stream`
        (a torch.cuda.Stream; None: the current stream)."""
        pages = len(plan.offsets)
        if not pages:
            return
        table, at = self._table(first)
        meta = plan.meta
        assert meta is not None             # the plan makes it for the kernel path
        kernel.launch(self.geo, table, at, count, plan.host_t, pages, meta[:pages],
                      meta[pages:], self.geo.layer_bytes, plan.align, to_cache,
                      self.load_ctas if to_cache else self.save_ctas,
                      None if stream is None else stream.cuda_stream)

    # -- saves ---------------------------------------------------------------------------
    def save_layer(self, layer: int, host: np.ndarray, offsets: np.ndarray,
                   block_ids: np.ndarray) -> None:
        """Copy layer `layer` of the pages in `block_ids` to `host` at `offsets` (-1: skip).

        On CUDA the copy runs on the save stream after the current stream's work so far
        (the layer's KV was just written there), launched with the layers after it in its
        group of consecutive layers (the group's last layer, or finish_save, launches
        them; a layer's KV is not rewritten within a step); finish_save() waits for the
        copies.
        """
        if not 0 <= layer < len(self.layers):
            raise IndexError(f"layer {layer} out of range [0, {len(self.layers)})")
        # Called once per layer with the same pages: check and upload them once per
        # finish_save. The key holds the host array's identity and every value (a caller
        # that holds the pages' batch, save_batch, skips this per layer).
        offsets = np.asarray(offsets, dtype=np.int64)
        block_ids = np.asarray(block_ids, dtype=np.int64)
        key = (id(host), offsets.tobytes(), block_ids.tobytes(), block_ids.shape)
        batch = self._saves.get(key)
        if batch is None or batch.plan.host is not host:
            if batch is not None and batch.held is not None:
                self._flush_save(batch)       # another array under a reused id
            batch = self._saves[key] = self.save_batch(host, offsets, block_ids)
        self.save_into(batch, layer)

    def save_batch(self, host: np.ndarray, offsets: np.ndarray,
                   block_ids: np.ndarray) -> SaveBatch:
        """The pages of one save (as save_layer takes them), checked and their index
        uploaded once for every layer: save_into(batch, layer) per layer until the next
        finish_save. ValueError says what is wrong with them."""
        plan = self._plan(host, offsets, block_ids, save=True, uploads=self._save_uploads)
        runs = self._dma_save_runs(plan)
        batch = SaveBatch(plan, runs, self._save_group(len(plan.offsets), runs),
                          self._save_epoch)
        self._batches.append(batch)
        return batch

    def save_into(self, batch: SaveBatch, layer: int) -> None:
        """save_layer of the batch's pages (save_batch); the batch is good until the next
        finish_save, which launches what it holds."""
        if not 0 <= layer < len(self.layers):
            raise IndexError(f"layer {layer} out of range [0, {len(self.layers)})")
        if batch.epoch != self._save_epoch:
            raise ValueError("a save batch is good until the next finish_save only")
        if self.method is CopyMethod.COPIES:
            with on_stream(self._save_stream, self.device):
                copies.copy_layer(self.geo, self.layers[layer], layer, batch.plan,
                                  to_cache=False, device=self.device)
            self._saved(batch.plan)
            return
        held = batch.held
        if held is not None and layer != held[1] + 1:
            self._flush_save(batch)           # not the next layer: launch what is held
            held = None
        first = layer if held is None else held[0]
        batch.held = (first, layer)
        if layer - first + 1 >= batch.group or layer == len(self.layers) - 1:
            self._flush_save(batch)

    def _dma_save_runs(self, plan: Plan) -> list[tuple[int, int]] | None:
        """The runs of adjacent pages of a save that goes by the copy engine, or None for
        a save by the kernel (_DMA_SAVE_MIN_RUN, _DMA_SAVE_MIN_LAYER_BYTES)."""
        if not (self.method is CopyMethod.DMA or self._dma_auto):
            return None
        runs = page_runs(plan.offsets, len(self.layers) * self.geo.layer_bytes)
        if runs and (self.method is CopyMethod.DMA or (
                len(plan.offsets) >= _DMA_SAVE_MIN_RUN * len(runs)
                and len(plan.offsets) * self.geo.layer_bytes >= _DMA_SAVE_MIN_LAYER_BYTES)):
            return runs
        return None

    def _flush_save(self, batch: SaveBatch) -> None:
        assert batch.held is not None
        (first, last), batch.held = batch.held, None
        plan, runs = batch.plan, batch.runs
        group = batch.group
        save = self._save_stream
        assert save is not None             # COPIES saves never get here
        # A flush is a save piece's fixed host cost, once per piece, and a short save is
        # bound by it: no stream context (every launch and copy below names its stream)
        # and one kept event for the wait.
        self._after_current(save, self._save_mark)
        with on_device(self.device) if self._other_device() else contextlib.nullcontext():
            for at in range(first, last + 1, group):
                count = min(last + 1 - at, group)
                if runs is None:
                    self._launch(at, count, plan, to_cache=False, stream=save)
                    continue
                self._dma_saver.save(self.geo, len(self.layers), plan, runs, at, count,
                                     self._table(at)[1] * self.geo.layer_bytes,
                                     save, self._cache_align, self._gather)
                self._dma_saved = True
        self._saved(plan)

    def _other_device(self) -> bool:
        """Whether this thread's current CUDA device is not the caches' (then the launches
        need a device context)."""
        return torch.cuda.current_device() != self.device.index

    def _gather(self, staging: torch.Tensor, first: int, count: int, pages: int,
                offs: torch.Tensor, blocks: torch.Tensor, align: int, stream: int) -> None:
        table, at = self._table(first)
        kernel.launch(self.geo, table, at, count, staging, pages, offs, blocks,
                      self.geo.layer_bytes, align, False, _GATHER_CTAS, stream)

    def _saved(self, plan: Plan) -> None:
        # No event per launch: one stream runs the saves in order, so the one event
        # finish_save records covers them all (an event costs the host time).
        self._pending_saves = True
        if not self._pending_keep or self._pending_keep[-1] is not plan:
            self._pending_keep.append(plan)

    def finish_save(self, wait: bool = True) -> SaveHandle:
        """A handle on every save enqueued since the last call; wait=True blocks until they
        have landed (TransferError if one failed)."""
        for batch in self._batches:
            if batch.held is not None:
                self._flush_save(batch)
        events, keep = [], tuple(self._pending_keep)
        if self._dma_saved:
            # The copies out run on the saver's stream: the one event covers them too.
            assert self._save_stream is not None and self._dma_saver.last is not None
            self._save_stream.wait_event(self._dma_saver.last)
            self._dma_saved = False
        if self.cuda and self._pending_saves:
            events = [record(self._save_stream)]
            self._last_save = events[0]
        self._pending_saves, self._pending_keep = False, []
        self._saves, self._batches = {}, []
        self._save_epoch += 1
        if self._save_uploads is not None:
            self._save_uploads.reset()        # every save that reads them is queued
        handle = SaveHandle(self.device, events if (self.cuda and events) else None, keep)
        if wait:
            handle.synchronize()
        return handle

    def fence_saves(self) -> None:
        """Make the current stream wait, on the device (no host sync), for every save
        copy enqueued so far: blocks those copies read may be rewritten by later work on
        it only after them. Blocks an engine frees without telling the connector (a
        preempted request's) are reused by the next step's forward, so the worker fences
        at the start of a step while saves are in flight (nothing on CPU)."""
        if self._last_save is not None:
            torch.cuda.current_stream(self.device).wait_event(self._last_save)

    def behind(self, depth: int = 1) -> bool:
        """Whether the device has not yet reached where the current stream was `depth`
        calls ago (then the host runs at least that far ahead of it, and host work now
        delays no kernel); True off CUDA. Marks the position for later calls;
        forget_mark() starts over. A call `depth` deep before that many marks: False."""
        if not self.cuda:
            return True
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        n = depth + 1                       # the marks a ring of this depth needs
        if len(self._marks) < n:
            self._marks += [torch.cuda.Event() for _ in range(n - len(self._marks))]
        ring = self._marks[:n]
        behind = self._marked >= depth and not query(ring[(self._marked - depth) % n])
        ring[self._marked % n].record(torch.cuda.current_stream(self.device))
        self._marked += 1
        return behind

    def forget_mark(self) -> None:
        self._marked = 0

    # -- shared ----------------------------------------------------------------------------
    def _after_current(self, stream, mark) -> None:
        """`stream` waits, on the device, for the current stream's work so far, by way of
        a kept event: a wait takes the event's newest record when it is made, so one event
        serves every call (wait_stream makes and destroys one a call)."""
        mark.record(torch.cuda.current_stream(self.device))
        stream.wait_event(mark)

    def _plan(self, host: np.ndarray, offsets, block_ids, *, save: bool,
              uploads: IndexUploads | None) -> Plan:
        """Checked pages of one load or save, with the index uploaded to the device."""
        offsets, block_ids = check_pages(self.geo, len(self.layers), host, offsets,
                                         block_ids, save=save)
        return self._checked_plan(host, offsets, block_ids, uploads)

    def _checked_plan(self, host: np.ndarray, offsets: np.ndarray, block_ids: np.ndarray,
                      uploads: IndexUploads | None) -> Plan:
        """_plan of pages check_pages has passed; the index (for the kernel: offsets then
        block ids) goes up by `uploads`, or where there is none (no CUDA) stays here."""
        host_t = as_tensor(host)
        align = math.gcd(self._cache_align, host_t.data_ptr(), self.geo.layer_bytes,
                         int(np.gcd.reduce(offsets)) if len(offsets) else 0, 16)
        meta = None
        if self.method is not CopyMethod.COPIES and len(offsets):
            meta = uploads.put(offsets, block_ids) if uploads is not None else \
                torch.from_numpy(np.concatenate([offsets, block_ids.reshape(-1)]))
        return Plan(host, host_t, offsets, block_ids, meta, align)
