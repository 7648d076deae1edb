"""Loads from a store on another host, pipelined: layer L goes to the GPU while later layers
are still on the wire.

Without the shared pool (a store on another host, or `shared_memory: false`) every page
crosses the network. A load that received the whole prefix before copying any of it made
the forward's first layer wait for every byte of every layer. Instead, per load:

    start (engine thread)   the load stream waits for the compute stream's work so far
                            (the blocks may have been in use); a thread starts the Get
    receive (that thread)   client.get_layers, layer-major, striped over the client's
                            connections, into slabs of a ring of pinned host memory
                            (StagingRing); as each layer lands its copy to the blocks is
                            enqueued on the load stream (KVTransfer.load_layer) and the
                            slab goes back to the ring with the copy's event
    wait_layer(L) (engine)  waits on the host until layer L's copy is enqueued, then makes
                            the compute stream wait on L's event only
    done / synchronize      the thread has ended and the last copy has landed; raise
                            RemoteLoadFailed if the receive failed

A slab is handed out again only once the copy out of it has landed (its event, waited for
by the receiving thread, never the engine's). A layer larger than a slab is received in
page chunks, one Get each, all at once, so every chunk's layer 0 comes before any layer 1;
layer L is enqueued when every chunk's piece of it is.

Failures (server gone, connection cut, pages missing, a stall): the Get raises on the
receiving thread, the thread ends, layers not enqueued never will be, and the load raises
at done/synchronize, which the worker reports like any failed load (the engine recomputes
those blocks). Nothing is left: the Get's threads have ended, the slabs are back in the
ring, and the store pinned the pages only while it sent them. (A thread in a call that a
stop cannot cut -- opening the fast path, a gRPC stream -- ends at the client's timeout
instead, and copies nothing more.) Every wait is bounded: a
receive by the client's timeout for progress, the whole load by a deadline (the client's
timeout plus the bytes at a pessimistic 100 MB/s, as a gRPC Get is given); past it the
load is stopped (its sockets shut) and fails.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np
import torch

from kvstore_client import KVStoreClient, KVStoreError

from .transfer import KVTransfer, TransferError, pinned_empty

__all__ = ["RemoteLoad", "RemoteLoadFailed", "RemoteLoads", "StagingRing"]

# Slabs in the ring: one receiving, one or two copying, one spare. A layer's copy (PCIe,
# ~50 GB/s on the H200) is faster than its receive (the network), so more slabs would
# only hold memory.
SLABS = 4
_POLL_S = 0.05                # how often a waiting thread looks for a stop
_STOP_JOIN_S = 1.0            # how long a stopped load's thread is waited for
_SLOWEST_BYTES_PER_S = 100e6  # the deadline's pessimistic rate (kvstore_client.rpc)


def _cancelled(exc: BaseException) -> bool:
    return isinstance(exc, KVStoreError) and exc.code == grpc.StatusCode.CANCELLED


class RemoteLoadFailed(RuntimeError):
    """A remote load's receive failed; `cause` is what the client raised."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"remote load failed: {cause}")
        self.cause = cause


class _Stopped(Exception):
    """The load was stopped (deadline, close) while this thread waited."""


class StagingRing:
    """SLABS pinned host buffers of `slab_bytes` each, taken for a receive and given back
    with the event of the copy out of them. Thread-safe: stripes of several Gets take
    from it at once."""

    def __init__(self, total_bytes: int, min_slab: int, device: torch.device) -> None:
        self.slab_bytes = max(total_bytes // SLABS, min_slab)
        self._mem = [pinned_empty(self.slab_bytes, device) for _ in range(SLABS)]
        self._cond = threading.Condition()      # guards _free
        # Slabs not being received into, oldest first, each with the event of the copy
        # out of it (None: nothing to wait for).
        self._free: collections.deque = collections.deque((i, None) for i in range(SLABS))

    def take(self, stop: threading.Event) -> int:
        """A free slab's index, once the copy out of it has landed; _Stopped when `stop`
        is set while waiting."""
        with self._cond:
            while not self._free:
                if stop.is_set():
                    raise _Stopped
                self._cond.wait(_POLL_S)
            slab, event = self._free.popleft()
        if event is not None:
            try:
                event.synchronize()
            except RuntimeError as exc:
                self.give(slab)
                raise TransferError(f"KV copy failed on the device: {exc}") from exc
        return slab

    def mem(self, slab: int, pages: int, layer_bytes: int) -> np.ndarray:
        return self._mem[slab][:pages * layer_bytes].reshape(pages, layer_bytes)

    def give(self, slab: int, event: Any = None) -> None:
        with self._cond:
            self._free.append((slab, event))
            self._cond.notify()


class RemoteLoad:
    """One load in flight: a receiving thread and one event per layer. The handle the
    worker holds, like transfer.LoadHandle (wait_layer, done, synchronize)."""

    def __init__(self, client: KVStoreClient, ns, keys: Sequence[bytes],
                 block_ids: np.ndarray, transfer: KVTransfer, ring: StagingRing) -> None:
        self._client, self._ns, self._transfer, self._ring = client, ns, transfer, ring
        self._layers = ns.layout.num_layers
        lb = ns.layer_bytes
        keys = list(keys)
        block_ids = np.asarray(block_ids, dtype=np.int64).reshape(len(keys), -1)
        # Page chunks whose layer fits a slab, as even as can be.
        chunks = -(-len(keys) * lb // ring.slab_bytes)
        bounds = np.linspace(0, len(keys), chunks + 1).astype(int).tolist()
        self._chunks = [(keys[a:b], block_ids[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
        self.deadline = (time.monotonic() + client.timeout
                         + len(keys) * ns.page_bytes / _SLOWEST_BYTES_PER_S)
        self._stop = threading.Event()          # set: stop receiving (failure, deadline)
        self._cond = threading.Condition()      # (an RLock) guards the fields below
        self._enqueued = [0] * self._layers     # chunks whose piece of a layer is enqueued
        self._events: list = [None] * self._layers   # a layer's event, once whole
        self._ready = 0                         # layers [0, ready) enqueued whole
        self._last = None                       # the newest copy's event
        self._error: BaseException | None = None
        self._ended = False                     # the receiving thread has finished
        transfer.order_loads()
        self._thread = threading.Thread(target=self._run, name="kvstore-remote-load",
                                        daemon=True)
        self._thread.start()

    # -- the receiving thread -------------------------------------------------------------
    def _run(self) -> None:
        try:
            helpers = [threading.Thread(target=self._chunk, args=(c,), daemon=True,
                                        name="kvstore-remote-chunk")
                       for c in range(1, len(self._chunks))]
            for t in helpers:
                t.start()
            self._chunk(0)
            for t in helpers:
                t.join()
        finally:
            with self._cond:
                self._ended = True
                self._cond.notify_all()

    def _chunk(self, c: int) -> None:
        keys, block_ids = self._chunks[c]
        lb, ring = self._ns.layer_bytes, self._ring
        taken: dict[int, int] = {}              # layer -> slab, received into, not copied

        def dest(layer: int) -> np.ndarray:
            if layer in taken:                  # the get started again over gRPC
                ring.give(taken.pop(layer))
            taken[layer] = ring.take(self._stop)
            return ring.mem(taken[layer], len(keys), lb)

        try:
            # Checked and uploaded here, on the load stream: the engine's thread never waits.
            blocks = self._transfer.load_blocks(block_ids)
        except BaseException as exc:  # noqa: BLE001 - reported by done() and synchronize()
            self._fail(exc)
            return
        layers = self._client.get_layers(self._ns, keys, dest, self._stop)
        try:
            for layer, slab in layers:
                event = None
                with self._cond:                # an enqueue and a stop exclude each other
                    # Stopped: nothing more is copied; the get raises why at its next layer.
                    if not self._stop.is_set():
                        event = self._transfer.load_layer(layer, slab, blocks)
                        self._landed(layer, event)
                ring.give(taken.pop(layer), event)
        except BaseException as exc:  # noqa: BLE001 - reported by done() and synchronize()
            self._fail(exc)
        finally:
            layers.close()                      # its threads have ended when this returns
            for unused in taken.values():       # received into, never copied
                ring.give(unused)

    def _landed(self, layer: int, event) -> None:
        """Layer's piece of one chunk enqueued (under _cond). The load stream runs its
        copies in order, so the event of the last chunk's piece covers the others."""
        self._last = event
        self._enqueued[layer] += 1
        if self._enqueued[layer] == len(self._chunks):
            self._events[layer] = event
            while self._ready < self._layers and self._enqueued[self._ready] == len(self._chunks):
                self._ready += 1
            self._cond.notify_all()

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            # A chunk that saw another's failure as a stop says CANCELLED: keep the cause.
            if not isinstance(exc, _Stopped) and (self._error is None
                                                  or _cancelled(self._error)):
                self._error = exc
            self._stop.set()
            self._cond.notify_all()

    def stop(self, why: str) -> None:
        """End the load now (its sockets are shut); it fails with `why`."""
        self._fail(KVStoreError(grpc.StatusCode.DEADLINE_EXCEEDED, why, "Get"))

    # -- the engine's side ---------------------------------------------------------------
    def wait_layer(self, layer: int) -> None:
        """Wait until layer's copy is enqueued (or the load has failed: the worker reports
        it), then make the current stream wait for that copy only."""
        if not 0 <= layer < self._layers:
            raise IndexError(f"layer {layer} out of range [0, {self._layers})")
        with self._cond:                        # re-entrant: stop() takes it too
            while self._ready <= layer and not self._stop.is_set() and not self._ended:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    self.stop("the remote load passed its deadline")
                    break
                self._cond.wait(min(left, 1.0))
            event = self._events[layer]
        if event is not None:
            torch.cuda.current_stream(self._transfer.device).wait_event(event)

    def done(self) -> bool:
        """Whether the load has ended and its last copy landed (RemoteLoadFailed if it
        failed); never waits."""
        if self._thread.is_alive():
            if time.monotonic() > self.deadline:
                self.stop("the remote load passed its deadline")
            return False
        self._raise()
        return self._last is None or bool(self._last.query())

    def synchronize(self) -> None:
        """Block until the load has ended (at most until its deadline, then it is stopped)
        and its last copy has landed; RemoteLoadFailed if it failed."""
        self._thread.join(max(0.0, self.deadline - time.monotonic()))
        if self._thread.is_alive():
            self.stop("the remote load passed its deadline")
            # A stop shuts the Get's sockets, so the thread ends at once, unless it is in
            # a call a stop cannot cut (opening the fast path, a gRPC stream): that one
            # ends at the client's timeout, copying nothing more (the stop is checked
            # before every copy), and the load is failed now.
            self._thread.join(_STOP_JOIN_S)
        if self._last is not None:
            self._last.synchronize()        # copies enqueued before a failure land first
        self._raise()

    @property
    def receiving(self) -> bool:
        return self._thread.is_alive()

    def _raise(self) -> None:
        if self._error is not None:
            raise RemoteLoadFailed(self._error)
        if self._ready < self._layers:      # stopped with no error of its own
            raise RemoteLoadFailed(KVStoreError(grpc.StatusCode.CANCELLED,
                                                "the remote load was stopped", "Get"))


class RemoteLoads:
    """Starts remote loads for one worker; owns the staging ring (made on first use)."""

    def __init__(self, client: KVStoreClient, transfer: KVTransfer, staging_bytes: int
                 ) -> None:
        self._client = client
        self._transfer = transfer
        self._staging_bytes = staging_bytes
        self._ring: StagingRing | None = None
        self._loads: list[RemoteLoad] = []      # started, maybe still receiving

    def start(self, ns, keys: Sequence[bytes], block_ids: np.ndarray) -> RemoteLoad:
        if self._ring is None:
            self._ring = StagingRing(self._staging_bytes, ns.layer_bytes,
                                     self._transfer.device)
        self._loads = [x for x in self._loads if x.receiving]
        load = RemoteLoad(self._client, ns, keys, block_ids, self._transfer, self._ring)
        self._loads.append(load)
        return load

    def close(self) -> None:
        """Stop every load still receiving and wait for its threads."""
        for load in self._loads:
            if load.receiving:
                load.stop("the connector is closing")
        for load in self._loads:
            try:
                load.synchronize()
            except (RemoteLoadFailed, TransferError):
                pass
        self._loads.clear()
        self._ring = None
