"""A layer-major Get over the fast path, into the caller's buffers, striped over connections.

    for layer, buf in LayerGet(fast, layout_id, key_size, packed, layers, layer_bytes,
                               dest, stop):
        ...             buf is dest(layer), whole: every page's bytes of that layer

    LayerGet(..., landed=fn)    fn(layer, buf) is called as each layer is whole, by the
                                stripe thread that completed it, before that stripe
                                receives its next layer (then iterating only waits)

The server answers a GET flagged LAYER_MAJOR with every page's layer 0, then every page's
layer 1, ... (kvstore_protocol.fastwire). A large Get is split by pages into stripes, one
pooled connection and one thread each, so that several sockets receive at once; every
stripe is itself layer-major, so it receives its pages' rows of layer L straight into
layer L's buffer, then its rows of layer L+1. `dest(layer)` is called once per layer, by
the first stripe to reach it, and may block until the caller has a buffer free (a ring
of pinned slabs, say); the other stripes wait for that buffer. A layer is handed out once
every stripe has filled its rows. Every stripe goes through the layers in order, so the
layers complete in order.

`landed` acts on a layer where it completes, on the stripe thread that received its last
rows: handed to the caller's thread instead (a queue, then a wakeup), each layer's copy
to the GPU waited for a thread switch first. The stripe that completes layer L calls
landed(L) before it receives any rows of L+1, and L+1 completes only once every stripe
has its rows, so the calls come in layer order, one at a time. A stripe waits for a layer's
buffer on one condition shared by all layers (no object per layer).

A stripe always runs on a thread of its own, even a lone one: the caller's thread only
waits for finished layers, so it can notice `stop` and end the get at any time.

Failure: the first stripe to fail sets `stop` and shuts the other stripes' sockets; the
iteration raises its error once every stripe thread has ended. A caller that sets
`stop`, or stops iterating, ends the get the same way (KVStoreError CANCELLED). So a
`dest` that waits for a buffer must give up when `stop` is set. A stripe whose pooled
connection is found broken before any byte of its answer arrived (one left idle across a
server restart) tries once more on a fresh one, as FastPath's other calls do, and one
told that the layout is unknown (the server restarted) registers it again and tries once
more; a connection that breaks later fails the get (UNAVAILABLE). Each receive is bounded by the
client's timeout for progress (kvstore_client.fastconn).
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import socket
import threading
from collections.abc import Callable, Iterator

import grpc
import numpy as np

from kvstore_protocol import fastwire as fw

from .errors import KVStoreError, Reason
from .fastconn import Broken, Conn, Timeout, deadline
from .fastpath import STRIPE_MIN_BYTES, FastPath, keys_body

__all__ = ["Dest", "Landed", "LayerGet", "stripe_bounds"]

# dest(layer) -> the (n_pages, layer_bytes) uint8 C-contiguous array that layer lands in.
Dest = Callable[[int], np.ndarray]
# landed(layer, buf): the layer is whole in buf (called on the stripe thread).
Landed = Callable[[int, np.ndarray], object]

_POLL_S = 0.05          # how often a waiting thread looks at `stop`


def stripe_bounds(pages: int, layers: int, layer_bytes: int, connections: int) -> list[int]:
    """The first page of each stripe, and the end: as many stripes as connections, at most
    one a page, and each at least STRIPE_MIN_BYTES (one stripe at the least)."""
    stripes = min(connections, pages, max(1, pages * layers * layer_bytes // STRIPE_MIN_BYTES))
    return np.linspace(0, pages, max(1, stripes) + 1).astype(int).tolist()


class _Stopped(Exception):
    """This stripe ends because another one failed or the caller stopped the get."""


class LayerGet:
    """One layer-major Get; iterate once for (layer, buffer) in layer order."""

    def __init__(self, fast: FastPath, layout_id: bytes, key_size: int, packed: bytes,
                 layers: int, layer_bytes: int, dest: Dest,
                 stop: threading.Event | None = None,
                 reregister: Callable[[], object] | None = None,
                 landed: Landed | None = None) -> None:
        """stop: set by the caller to end the get, and by the get when it fails;
        reregister: registers the layout again (a server that restarted forgot it);
        landed: called with each whole layer on the stripe thread that completed it."""
        self.n = len(packed) // key_size if key_size else 0
        self.layers = layers
        self.layer_bytes = layer_bytes
        self.stop = stop or threading.Event()
        self._fast = fast
        self._layout_id = layout_id
        self._key_size = key_size
        self._packed = packed
        self._dest = dest
        self._reregister = reregister
        self._landed = landed
        self._bounds = stripe_bounds(self.n, layers, layer_bytes, fast.connections)
        self._lock = threading.Lock()     # guards the fields below
        self._cond = threading.Condition(self._lock)      # a buffer is in, or dest failed
        self._buffers: list[np.ndarray | None] = [None] * layers   # until the layer is whole
        self._asked = [False] * layers    # a stripe has called dest for the layer
        self._dest_failed = False         # a dest call raised (its stripe reports it)
        self._left = [len(self._bounds) - 1] * layers     # stripes yet to fill a layer
        self._conns: dict[int, Conn] = {}                 # stripe -> its connection now
        self._error: BaseException | None = None          # the first stripe's failure
        self._done: queue.Queue = queue.Queue()           # (layer, buffer), in order

    # -- the caller's side ------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[int, np.ndarray]]:
        if not self.n:
            return
        threads = [threading.Thread(target=self._stripe, args=(i, lo, hi), daemon=True,
                                    name=f"kvstore-layers-{i}")
                   for i, (lo, hi) in enumerate(itertools.pairwise(self._bounds))]
        for t in threads:
            t.start()
        completed = False
        try:
            for _ in range(self.layers):
                yield self._next()
            completed = True
        finally:
            if not completed:             # the caller stopped early, or a stripe failed
                self.stop.set()
                self._shut_all()
            for t in threads:
                t.join()

    def _next(self) -> tuple[int, np.ndarray]:
        while True:
            try:
                return self._done.get(timeout=_POLL_S)
            except queue.Empty:
                pass
            if self._error is not None:
                raise self._error
            if self.stop.is_set():
                raise KVStoreError(grpc.StatusCode.CANCELLED, "the get was stopped", "Get")

    # -- the stripes ------------------------------------------------------------------
    def _stripe(self, i: int, lo: int, hi: int) -> None:
        try:
            self._receive(i, lo, hi)
        except _Stopped:
            pass
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            with self._lock:
                first = self._error is None and not self.stop.is_set()
                if first:
                    self._error = exc
            if first:
                self.stop.set()
                self._shut_all()

    def _receive(self, i: int, lo: int, hi: int) -> None:
        body = keys_body(self._layout_id, self._key_size,
                         self._packed[lo * self._key_size:hi * self._key_size])
        expected = (hi - lo) * self.layers * self.layer_bytes
        for attempt in (0, 1):
            conn = self._fast.take() if attempt == 0 else self._fast.fresh()
            with self._lock:
                self._conns[i] = conn
            started = False            # a byte of the answer has arrived
            try:
                if self.stop.is_set():
                    raise _Stopped
                conn.use_timeout(self._fast.timeout)
                conn.send(fw.Op.GET, body, flags=fw.LAYER_MAJOR)
                head = conn.answer_head(fw.Op.GET, "Get")
                started = True
                if head.data_len != expected:
                    raise Broken(f"Get answered {head.data_len} bytes, expected {expected}")
                for layer in range(self.layers):
                    rows = self._buffer(layer)[lo:hi]
                    # The header said these bytes come: one MSG_WAITALL receive a layer,
                    # faster than receives of what has arrived for large pages and never
                    # slower for small ones. A shut socket (_shut_all) still wakes it.
                    conn.recv_exact(rows.reshape(-1).data, waitall=True)
                    self._arrived(layer)
            except KVStoreError as exc:
                self._fast.give(conn)      # an error frame: the connection is in step
                if (attempt or started or self._reregister is None
                        or exc.reason is not Reason.LAYOUT_UNKNOWN):
                    raise
                self._reregister()
                continue
            except Broken as exc:
                conn.close()
                if started or attempt or self.stop.is_set():
                    if self.stop.is_set():
                        raise _Stopped from None
                    raise KVStoreError(grpc.StatusCode.UNAVAILABLE,
                                       f"fast-path connection broke: {exc}", "Get") from None
                continue
            except Timeout as exc:
                conn.close()
                raise deadline("Get", exc) from None
            except BaseException:
                conn.close()               # mid-frame: never reuse it
                raise
            finally:
                with self._lock:
                    self._conns.pop(i, None)
            self._fast.give(conn)
            return

    def _buffer(self, layer: int) -> np.ndarray:
        """Layer's buffer: made by this stripe's dest() call if it is the first to reach
        the layer, else waited for."""
        with self._lock:
            buf = self._buffers[layer]
            if buf is not None:
                return buf
            mine = not self._asked[layer]
            self._asked[layer] = True
        if mine:
            try:
                buf = self._checked(self._dest(layer))
            except BaseException:
                with self._cond:
                    self._dest_failed = True      # this stripe reports it
                    self._cond.notify_all()
                raise
            with self._cond:
                self._buffers[layer] = buf
                self._cond.notify_all()
            return buf
        with self._cond:
            while (buf := self._buffers[layer]) is None:
                if self.stop.is_set() or self._dest_failed:
                    raise _Stopped
                self._cond.wait(_POLL_S)
            return buf

    def _checked(self, buf: np.ndarray) -> np.ndarray:
        want = (self.n, self.layer_bytes)
        if (not isinstance(buf, np.ndarray) or buf.dtype != np.uint8 or buf.shape != want
                or not buf.flags.c_contiguous or not buf.flags.writeable):
            raise ValueError(f"dest must give a writable C-contiguous uint8 array of shape "
                             f"{want}, got {getattr(buf, 'dtype', type(buf))} "
                             f"{getattr(buf, 'shape', '')}")
        return buf

    def _arrived(self, layer: int) -> None:
        with self._lock:
            self._left[layer] -= 1
            if self._left[layer]:
                return
            buf = self._buffers[layer]
            self._buffers[layer] = None
        assert buf is not None
        if self._landed is not None:
            self._landed(layer, buf)
        self._done.put((layer, buf))

    def _shut_all(self) -> None:
        """Wake every stripe blocked in a receive: the socket is shut under it (the
        connection is closed by its own thread, which then fails or stops)."""
        with self._lock:
            conns = list(self._conns.values())
        for conn in conns:
            with contextlib.suppress(OSError):
                socket.socket.shutdown(conn.sock, socket.SHUT_RDWR)
