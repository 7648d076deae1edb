"""The fast path's listeners: TCP for remote clients, a Unix socket beside the pool.

One thread per connection, each blocked in recv_into, sendfile or sendmsg with the GIL
released: up to `hello_connections` not yet authenticated, each for at most
`hello_timeout`, and `max_connections` authenticated, a tenant at most its share of them
(admission.py; a connection past a limit gets a BUSY frame and is closed; its client
uses gRPC). Threads rather than an event loop because
every step of a call is one blocking system call that releases the GIL, and because a
Get of 192 MiB is then one sendfile, not a loop of partial non-blocking sends; the
measurements behind it are in docs/fastpath.md.

The Unix socket lies in a folder only the server's user may write, with the pool's mode
and group, so exactly the users who may map the pool may connect (unixsock.py says why
and how); a client finds it from Attach. It is removed at stop.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import ssl
import threading
import time

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvstore_protocol import fastwire as fw
from kvstore_protocol.congestion import CongestionRefused, congestion_of, set_congestion

from ..auth import Authenticator
from ..metrics import Metrics
from ..rpc.carriage import Carriage
from ..rpc.limits import RequestLimits
from ..rpc.service import KVStoreService
from ..store import Store
from .admission import Admission, Ticket
from .connection import Connection
from .ops import SEND_SENDMSG, Ops
from .unixsock import unix_listener

__all__ = ["FastPathServer"]

log = logging.getLogger(__name__)

# The longest a connection may take from accept to the end of its HELLO (TLS handshake
# included): --stream-timeout where that is shorter. A client sends HELLO at once, and a
# TLS handshake takes a few round trips; an unauthenticated place is held no longer.
HELLO_TIMEOUT = 10.0


class FastPathServer:
    """Accepts fast-path connections on TCP and a Unix socket; `start()`, `stop()`."""

    def __init__(self, store: Store, metrics: Metrics, auth: Authenticator | None, *,
                 tcp: tuple[str, int] | None, unix: str, tls: ssl.SSLContext | None = None,
                 max_connections: int = 256, idle_timeout: float = 300.0,
                 stream_timeout: float = 30.0, send_mode: str = SEND_SENDMSG,
                 limits: RequestLimits | None = None, hello_connections: int = 64,
                 congestion: str = "") -> None:
        """tcp: (host, port) to listen on, port 0 = any; None = no TCP. unix: the path of
        a Unix socket to listen on too (unixsock.socket_path), "" = none. tls: wraps TCP
        connections (never the Unix socket).
        limits: what one request may ask for; pass the gRPC service's, so that both paths
        refuse the same requests (None = the defaults). max_connections: authenticated
        connections; hello_connections: connections not yet authenticated (admission.py).
        stream_timeout: the longest one receive or send inside a frame waits (0 = the
        idle timeout). congestion: the TCP connections' congestion control ("" = the
        host's; CongestionRefused where the kernel will not give it:
        kvstore_protocol.congestion)."""
        self.store = store
        self.metrics = metrics
        self.auth = auth
        self.tls = tls
        self.max_connections = max_connections
        self.idle_timeout = idle_timeout
        self.stream_timeout = stream_timeout
        self.hello_timeout = min(stream_timeout or HELLO_TIMEOUT, HELLO_TIMEOUT)
        self.admission = Admission(max_connections, hello_connections,
                                   per_tenant=auth is not None)
        # CALL frames are served by a KVStoreService of this store: the methods, and so
        # the rules, the gRPC path runs (rpc/carriage.py).
        self.ops = Ops(store, auth is not None, send_mode, limits,
                       Carriage(KVStoreService(store, metrics, auth, limits)))
        self._lock = threading.Lock()          # guards the fields below
        self._open: set[socket.socket] = set()
        self.accepted = 0
        self.refused: dict[str, int] = {}      # reason -> connections refused
        self._listeners: list[tuple[socket.socket, bool]] = []   # (socket, is TLS-able)
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self.port = 0
        self.unix_path = ""
        self.congestion = ""                   # the TCP connections' (logged at start)
        if tcp is not None:
            family = socket.AF_INET6 if ":" in tcp[0] else socket.AF_INET
            lsock = socket.socket(family, socket.SOCK_STREAM)
            lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                if congestion:
                    set_congestion(lsock, congestion)
                lsock.bind((tcp[0].strip("[]"), tcp[1]))
            except (OSError, CongestionRefused):
                lsock.close()
                self.ops.close()
                raise
            lsock.listen(128)
            self.port = lsock.getsockname()[1]
            self.congestion = congestion_of(lsock)
            self._listeners.append((lsock, True))
        if unix:
            try:
                self._listeners.append((unix_listener(unix, store.region.path), False))
            except OSError:
                for lsock, _ in self._listeners:
                    lsock.close()
                self.ops.close()
                raise
            self.unix_path = unix
        metrics.registry.register(_Collector(self))

    # -- life -------------------------------------------------------------------------
    def start(self) -> None:
        for lsock, tcp in self._listeners:
            thread = threading.Thread(target=self._accept, args=(lsock, tcp), daemon=True,
                                      name="fast-accept-tcp" if tcp else "fast-accept-unix")
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """Stop accepting, end every open connection (their leases are released)."""
        self._stopping.set()
        for lsock, _ in self._listeners:
            with contextlib.suppress(OSError):
                lsock.shutdown(socket.SHUT_RDWR)
            lsock.close()
        with self._lock:
            open_now = list(self._open)
        for sock in open_now:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(timeout=2)
        if self.unix_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.unix_path)
        self.ops.close()

    def open_connections(self) -> int:
        with self._lock:
            return len(self._open)

    # -- connections ------------------------------------------------------------------
    def _accept(self, lsock: socket.socket, tcp: bool) -> None:
        while not self._stopping.is_set():
            try:
                sock, _ = lsock.accept()
            except OSError:
                if self._stopping.is_set():
                    return
                log.exception("fast path: accept failed")
                continue
            ticket = self.admission.arrive()
            if ticket is None:
                self._count_refused("busy")
                _refuse_busy(sock, self.admission.hello_limit)
                continue
            with self._lock:
                self._open.add(sock)
                self.accepted += 1
            thread = threading.Thread(target=self._serve, args=(sock, tcp, ticket),
                                      daemon=True, name="fast-conn")
            thread.start()

    def _serve(self, sock: socket.socket, tcp: bool, ticket: Ticket) -> None:
        raw = sock
        deadline = time.monotonic() + self.hello_timeout      # TLS handshake and HELLO
        try:
            if tcp:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tcp and self.tls is not None:
                try:
                    sock = self.tls.wrap_socket(sock, server_side=True,
                                                do_handshake_on_connect=False)
                    # One deadline for the whole handshake: CPython's SSL layer waits at
                    # most the socket's timeout over all of do_handshake's reads.
                    sock.settimeout(max(deadline - time.monotonic(), 0.001))
                    sock.do_handshake()
                except (ssl.SSLError, OSError) as exc:
                    self._count_refused("tls")
                    log.debug("fast path: TLS handshake failed: %s", exc)
                    return
            Connection(sock, self.ops, self.auth, idle_timeout=self.idle_timeout,
                       stream_timeout=self.stream_timeout, plain=sock is raw,
                       observe=self.metrics.observe, refused=self._count_refused,
                       hello_deadline=deadline,
                       admit=lambda tenant: self.admission.authenticate(ticket, tenant)).run()
        finally:
            self.admission.leave(ticket)
            with self._lock:
                self._open.discard(raw)
            with contextlib.suppress(OSError):
                raw.close()

    def _count_refused(self, reason: str) -> None:
        with self._lock:
            self.refused[reason] = self.refused.get(reason, 0) + 1


def _refuse_busy(sock: socket.socket, limit: int) -> None:
    message = (f"the server has {limit} fast-path connections not yet authenticated, its "
               "limit (--data-hello-connections): use gRPC or try again").encode()
    try:
        sock.settimeout(1.0)
        sock.sendall(fw.encode_header(fw.Op.HELLO, len(message), 0, fw.Status.BUSY) + message)
    except OSError:
        pass
    finally:
        sock.close()


class _Collector:
    """Fast-path connection gauges and counters, read at scrape time. Per-call latency
    and outcomes go to kvstore_rpc_duration_seconds as methods FastGet, FastPut, ..."""

    def __init__(self, server: FastPathServer) -> None:
        self._server = server

    def collect(self):
        s = self._server
        g = GaugeMetricFamily("kvstore_fast_connections", "Open fast-path connections")
        g.add_metric([], s.open_connections())
        yield g
        h = GaugeMetricFamily("kvstore_fast_hello_connections",
                              "Fast-path connections not yet authenticated")
        h.add_metric([], s.admission.counts()[0])
        yield h
        c = CounterMetricFamily("kvstore_fast_accepted", "Fast-path connections accepted")
        c.add_metric([], s.accepted)
        yield c
        r = CounterMetricFamily("kvstore_fast_refused",
                                "Fast-path connections refused, by reason", labels=["reason"])
        with s._lock:
            refused = dict(s.refused)
        for reason, n in sorted(refused.items()):
            r.add_metric([reason], n)
        yield r

