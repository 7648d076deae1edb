"""The client's side of the fast path: pooled connections speaking kvstore_protocol.fastwire.

    FastPath(address, token=...)        address: "HOST:PORT" (TCP) or a Unix socket path
      .lookup / .exists / .delete       microsecond control calls
      .get_into / .put                  page bytes between the socket and the caller's buffer
      .take / .fresh / .give            connections lent to a layer-major Get
                                        (kvstore_client.layerget)
      .acquire / .reserve / .commit / .abort / .release   the shared-memory path's control

Connections are opened on first use, authenticated once (HELLO with the token), kept
open and reused; a call takes an idle one or opens another. A Get of many bytes is
striped over up to `connections` connections at once, each receiving its pages
straight into its slice of the caller's buffer. Lease calls go over connections of their
own, one a lane: acquire and release (and a leased lookup) on one, reserve and the
commit or abort that ends it on the other. The server ends whatever leases a connection
still holds when it closes, so a lease must be ended on the connection that took it; a
lane's calls go one at a time.

A connection that breaks in the middle of a call is dropped and the call is tried once
more on a fresh one; then the call fails with KVStoreError(UNAVAILABLE). A server that
cannot be reached at all raises FastPathUnavailable, which KVStoreClient answers by
using gRPC (kvstore_client.client).

Over 400 lines because every call is written against the pool's two ways to run one
(pooled with one retry, _run; on a lease lane under its lock, _leased) and the answers a
lane owes (release_later, lookup_later), which read best beside them. Opening a
connection (connect, the Unix socket's check, HELLO: about 60 lines) is the part that
could move to fastconn.py, and the next split if this grows.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import itertools
import logging
import socket
import ssl
import threading
from collections.abc import Callable
from typing import TypeVar

import grpc
import numpy as np
from google.protobuf.message import DecodeError, Message

from kvstore_protocol import fastwire as fw
from kvstore_protocol.carriage import encode_call, messages
from kvstore_protocol.congestion import set_congestion

from .ahead import Flusher
from .errors import KVStoreError
from .fastconn import Broken, Conn, Timeout, deadline
from .holdings import Holdings
from .results import FastLease, Pins
from .transport import NotCarried
from .unixpeer import ServerIdentity, UntrustedSocket, check_path, check_peer

__all__ = ["FastLease", "FastPath", "FastPathUnavailable", "UntrustedPeer", "keys_body"]

T = TypeVar("T")

log = logging.getLogger(__name__)

# A Get is striped over several connections only when each gets at least this much:
# below it, the extra round trips and thread hand-offs cost more than they bring.
STRIPE_MIN_BYTES = 16 << 20


_ONE_LAYOUT_LOOKUP = fw.ONE_LAYOUT_LOOKUP
_LOOKUP = int(fw.Op.LOOKUP)
_RELEASE = int(fw.Op.RELEASE)
_COUNT_LEASE = fw.COUNT_LEASE
_PUT_DONE = fw.PUT_DONE

# Answers to lookups sent without waiting that a reads lane leaves unread (lookup_later).
_OWED_MAX = 32


class FastPathUnavailable(ConnectionError):
    """No fast-path connection could be opened (port closed, refused, busy)."""


class UntrustedPeer(FastPathUnavailable):
    """The Unix socket Attach named is not the server's (kvstore_client.unixpeer): no
    token was sent, and no other fast-path address is tried (gRPC instead)."""


class HelloTimedOut(FastPathUnavailable):
    """A connection was accepted but its HELLO not answered within the timeout. Found
    by the check that picks a path, the fast path is unavailable (gRPC then); met by
    a call on a path already in use, the server is not answering: the call's deadline,
    not a second try over gRPC that would cost another timeout."""


def _pins(answer: bytes, count: int, layout_ids: list[bytes]) -> Pins:
    """The pins after a LOOKUP answer's count and lease: one row of offsets per distinct
    layout id, in the order first named (as the server dedupes them)."""
    pos = fw.COUNT_LEASE.size
    if len(answer) < pos + fw.PINS_HEAD.size:
        raise KVStoreError(grpc.StatusCode.INTERNAL, "LOOKUP answer ends inside its pins",
                           "Lookup")
    region, ttl_ms, n = fw.PINS_HEAD.unpack_from(answer, pos)
    ids = list(dict.fromkeys(layout_ids))
    # A copy: numpy's view of bytes is read-only, and a caller may keep or change them.
    offsets = fw.unpack_u64(answer[pos + fw.PINS_HEAD.size:]).copy()
    if n != len(ids) or len(offsets) != n * count:
        raise KVStoreError(grpc.StatusCode.INTERNAL,
                           f"LOOKUP pins hold {len(offsets)} offsets for {n} layouts of "
                           f"{count} pages; asked over {len(ids)} layouts", "Lookup")
    rows = offsets.reshape(n, count)
    return Pins(region, ttl_ms / 1000.0, {lid: rows[i] for i, lid in enumerate(ids)})


def keys_body(layout_id: bytes, key_size: int, packed: bytes) -> bytes:
    """A layout id and its keys (fastwire.LAYOUT_KEYS_HEAD, then the packed keys)."""
    return fw.LAYOUT_KEYS_HEAD.pack(layout_id, key_size,
                                    len(packed) // key_size if key_size else 0) + packed


class _Lane:
    """One lease lane: its connection, opened on first use, and the lock of its calls."""

    __slots__ = ("conn", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()          # guards conn and its use
        self.conn: Conn | None = None


class FastPath:
    """A pool of fast-path connections to one server address."""

    def __init__(self, address: str, *, token: str | None = None,
                 tls: ssl.SSLContext | None = None,
                 timeout: float | Callable[[], float] = 10.0,
                 connections: int = 4, holdings: Holdings | None = None,
                 identity: ServerIdentity | None = None, congestion: str = "") -> None:
        """address: HOST:PORT, or a path (with a '/') of a Unix socket, which is used only
        when identity (from Attach) says who must listen there (kvstore_client.unixpeer). tls: wrap TCP
        connections (the server name is the host of address). connections: most
        connections one Get is striped over. holdings: which connection holds each
        lease, shared by the fast paths of one client (kvstore_client.holdings); None:
        one of its own, closed with this. congestion: the TCP connections' congestion
        control, what a Put's pages are sent under ("" = the host's;
        kvstore_protocol.congestion)."""
        self.address = address
        self.identity = identity
        self._own_holdings = holdings is None
        self._holdings = holdings if holdings is not None else Holdings()
        self.token = token or ""
        self.tls = tls
        self.congestion = congestion
        # Seconds a call may wait for progress; a callable is asked at every call, so a
        # client whose timeout changes (KVStoreClient.timeout) is obeyed at once.
        self._timeout = timeout if callable(timeout) else (lambda: timeout)
        self.connections = max(1, connections)
        # Idle connections, most recent last; deque's append and pop are atomic, so
        # taking one needs no lock (a queue.LifoQueue's lock cost more than the take).
        self._idle: collections.deque[Conn] = collections.deque()
        # Lease calls go one at a time over a connection of their own, a lane, so that
        # a release sent without waiting is read before the lane's next call. Two lanes:
        # reads (Acquire, Release, leased Lookup) and writes (Reserve, Commit, Abort).
        # On one lane, an engine's Acquire waited behind its step's Reserve, its copies
        # not yet begun.
        self._reads = _Lane()
        self._writes = _Lane()
        self._stripes: concurrent.futures.ThreadPoolExecutor | None = None
        # Sends the reads lane's held releases when no request carries them.
        self._ahead = Flusher(self._flush_ahead)
        self._closed = False
        self.tenant = ""
        # Whether the server carries unary calls in CALL frames (granted at HELLO).
        self.carries = False

    # -- connections ------------------------------------------------------------------
    def _connect(self) -> Conn:
        try:
            if "/" in self.address:
                sock = self._connect_unix()
            else:
                host, _, port = self.address.rpartition(":")
                host = host.strip("[]")
                sock = socket.create_connection((host, int(port)), timeout=self._timeout())
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self.congestion:
                    set_congestion(sock, self.congestion)
                if self.tls is not None:
                    sock = self.tls.wrap_socket(sock, server_hostname=host)
        except UntrustedSocket as exc:
            # Someone else's socket, or one we cannot vouch for: the token stays here.
            log.warning("fast path: not using the Unix socket %s, no token sent (%s); "
                        "gRPC instead", self.address, exc)
            raise UntrustedPeer(f"untrusted Unix socket {self.address}: {exc}") from None
        except (OSError, ValueError) as exc:
            raise FastPathUnavailable(f"cannot connect to the fast path at "
                                      f"{self.address}: {exc}") from None
        # Blocking from here, with the timeout in the kernel (SO_RCVTIMEO/SO_SNDTIMEO):
        # a Python timeout would poll() before every recv.
        sock.settimeout(None)
        conn = Conn(sock)
        try:
            conn.use_timeout(self._timeout())
            conn.send(fw.Op.HELLO, self.token.encode(),
                      flags=fw.QUIET | fw.ALIGNED | fw.CALLS)
            head, body = conn.answer(fw.Op.HELLO, "Hello")
            conn.quiet = bool(head.flags & fw.QUIET)
            conn.pad = fw.ALIGN_PAD if head.flags & fw.ALIGNED else 0
            self.carries = bool(head.flags & fw.CALLS)
        except Timeout as exc:
            conn.close()
            raise HelloTimedOut(f"fast path at {self.address}: {exc}") from None
        except Broken as exc:
            conn.close()
            raise FastPathUnavailable(f"fast path at {self.address}: {exc}") from None
        except KVStoreError as exc:
            conn.close()
            if exc.code == grpc.StatusCode.UNAVAILABLE:
                raise FastPathUnavailable(exc.message) from None
            raise
        self.tenant = bytes(body).decode()
        return conn

    def _connect_unix(self) -> socket.socket:
        """A connected Unix socket whose listener is the server Attach named (unixpeer):
        checked before the token is sent, on every connection, so one made after the
        server went away never reaches whoever bound the name since."""
        who = self.identity
        if who is None:
            raise UntrustedSocket(f"{self.address}: no server identity (Attach) to check "
                                  "the socket against")
        check_path(self.address, who)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self._timeout())
            sock.connect(self.address)
            check_peer(sock, self.address, who)
        except BaseException:
            sock.close()
            raise
        return sock

    def _take(self) -> Conn:
        try:
            return self._idle.pop()
        except IndexError:
            return self._connect()

    def _give(self, conn: Conn) -> None:
        if self._closed or len(self._idle) >= 2 * self.connections:
            conn.close()
        else:
            self._idle.append(conn)

    # -- lent to kvstore_client.layerget, which reads one Get on several at once ------
    def take(self) -> Conn:
        """An idle connection, or a new one."""
        return self._take()

    def fresh(self) -> Conn:
        """A new connection (a pooled one was found broken)."""
        return self._connect()

    def give(self, conn: Conn) -> None:
        """Back to the pool, in step (its call answered in full)."""
        self._give(conn)

    @property
    def timeout(self) -> float:
        return self._timeout()

    def check(self) -> None:
        """Open (and keep) one connection now; FastPathUnavailable if none can be."""
        self._give(self._take())

    def close(self, keep_leased: bool = False) -> None:
        """Close every connection. keep_leased: a lane's connection that holds leases
        is retired instead (Holdings), so that they do not end with it."""
        self._closed = True
        self._ahead.close()
        while True:
            try:
                self._idle.pop().close()
            except IndexError:
                break
        for lane in (self._reads, self._writes):
            with lane.lock:
                if lane.conn is not None:
                    with contextlib.suppress(OSError, ConnectionError):
                        lane.conn.send_held()       # a kept connection, too
                    if keep_leased:
                        self._holdings.let_go(lane.conn)
                    else:
                        self._holdings.lost(lane.conn)
                    lane.conn = None
        if self._own_holdings and not keep_leased:
            self._holdings.close()
        if self._stripes is not None:
            self._stripes.shutdown(wait=False)

    def _open(self, method: str, fresh: bool) -> Conn:
        """An idle pooled connection (it is authenticated), or a new one if fresh or
        none is idle; a server that accepts but does not answer is method's deadline."""
        try:
            return self._connect() if fresh else self._take()
        except HelloTimedOut as exc:
            raise deadline(method, exc) from None

    def _run(self, method: str, fn: Callable[..., T], *args) -> T:
        """fn(conn, *args) on a pooled connection; once more on a fresh one if it broke.
        fn is a Conn method, args its own: no closure a call (an engine calls per layer)."""
        for attempt in (0, 1):
            if attempt:
                conn = self._open(method, fresh=True)
            else:
                try:
                    conn = self._idle.pop()
                except IndexError:
                    conn = self._open(method, fresh=False)
            try:
                timeout = self._timeout()
                if timeout != conn.timeout:
                    conn.use_timeout(timeout)
                result = fn(conn, *args)
            except Timeout as exc:
                conn.close()
                raise deadline(method, exc) from None
            except Broken as exc:
                conn.close()
                if attempt:
                    raise KVStoreError(grpc.StatusCode.UNAVAILABLE,
                                       f"fast-path connection broke twice: {exc}",
                                       method) from None
                continue
            except KVStoreError:
                self._give(conn)      # an error frame: the connection is in step
                raise
            except BaseException:
                conn.close()          # mid-frame state unknown: never reuse it
                raise
            if self._closed or len(self._idle) >= 2 * self.connections:
                conn.close()          # as _give, inline
            else:
                self._idle.append(conn)
            return result
        raise AssertionError("unreachable")

    def _leased(self, method: str, fn: Callable[[Conn], T], lane: _Lane | None = None) -> T:
        """fn on a lease lane's connection (the reads lane by default), under its lock."""
        lane = lane or self._reads
        with lane.lock:
            for attempt in (0, 1):
                if lane.conn is None:
                    lane.conn = self._open(method, fresh=attempt > 0)
                try:
                    timeout = self._timeout()
                    if timeout != lane.conn.timeout:
                        lane.conn.use_timeout(timeout)
                    return fn(lane.conn)     # _simple reads owed answers first
                except Timeout as exc:
                    self._drop(lane, exc)
                    raise deadline(method, exc) from None
                except Broken as exc:
                    self._drop(lane, exc)
                    if attempt:
                        raise KVStoreError(grpc.StatusCode.UNAVAILABLE,
                                           f"fast-path connection broke twice: {exc}",
                                           method) from None
            raise AssertionError("unreachable")

    def _drop(self, lane: _Lane, exc: Broken | Timeout) -> None:
        """Take the lane's connection out of use after exc, mid-frame (under the lane's
        lock). Broken: its leases ended with it on the server. Timed out: out of step, so
        not used again, but kept open while it holds leases (Holdings.let_go)."""
        conn, lane.conn = lane.conn, None
        if conn is None:
            return
        if isinstance(exc, Timeout):
            self._holdings.let_go(conn)
        else:
            self._holdings.lost(conn)

    @staticmethod
    def _simple(conn: Conn, op: fw.Op, body: bytes, method: str,
                flags: int = 0) -> bytes:
        """A lane's call: Conn.call (which reads the answers owed first)."""
        return conn.call(op, body, method, flags)

    # -- control ------------------------------------------------------------------------
    def lookup(self, layout_ids: list[bytes], key_size: int, packed: bytes,
               lease_ms: int = 0, pins: bool = False) -> tuple[int, int, Pins | None]:
        """(leading keys present in every layout, lease id or 0, where the pages lie or
        None). pins: ask for where they lie (fastwire.PINS; a leased lookup only)."""
        n = len(packed) // key_size if key_size else 0
        if len(layout_ids) == 1:          # the common lookup: its head in one pack
            body = _ONE_LAYOUT_LOOKUP.pack(lease_ms, 1, layout_ids[0], key_size, n) + packed
        else:
            body = (fw.LOOKUP_HEAD.pack(lease_ms, len(layout_ids)) + b"".join(layout_ids)
                    + fw.encode_keys(key_size, packed))
        if not lease_ms:
            count, lease_id = _COUNT_LEASE.unpack_from(
                self._run("Lookup", Conn.call, _LOOKUP, body, "Lookup"))
            return count, lease_id, None
        flags = fw.PINS if pins else 0

        def call(c: Conn) -> bytes:
            answer = c.call(_LOOKUP, body, "Lookup", flags)
            if len(answer) == fw.COUNT_LEASE.size:
                # Without pins the lease is the connection's (with them it ends only by
                # RELEASE or its ttl: another process reads under it).
                self._holdings.took(c, fw.COUNT_LEASE.unpack_from(answer)[1])
            return answer

        answer = self._leased("Lookup", call)
        count, lease_id = fw.COUNT_LEASE.unpack_from(answer)
        if len(answer) == fw.COUNT_LEASE.size or not flags:
            return count, lease_id, None
        return count, lease_id, _pins(answer, count, layout_ids)

    def exists(self, layout_id: bytes, key_size: int, packed: bytes) -> list[bool]:
        answer = self._run("Exists", Conn.call, fw.Op.EXISTS,
                           keys_body(layout_id, key_size, packed), "Exists")
        (n,) = fw.COUNT.unpack_from(answer)
        bits = np.unpackbits(np.frombuffer(answer[fw.COUNT.size:], dtype=np.uint8),
                             bitorder="little")
        return bits[:n].astype(bool).tolist()

    def delete(self, layout_id: bytes, key_size: int, packed: bytes) -> int:
        answer = self._run("Delete", Conn.call, fw.Op.DELETE,
                           keys_body(layout_id, key_size, packed), "Delete")
        return fw.COUNT.unpack_from(answer)[0]

    def acquire(self, layout_id: bytes, key_size: int, packed: bytes, region_token: bytes,
                lease_ms: int = 0) -> FastLease:
        body = fw.LEASED_HEAD.pack(layout_id, region_token, lease_ms) + fw.encode_keys(
            key_size, packed)
        answer = self._leased("Acquire", lambda c: self._took(
            c, self._simple(c, fw.Op.ACQUIRE, body, "Acquire")))
        (lease_id,) = fw.LEASE.unpack_from(answer)
        return FastLease(lease_id, fw.unpack_u64(answer[fw.LEASE.size:]).copy())

    def reserve(self, layout_id: bytes, key_size: int, packed: bytes, region_token: bytes,
                lease_ms: int = 0) -> FastLease:
        body = fw.LEASED_HEAD.pack(layout_id, region_token, lease_ms) + fw.encode_keys(
            key_size, packed)
        answer = self._leased("Reserve", lambda c: self._took(
            c, self._simple(c, fw.Op.RESERVE, body, "Reserve")), self._writes)
        lease_id, skipped, in_flight = fw.RESERVED.unpack_from(answer)
        return FastLease(lease_id, fw.unpack_u64(answer[fw.RESERVED.size:]).copy(), skipped,
                         in_flight)

    def _took(self, conn: Conn, answer: bytes) -> bytes:
        """An ACQUIRE's or RESERVE's answer, its lease (first in it) held by conn."""
        self._holdings.took(conn, fw.LEASE.unpack_from(answer)[0])
        return answer

    def _end(self, op: fw.Op, method: str, lease_id: int, lane: _Lane, read: int = 0) -> int:
        body = fw.LEASE.pack(lease_id) + (fw.READ.pack(read) if read else b"")
        try:
            answer = self._leased(method, lambda c: c.call(op, body, method), lane)
        finally:
            # Ended, refused or timed out: its connection no longer keeps it (a retired
            # one holding nothing else closes, which ends it on the server at the latest).
            self._holdings.ended(lease_id)
        return fw.LEASE.unpack_from(answer)[0]

    def commit(self, lease_id: int) -> int:
        return self._end(fw.Op.COMMIT, "Commit", lease_id, self._writes)

    def abort(self, lease_id: int) -> bool:
        return bool(self._end(fw.Op.ABORT, "Abort", lease_id, self._writes))

    def release(self, lease_id: int, pages_read: int = 0) -> bool:
        """pages_read: the lease's pages read from the pool, counted as served."""
        return bool(self._end(fw.Op.RELEASE, "ReleaseLease", lease_id, self._reads,
                              pages_read))

    def release_later(self, lease_id: int, pages_read: int = 0) -> None:
        """Release without waiting for the answer: it is read before the next call on
        its lane. If the connection broke, the server has released its leases."""
        lane = self._reads
        body = fw.LEASE.pack(lease_id) + (fw.READ.pack(pages_read) if pages_read else b"")
        with lane.lock:
            conn = lane.conn
            if conn is not None:
                try:
                    if conn.quiet and conn.tcp:
                        # No answer comes (fastwire.QUIET): held, it goes in the lane's
                        # next request's send (kvstore_client.ahead). Over TCP only: a
                        # same-host client (the Unix socket) copies from the pool and
                        # may look at the server's leases at once (stats, an evict).
                        conn.hold(_RELEASE, body, fw.QUIET)
                        self._ahead.arm()
                    elif conn.quiet:
                        conn.hold(_RELEASE, body, fw.QUIET)
                        conn.send_held()
                    else:
                        conn.send(fw.Op.RELEASE, body)
                        conn.owed += 1
                    self._holdings.ended(lease_id)
                    return
                except (Broken, Timeout) as exc:
                    self._drop(lane, exc)
        # No connection on the lane, or its send failed: the lease was taken elsewhere
        # (over gRPC while the fast path was down, or on a connection since retired or
        # closed): end it by waiting, on a connection of its own.
        self.release(lease_id, pages_read)

    def _flush_ahead(self) -> None:
        """Send the reads lane's held releases that no request carried (ahead.Flusher)."""
        lane = self._reads
        with lane.lock:
            self._ahead.disarm()
            conn = lane.conn
            if conn is None or not conn.held:
                return
            try:
                conn.send_held()
            except (Broken, Timeout) as exc:
                self._drop(lane, exc)

    def lookup_later(self, layout_ids: list[bytes], key_size: int, packed: bytes) -> bool:
        """A LOOKUP flagged MISSED whose answer is read before the next call on the reads
        lane, not waited for: a miss answered on this host from the presence map
        (kvstore_client.presence) still reaches the server's counts, at the cost of one
        send. False if it could not be sent (the counts then miss it; nothing else)."""
        body = (fw.LOOKUP_HEAD.pack(0, len(layout_ids)) + b"".join(layout_ids)
                + fw.encode_keys(key_size, packed))
        lane = self._reads
        with lane.lock:
            try:
                if lane.conn is None:
                    lane.conn = self._open("Lookup", fresh=False)
                elif lane.conn.owed >= _OWED_MAX:
                    # Read the answers now and then: unread, they would fill the socket
                    # and stall the server's sends (and then this one).
                    lane.conn.settle()
                lane.conn.send(fw.Op.LOOKUP, body, flags=fw.MISSED)
                lane.conn.owed += 1
                return True
            except (KVStoreError, FastPathUnavailable):
                return False
            except (Broken, Timeout) as exc:
                self._drop(lane, exc)
                return False

    # -- calls with no frame of their own ---------------------------------------------
    def unary(self, method: str, request: Message) -> Message:
        """A unary KVStore call carried whole in a CALL frame (kvstore_protocol.carriage);
        NotCarried where the server does not carry it (the chooser uses gRPC then).
        Retention and the removals feed ride here; a new call does too, once the server
        names it in KVStoreService.CARRIED."""
        types = messages(method)
        if types is None or not self.carries:
            raise NotCarried(method)
        body = encode_call(method, request.SerializeToString())

        def call(c: Conn) -> Message:
            c.send(fw.Op.CALL, body)
            answer = c.answer(fw.Op.CALL, method)[1]
            try:
                return types[1].FromString(bytes(answer))
            except DecodeError as exc:
                raise KVStoreError(grpc.StatusCode.INTERNAL, f"the server's answer is not "
                                   f"a {types[1].__name__}: {exc}", method) from None

        try:
            return self._run(method, call)
        except KVStoreError as exc:
            if exc.code == grpc.StatusCode.UNIMPLEMENTED:
                raise NotCarried(method) from None
            raise

    # -- page bytes ---------------------------------------------------------------------
    def put(self, layout_id: bytes, key_size: int, packed: bytes, data: memoryview
            ) -> tuple[int, int, int]:
        """(stored, skipped, in flight); data: the pages, back to back, as one flat byte
        view."""
        return _PUT_DONE.unpack_from(self._run("Put", Conn.put, layout_id, key_size, packed,
                                               data))

    def get_into(self, layout_id: bytes, key_size: int, packed: bytes, out: memoryview,
                 page_bytes: int, layers: int = 1) -> None:
        """The pages of the keys, page after page, into out (n * page_bytes bytes);
        striped over several connections when it is large. layers: unused here (the
        fast path's GET answers page-major; gRPC's answers layer-major)."""
        if out.nbytes < 2 * STRIPE_MIN_BYTES or self.connections == 1:
            self._run("Get", Conn.get, layout_id, key_size, packed, out)   # one stripe
            return
        n = len(packed) // key_size if key_size else 0
        stripes = min(self.connections, n, out.nbytes // STRIPE_MIN_BYTES)
        if stripes <= 1:
            self._run("Get", Conn.get, layout_id, key_size, packed, out)
            return
        if self._stripes is None:
            self._stripes = concurrent.futures.ThreadPoolExecutor(
                self.connections, thread_name_prefix="kvstore-fast")
        bounds = np.linspace(0, n, stripes + 1).astype(int).tolist()
        parts = [self._stripes.submit(
            self._run, "Get", Conn.get, layout_id, key_size,
            packed[a * key_size:b * key_size], out[a * page_bytes:b * page_bytes])
            for a, b in itertools.pairwise(bounds)]
        for part in parts:
            part.result()
