"""The chooser: which transport a KVStoreClient call takes, the one place that decides.

    bytes, same host (the pool is mapped)   shared memory (kvstore_client.shm), beside
                                            the transport, which carries the leases
    control, same host                      fast path on the server's Unix socket
    bytes and control, another host         fast path over TCP (the gRPC port + 1, or
                                            data_address)
    fast path unreachable                   gRPC: one warning, another try in RETRY_S

`Chooser.call(method, handle, fn)` runs fn(transport) on the fast path when it is open,
and on gRPC when it is not or went away during the call (FastPathUnavailable), inside the
one restart-recovery loop (transport.Recovery), so the caller writes each call once.

The Unix socket is the one the latest Attach named, used only after its listener proved
to be the server's user (kvstore_client.unixpeer). A fast path that dropped (the server
may have restarted) is opened again only after a fresh Attach: new socket path, new
region and token, so the old mapping's offsets are never taken from a new peer.
"""

from __future__ import annotations

import logging
import os
import ssl
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

import grpc
import numpy as np

from kvstore_protocol.keys import MAX_KEY_BYTES, Packed, pack_keys

from .errors import KVStoreError
from .fastpath import FastPath, FastPathUnavailable, UntrustedPeer
from .grpc_transport import GrpcTransport
from .holdings import Holdings
from .layerget import Dest, Landed, LayerGet
from .transport import NotCarried, Recovery, Transport

if TYPE_CHECKING:
    from .results import LayoutHandle
    from .shm import SharedRegion
    from .unixpeer import ServerIdentity

__all__ = ["Chooser", "packed_keys", "tls_context"]

log = logging.getLogger(__name__)

T = TypeVar("T")


RETRY_S = 30.0           # after the fast path could not be reached, gRPC for this long


def packed_keys(keys) -> tuple[int, bytes]:
    """(key size, packed bytes) of a Packed or a list of equal-length keys."""
    if type(keys) is list and keys:
        # The common list, checked in C with no further frame: keys of one length
        # within the bounds; anything else goes to pack_keys for its errors.
        size = len(keys[0])
        if 0 < size <= MAX_KEY_BYTES and (len(keys) == 1 or
                                          len(set(map(len, keys))) == 1):
            try:
                return size, b"".join(keys)
            except TypeError:
                pass
    if isinstance(keys, Packed):
        return keys.size, keys.data
    data, size = pack_keys(keys if type(keys) is list else list(keys))
    return size, data


def tls_context(tls_ca, tls_cert, tls_key) -> ssl.SSLContext | None:
    """The client side of the fast path's TLS, from the arguments gRPC's channel takes
    (paths or PEM bytes); None when they ask for no TLS."""
    if tls_ca is None and tls_cert is None:
        return None
    if isinstance(tls_ca, bytes):
        ctx = ssl.create_default_context(cadata=tls_ca.decode())
    else:
        ctx = ssl.create_default_context(cafile=tls_ca)
    if tls_cert is not None:
        with tempfile.TemporaryDirectory() as folder:
            paths = []
            for name, value in (("cert.pem", tls_cert), ("key.pem", tls_key)):
                if isinstance(value, bytes):
                    path = os.path.join(folder, name)
                    with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
                        f.write(value)
                    value = path
                paths.append(value)
            ctx.load_cert_chain(paths[0], paths[1])
    return ctx


class Chooser:
    """The transports of one KVStoreClient: gRPC, and the fast path, opened on first use."""

    def __init__(self, grpc_transport: GrpcTransport, address: str, *,
                 enabled: bool | None, data_address: str | None,
                 token: str | None, tls: ssl.SSLContext | None,
                 timeout: Callable[[], float],
                 connections: int, region: Callable[[], SharedRegion | None],
                 reregister: Callable[[LayoutHandle], object],
                 reattach: Callable[[bool], None],
                 identity: Callable[[], ServerIdentity | None] = lambda: None,
                 locate: Callable[[], ServerIdentity | None] | None = None,
                 congestion: str = "") -> None:
        """grpc_transport: what every call falls back to. enabled: the fast path's; None
        = use it when reachable, True = require it, False = never. reregister(handle):
        register a layout again (a restarted server forgot it).
        reattach(keep): Attach again and map what it names (RegionAttachment.attach):
        keep=True after a drop keeps a mapping of the same region; False when the server
        said the token is stale, as it does once it restarted.
        identity: the server's Unix socket and user as the last Attach said, for a client
        that maps the pool (RegionAttachment.identity). locate: the same from a fresh
        Attach when no pool is mapped (RegionAttachment.local_socket), or None not to look
        for the socket then. congestion: the TCP congestion control of the fast path's
        TCP connections ("" = the host's; kvstore_protocol.congestion)."""
        self.grpc = grpc_transport
        self.enabled = enabled
        self._grpc_address = address
        self._data_address = data_address
        self._token = token
        self._tls = tls
        self._timeout = timeout
        self._connections = connections
        self._congestion = congestion
        self._region = region
        self._reattach = reattach
        # Not keeping the mapping: a refusal for a stale token means the server restarted.
        self._recovery = Recovery(lambda: reattach(False), reregister)
        self._identity = identity
        self._locate = locate
        # A fast path dropped since the last Attach: Attach again before the next opens.
        self._dropped = False
        self._lock = threading.Lock()      # guards opening and dropping _fast
        self._fast: FastPath | None = None
        # Which fast-path connection holds each lease, across the fast paths opened one
        # after another: one dropped keeps a connection its leases would end with.
        self._holdings = Holdings()
        self._retry_at = 0.0
        self._warned = False

    def _server(self) -> ServerIdentity | None:
        """The server's Unix socket and user from an Attach made since the last drop."""
        if self._dropped:
            self._dropped = False
            try:
                self._reattach(True)                # maps the region it names, if new
            except KVStoreError as exc:
                log.debug("fast path: no Attach (%s)", exc)
        if self._region() is not None:
            return self._identity()
        return self._locate() if self._locate is not None else None

    def _addresses(self) -> list[tuple[str, ServerIdentity | None]]:
        if self._data_address:
            unix = "/" in self._data_address
            return [(self._data_address, self._server() if unix else None)]
        out: list[tuple[str, ServerIdentity | None]] = []
        server = self._server()
        if server is not None:
            out.append((server.socket_path, server))
        host, _, port = self._grpc_address.rpartition(":")
        if port.isdigit():
            out.append((f"{host}:{int(port) + 1}", None))
        return out

    def fast(self) -> FastPath | None:
        """The open fast path, or None: gRPC for now."""
        if self.enabled is False:
            return None
        fast = self._fast
        if fast is not None or time.monotonic() < self._retry_at:
            return fast
        with self._lock:
            if self._fast is not None:
                return self._fast
            problems = []
            for address, server in self._addresses():
                candidate = FastPath(address, token=self._token,
                                     tls=None if "/" in address else self._tls,
                                     timeout=self._timeout, connections=self._connections,
                                     holdings=self._holdings, identity=server,
                                     congestion=self._congestion)
                try:
                    candidate.check()
                except UntrustedPeer as exc:
                    # Someone stands where the server said its socket is: no fast path
                    # at all for now (its TCP port may be theirs as well), gRPC instead.
                    problems.append(str(exc))
                    break
                except FastPathUnavailable as exc:
                    problems.append(str(exc))
                    continue
                self._fast = candidate
                log.debug("fast path: %s", address)
                return candidate
            self._retry_at = time.monotonic() + RETRY_S
            if self.enabled:
                raise KVStoreError(grpc.StatusCode.UNAVAILABLE, "the fast path was required "
                                   "but cannot be reached: " + "; ".join(problems))
            if not self._warned:
                self._warned = True
                log.warning("fast path not reachable (%s); using gRPC",
                            "; ".join(problems) or "no address")
            return None

    def drop(self, fast: FastPath) -> None:
        """Stop using `fast` (it failed): its connections close, but a lease lane's that
        holds leases stays open until they end (kvstore_client.holdings): other threads
        are reading or writing under them."""
        with self._lock:
            if self._fast is fast:
                self._fast = None
                self._retry_at = time.monotonic() + 1.0
                self._dropped = True
        fast.close(keep_leased=True)

    def call(self, method: str, handle: LayoutHandle | None,
             fn: Callable[[Transport], T]) -> T:
        """fn on the fast path where it is open, else (or once it went away) on gRPC,
        mended after a server restart (transport.Recovery); handle: the layout the call
        names, registered again if the server forgot it."""
        fast = self._fast
        if fast is not None:
            # The common case, a fast path open and nothing to mend: one try, no closure
            # and no loop around it (an engine pays this per layer). What it raises is
            # handled as the loop below would.
            try:
                return fn(fast)
            except KVStoreError as exc:
                if not self._recovery.mends(exc, handle):
                    raise
                return self._recovery.run(lambda: self._once(fn), handle, exc)
            except FastPathUnavailable:
                self.drop(fast)             # the server went away: gRPC retries
            except NotCarried:              # this call only: gRPC, the fast path stays
                return self._recovery.run(lambda: fn(self.grpc), handle)
        return self._recovery.run(lambda: self._once(fn), handle)

    def ask(self, method: str, handle: LayoutHandle | None, op: str, *args):
        """call's form for the calls an engine makes per layer (get_into, put, lookup):
        the Transport method named op, with args. The open fast path's method is taken
        by name (getattr, in C), so a call makes no closure and runs one Python frame
        fewer; on a loaded machine each frame the call runs costs several times what it
        costs in a loop, its code and objects cold after the thread slept in recv.
        Refusals, a fast path gone and calls not carried are handled as in call."""
        fast = self._fast
        if fast is not None:
            try:
                return getattr(fast, op)(*args)
            except KVStoreError as exc:
                if not self._recovery.mends(exc, handle):
                    raise
                return self._recovery.run(
                    lambda: self._once(lambda t: getattr(t, op)(*args)), handle, exc)
            except FastPathUnavailable:
                self.drop(fast)             # the server went away: gRPC retries
            except NotCarried:              # this call only: gRPC, the fast path stays
                return self._recovery.run(lambda: getattr(self.grpc, op)(*args), handle)
        return self._recovery.run(lambda: self._once(lambda t: getattr(t, op)(*args)),
                                  handle)

    def _once(self, fn: Callable[[Transport], T]) -> T:
        """fn on the fast path where it is open (opened if due), else on gRPC."""
        fast = self.fast()
        if fast is not None:
            try:
                return fn(fast)
            except FastPathUnavailable:
                self.drop(fast)             # the server went away: gRPC retries
            except NotCarried:
                pass                        # this call only: gRPC, the fast path stays
        return fn(self.grpc)

    def get_layers(self, ns: LayoutHandle, key_size: int, packed: bytes, dest: Dest,
                   stop: threading.Event | None, reregister: Callable[[], object],
                   landed: Landed | None = None) -> Iterator[tuple[int, np.ndarray]]:
        """(layer, slab) as each layer arrives: over the fast path striped across its
        connections (kvstore_client.layerget), else, or when it went away before the
        first layer, over gRPC. A stream is mended only before its first byte (LayerGet
        registers the layout again); after it, the caller sees the error. landed(layer,
        slab) is called before each yield: over the fast path on the stripe thread that
        completed the layer (LayerGet), over gRPC here."""
        fast = self.fast()
        if fast is not None:
            try:
                yield from LayerGet(fast, ns.layout_id, key_size, packed,
                                    ns.layout.num_layers, ns.layer_bytes, dest, stop,
                                    reregister, landed)
                return
            except FastPathUnavailable:     # raised before any layer: gRPC instead
                self.drop(fast)
        for layer, slab in self.grpc.get_layers(ns, key_size, packed, dest, stop):
            if landed is not None:
                landed(layer, slab)
            yield layer, slab

    def close(self) -> None:
        self.grpc.close()
        with self._lock:
            fast, self._fast = self._fast, None
        if fast is not None:
            fast.close()
        self._holdings.close()
