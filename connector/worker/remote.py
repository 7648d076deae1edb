"""Loads from a store on another host, pipelined: layer L goes to the GPU while later layers
are still on the wire.

Without the shared pool (a store on another host, or `shared_memory: false`) every page
crosses the network. A load that received the whole prefix before copying any of it made
the forward's first layer wait for every byte of every layer. Instead, per load:

    start (engine thread)   the load stream waits for the compute stream's work so far
                            (the blocks may have been in use); a thread starts the Get
    receive (that thread)   client.get_layers, layer-major, striped over the client's
                            connections, into slabs of a ring of pinned host memory
                            (connector.worker.staging); as each layer lands its copy to
                            the blocks is enqueued on the load stream
                            (KVTransfer.load_layer), by the stripe's thread that received
                            the layer's last bytes, and the slab goes back to the ring
                            with the copy's event
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
receive by the client's timeout for progress, the whole load by a deadline that follows
from its bytes, the measured link and the engine's pace and moves on as layers land
(connector.worker.deadline); past it the load is stopped (its sockets shut) and fails. A load
that is slow but coming is waited for: only one that stops coming fails.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Sequence

import grpc
import numpy as np
import torch

from kvstore_client import KVStoreClient, KVStoreError

from ..transfer import KVTransfer, TransferError
from .deadline import Pace
from .staging import SLABS, StagingRing, Stopped as _Stopped

__all__ = ["SLABS", "RemoteLoad", "RemoteLoadFailed", "RemoteLoads"]

_STOP_JOIN_S = 1.0            # how long a stopped load's thread is waited for


def _cancelled(exc: BaseException) -> bool:
    return isinstance(exc, KVStoreError) and exc.code == grpc.StatusCode.CANCELLED


class RemoteLoadFailed(RuntimeError):
    """A remote load's receive failed; `cause` is what the client raised."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"remote load failed: {cause}")
        self.cause = cause


class RemoteLoad:
    """One Get in flight for one load or several (`parts`: each load's page count, in
    order): a receiving thread and one event per layer. `parts()` are the handles the
    worker holds, like transfer.LoadHandle (wait_layer, done, synchronize).

    A Get that finds pages missing fails before any byte of a layer arrives, so no layer
    is whole yet; with several loads in it, each load is then asked for by a Get of its
    own, so only the one missing a page fails (as the shared-pool path fails only that
    one).
    """

    def __init__(self, client: KVStoreClient, ns, keys: Sequence[bytes],
                 block_ids: np.ndarray, transfer: KVTransfer, ring: StagingRing,
                 parts: Sequence[int] = (), pace: Pace | None = None) -> None:
        self._client, self._ns, self._transfer, self._ring = client, ns, transfer, ring
        self._layers = ns.layout.num_layers
        self._keys = list(keys)
        self._block_ids = np.asarray(block_ids, dtype=np.int64).reshape(len(self._keys), -1)
        self._sizes = list(parts) or [len(self._keys)]
        if sum(self._sizes) != len(self._keys):
            raise ValueError(f"parts of {sum(self._sizes)} pages for {len(self._keys)} keys")
        self._chunks = self._split([(0, len(self._keys), -1)])
        self._pace = pace or Pace(client.timeout)
        self._bytes = len(self._keys) * ns.page_bytes
        self._began = time.monotonic()
        self._left = self._bytes                # bytes not landed yet (about: by pieces)
        # Moved on as pieces land (_landed), never earlier: connector.worker.deadline.
        self.deadline = self._began + self._pace.budget(self._bytes)
        self._stop = threading.Event()          # set: the load failed or was stopped
        # What each chunk's Get stops on: one event for all of the step's Get, so that a
        # chunk's failure stops the others; one per load when each is asked for alone.
        self._stops = [threading.Event()] * len(self._chunks)
        self._cond = threading.Condition()      # (an RLock) guards the fields below
        self._enqueued = [0] * self._layers     # chunks whose piece of a layer is enqueued
        self._events: list = [None] * self._layers   # a layer's event, once whole
        self._ready = 0                         # layers [0, ready) enqueued whole
        self._last = None                       # the newest copy's event
        self._error: BaseException | None = None
        self._missing: KVStoreError | None = None    # the step's Get found pages missing
        self._failed: dict[int, KVStoreError] = {}   # part -> why, asked for alone
        self._ended = False                     # the receiving thread has finished
        transfer.order_loads()
        self._thread = threading.Thread(target=self._run, name="kvstore-remote-load",
                                        daemon=True)
        self._thread.start()

    def parts(self) -> list[_Part]:
        return [_Part(self, i) for i in range(len(self._sizes))]

    def _split(self, ranges: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        """(first page, end, part; -1 = all) of Gets whose layer fits a slab, as even as
        can be."""
        out = []
        for lo, hi, part in ranges:
            chunks = -(-(hi - lo) * self._ns.layer_bytes // self._ring.slab_bytes)
            bounds = np.linspace(lo, hi, chunks + 1).astype(int).tolist()
            out += [(a, b, part) for a, b in itertools.pairwise(bounds)]
        return out

    # -- the receiving thread -------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._get_all()
            if self._by_part():
                self._get_all()
        finally:
            with self._cond:
                self._ended = True
                if self._error is None and not self._failed and self._ready == self._layers:
                    self._pace.finished(self._bytes, time.monotonic() - self._began)
                self._cond.notify_all()

    def _get_all(self) -> None:
        helpers = [threading.Thread(target=self._chunk, args=(c,), daemon=True,
                                    name="kvstore-remote-chunk")
                   for c in range(1, len(self._chunks))]
        for t in helpers:
            t.start()
        self._chunk(0)
        for t in helpers:
            t.join()

    def _by_part(self) -> bool:
        """After pages were found missing: a Get per load. No layer was whole (the chunk
        missing a page sent none), so the engine has read none; pieces other chunks
        copied are copied again, the same bytes to the same blocks, in stream order."""
        with self._cond:
            if self._missing is None or self._stop.is_set():
                return False
            if len(self._sizes) == 1 or self._ready:
                self._fail(self._missing)
                return False
            self._enqueued = [0] * self._layers
            edges = np.cumsum([0, *self._sizes]).tolist()
            self._chunks = self._split([(edges[i], edges[i + 1], i)
                                        for i in range(len(self._sizes))])
            per_part = [threading.Event() for _ in self._sizes]
            self._stops = [per_part[part] for _, _, part in self._chunks]
            return True

    def _chunk(self, c: int) -> None:
        lo, hi, part = self._chunks[c]
        keys, attempt = self._keys[lo:hi], self._stops[c]
        lb, ring = self._ns.layer_bytes, self._ring
        taken: dict[int, int] = {}              # layer -> slab, received into, not copied
        landed: set[int] = set()

        def dest(layer: int) -> np.ndarray:
            if layer in taken:                  # the get started again over gRPC
                ring.give(taken.pop(layer))
            taken[layer] = ring.take(attempt)
            return ring.mem(taken[layer], len(keys), lb)

        try:
            # Checked and uploaded here, on the load stream: the engine's thread never waits.
            blocks = self._transfer.load_blocks(self._block_ids[lo:hi])
        except BaseException as exc:  # noqa: BLE001 - reported by done() and synchronize()
            self._fail(exc)
            return
        def arrived(layer: int, slab: np.ndarray) -> None:
            event = None
            with self._cond:                    # an enqueue and a stop exclude each other
                # Stopped: nothing more is copied; the get raises why at its next layer.
                if not attempt.is_set():
                    event = self._transfer.load_layer(layer, slab, blocks)
                    self._landed(layer, event)
                    landed.add(layer)
            ring.give(taken.pop(layer), event)

        # Each layer's copy is enqueued by the thread that received its last bytes
        # (client.get_layers' `landed`), not handed to this one first: this thread only
        # waits for the get to end.
        layers = self._client.get_layers(self._ns, keys, dest, attempt, arrived)
        try:
            for _ in layers:
                pass
            if len(landed) < self._layers:      # stopped after its last layer came
                raise _Stopped
        except BaseException as exc:  # noqa: BLE001 - reported by done() and synchronize()
            self._chunk_failed(exc, part, attempt, landed)
        finally:
            layers.close()                      # its threads have ended when this returns
            for unused in taken.values():       # received into, never copied
                ring.give(unused)

    def _chunk_failed(self, exc: BaseException, part: int, attempt: threading.Event,
                      landed: set[int]) -> None:
        missing = isinstance(exc, KVStoreError) and exc.code == grpc.StatusCode.NOT_FOUND
        with self._cond:
            if self._stop.is_set() or not (missing or isinstance(exc, _Stopped)
                                           or _cancelled(exc)):
                self._fail(exc)
                return
            # Pages missing, or a stop because a sibling Get found some missing.
            if part < 0:                        # the step's Get: _by_part decides
                if missing:
                    self._missing = self._missing or exc   # type: ignore[assignment]
                attempt.set()
                return
            if missing or part not in self._failed:
                self._failed[part] = exc        # type: ignore[assignment]
            for layer in range(self._layers):   # this load alone fails: its layers
                if layer not in landed:         # count as in, never copied
                    self._landed(layer, None)

    def _landed(self, layer: int, event) -> None:
        """Layer's piece of one chunk enqueued (under _cond). The load stream runs its
        copies in order, so the newest copy's event covers every piece before it."""
        if event is not None:
            self._last = event
        self._enqueued[layer] += 1
        pieces = self._layers * len(self._chunks)
        self._left = int(self._bytes * (pieces - sum(self._enqueued)) / pieces)
        now = time.monotonic()
        self._pace.landed(now)
        self.deadline = max(self.deadline, now + self._pace.budget(self._left))
        if self._enqueued[layer] == len(self._chunks):
            self._events[layer] = self._last
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
            for event in self._stops:
                event.set()
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
                left = self._due() - time.monotonic()
                if left <= 0:
                    self.stop("the remote load passed its deadline")
                    break
                self._cond.wait(min(left, 1.0))
            event = self._events[layer]
        if event is not None:
            torch.cuda.current_stream(self._transfer.device).wait_event(event)

    def done(self, part: int | None = None) -> bool:
        """Whether the load has ended and its last copy landed (RemoteLoadFailed if it,
        or the part, failed); never waits."""
        if self._thread.is_alive():
            if time.monotonic() > self._due():
                self.stop("the remote load passed its deadline")
            return False
        self._raise(part)
        return self._last is None or bool(self._last.query())

    def synchronize(self, part: int | None = None) -> None:
        """Block until the load has ended (at most until its deadline, then it is stopped)
        and its last copy has landed; RemoteLoadFailed if it, or the part, failed."""
        while self._thread.is_alive() and time.monotonic() < self._due():
            self._thread.join(max(0.0, self._due() - time.monotonic()))
        if self._thread.is_alive():
            self.stop("the remote load passed its deadline")
            # A stop shuts the Get's sockets, so the thread ends at once, unless it is in
            # a call a stop cannot cut (opening the fast path, a gRPC stream): that one
            # ends at the client's timeout, copying nothing more (the stop is checked
            # before every copy), and the load is failed now.
            self._thread.join(_STOP_JOIN_S)
        if self._last is not None:
            self._last.synchronize()        # copies enqueued before a failure land first
        self._raise(part)

    def _due(self) -> float:
        """When the load is late: its deadline, or later while the worker's other loads
        land pieces (connector.worker.deadline)."""
        return self._pace.due(self.deadline, self._left)

    @property
    def receiving(self) -> bool:
        return self._thread.is_alive()

    def _raise(self, part: int | None) -> None:
        if self._error is not None:
            raise RemoteLoadFailed(self._error)
        if part in self._failed:
            raise RemoteLoadFailed(self._failed[part])
        if self._ready < self._layers:      # stopped with no error of its own
            raise RemoteLoadFailed(KVStoreError(grpc.StatusCode.CANCELLED,
                                                "the remote load was stopped", "Get"))


class _Part:
    """One load's handle on a RemoteLoad shared by the step's loads: its own outcome; the
    first part waits for the layers, which every part shares."""

    def __init__(self, load: RemoteLoad, index: int) -> None:
        self._load = load
        self._index = index

    def wait_layer(self, layer: int) -> None:
        if self._index == 0:
            self._load.wait_layer(layer)

    def done(self) -> bool:
        return self._load.done(self._index)

    def synchronize(self) -> None:
        self._load.synchronize(self._index)


class RemoteLoads:
    """Starts remote loads for one worker; owns the staging ring (made on first use)."""

    def __init__(self, client: KVStoreClient, transfer: KVTransfer, staging_bytes: int
                 ) -> None:
        self.pace = Pace(client.timeout)        # the worker marks its steps (bind)
        self._client = client
        self._transfer = transfer
        self._staging_bytes = staging_bytes
        self._ring: StagingRing | None = None
        self._loads: list[RemoteLoad] = []      # started, maybe still receiving

    def start(self, ns, keys: Sequence[bytes], block_ids: np.ndarray,
              parts: Sequence[int] = ()) -> RemoteLoad:
        """One Get of keys into block_ids (pages, k), for loads of `parts` pages each."""
        if self._ring is None:
            self._ring = StagingRing(self._staging_bytes, ns.layer_bytes,
                                     self._transfer.device)
        self._loads = [x for x in self._loads if x.receiving]
        load = RemoteLoad(self._client, ns, keys, block_ids, self._transfer, self._ring,
                          parts, self.pace)
        self._loads.append(load)
        return load

    def close(self) -> None:
        """Stop every load still receiving and wait for its threads."""
        for load in self._loads:
            if load.receiving:
                load.stop("the connector is closing")
        for load in self._loads:
            with contextlib.suppress(RemoteLoadFailed, TransferError):
                load.synchronize()
        self._loads.clear()
        self._ring = None
