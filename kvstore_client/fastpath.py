"""The client's side of the fast path: pooled connections speaking kvstore_client.fastwire.

    FastPath(address, token=...)        address: "HOST:PORT" (TCP) or a Unix socket path
      .lookup / .exists / .delete       microsecond control calls
      .get_into / .put                  page bytes between the socket and the caller's buffer
      .acquire / .reserve / .commit / .abort / .release   the shared-memory path's control

Connections are opened on first use, authenticated once (HELLO with the token), kept
open and reused; a call takes an idle one or opens another. A Get of many bytes is
striped over up to `connections` connections at once, each receiving its pages
straight into its slice of the caller's buffer. Lease calls (acquire, reserve, and the
commit, abort or release that end them) go over one connection of their own: the server
ends whatever leases a connection still holds when it closes, so a lease must be ended
on the connection that took it.

A connection that breaks in the middle of a call is dropped and the call is tried once
more on a fresh one; then the call fails with KVStoreError(UNAVAILABLE). A server that
cannot be reached at all raises FastPathUnavailable, which KVStoreClient answers by
using gRPC (kvstore_client.client).
"""

from __future__ import annotations

import collections
import concurrent.futures
import socket
import ssl
import struct
import threading
from typing import Callable, TypeVar

import logging

import grpc
import numpy as np

from . import fastwire as fw
from .errors import KVStoreError

__all__ = ["FastPath", "FastPathUnavailable", "FastLease"]

T = TypeVar("T")

log = logging.getLogger(__name__)

CODES = {
    fw.Status.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    fw.Status.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    fw.Status.EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    fw.Status.EXPIRED: grpc.StatusCode.FAILED_PRECONDITION,
    fw.Status.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    fw.Status.DENIED: grpc.StatusCode.PERMISSION_DENIED,
    fw.Status.INTERNAL: grpc.StatusCode.INTERNAL,
    fw.Status.PROTOCOL: grpc.StatusCode.INTERNAL,
    fw.Status.BUSY: grpc.StatusCode.UNAVAILABLE,
}
ANSWER_BUFFER = 64 << 10     # per connection
# A Get is striped over several connections only when each gets at least this much:
# below it, the extra round trips and thread hand-offs cost more than they bring.
STRIPE_MIN_BYTES = 16 << 20


class FastPathUnavailable(ConnectionError):
    """No fast-path connection could be opened (port closed, refused, busy)."""


class _Broken(ConnectionError):
    """A connection broke mid-call: retried once on a fresh one."""


class _Timeout(ConnectionError):
    """No byte moved for the call's timeout: the server is stalled, not gone. Not
    retried (as gRPC's DEADLINE_EXCEEDED is not); the connection is dropped."""


def _failed(exc: OSError, what: str) -> ConnectionError:
    """The error a socket failure becomes: SO_RCVTIMEO/SO_SNDTIMEO expiring shows as
    EAGAIN (BlockingIOError) on a blocking socket."""
    if isinstance(exc, (BlockingIOError, TimeoutError, socket.timeout)):
        return _Timeout(f"{what}: nothing moved within the timeout")
    return _Broken(f"{what} failed: {exc}")


def _deadline(method: str, exc: Exception) -> KVStoreError:
    return KVStoreError(grpc.StatusCode.DEADLINE_EXCEEDED, f"fast path: {exc}", method)


class FastLease:
    """What acquire and reserve answer: a lease id, the pages' pool offsets, skipped."""

    __slots__ = ("lease_id", "offsets", "skipped")

    def __init__(self, lease_id: int, offsets: np.ndarray, skipped: int = 0) -> None:
        self.lease_id = lease_id
        self.offsets = offsets
        self.skipped = skipped


class _Conn:
    """One authenticated connection; not thread-safe (a caller holds it for a call)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._head = bytearray(fw.HEADER.size)
        # Where an answer is received: header and body in one recv when it fits (a
        # lookup's or an acquire's does), so a small call costs one system call.
        self._rbuf = memoryview(bytearray(ANSWER_BUFFER))
        self.owed = 0        # answers of requests sent without waiting (release_later)
        self.timeout = -1.0  # the socket's SO_RCVTIMEO/SO_SNDTIMEO now

    def use_timeout(self, seconds: float) -> None:
        """Give up on any send or recv that moves nothing for this long (set only when
        it changes: two system calls). A call's timeout bounds each wait for progress,
        so a large get is not cut off while its bytes keep arriving."""
        if seconds != self.timeout:
            tv = struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
            self.timeout = seconds

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def send(self, op: int, body: bytes, data: memoryview | None = None, flags: int = 0
             ) -> None:
        head = fw.encode_header(op, len(body), 0 if data is None else data.nbytes,
                                flags=flags)
        try:
            self.sock.sendall(head + body if len(body) < 65536 else head)
            if len(body) >= 65536:
                self.sock.sendall(body)
            if data is not None:
                self.sock.sendall(data)
        except OSError as exc:
            raise _failed(exc, "sending") from None

    def recv_exact(self, view: memoryview) -> None:
        pos, n = 0, len(view)
        try:
            while pos < n:
                got = self.sock.recv_into(view[pos:], n - pos)
                if not got:
                    raise _Broken(f"the server closed the connection after {pos} of {n} "
                                  "bytes")
                pos += got
        except OSError as exc:
            if isinstance(exc, ConnectionError) and isinstance(exc, (_Broken, _Timeout)):
                raise
            raise _failed(exc, "receiving") from None

    def answer_into(self, op: int, method: str, out: memoryview) -> None:
        """A GET's answer: the header, then the pages straight into out. On a plain
        socket one recvmsg_into fills both, so a one-page get costs one system call."""
        head = memoryview(self._head)
        have = 0
        if isinstance(self.sock, ssl.SSLSocket):      # no recvmsg on TLS
            self.recv_exact(head)
        else:
            try:
                got = self.sock.recvmsg_into([head, out])[0]
            except OSError as exc:
                raise _failed(exc, "receiving") from None
            if not got:
                raise _Broken("the server closed the connection")
            if got < len(head):
                self.recv_exact(head[got:])
            have = max(0, got - len(head))
        try:
            h = fw.decode_header(self._head, request=False)
        except fw.WireError as exc:
            raise _Broken(str(exc)) from None
        if h.status:
            if h.body_len > fw.MAX_BODY:
                raise _Broken(f"error body of {h.body_len} bytes is past any bound")
            body = bytearray(out[:min(have, h.body_len)])
            rest = memoryview(bytearray(h.body_len - len(body)))
            self.recv_exact(rest)
            self._raise(h, memoryview(body + rest), method)
        if h.op != op or h.body_len or h.data_len != out.nbytes:
            raise _Broken(f"answer to op {h.op} with {h.body_len} + {h.data_len} bytes, "
                          f"expected op {op} with {out.nbytes} bytes of pages")
        self.recv_exact(out[have:])

    @staticmethod
    def _raise(h: fw.Header, body: memoryview, method: str) -> None:
        status = (fw.Status(h.status) if h.status in fw.Status._value2member_map_
                  else fw.Status.INTERNAL)
        message = bytes(body).decode(errors="replace")
        if status is fw.Status.PROTOCOL:
            raise _Broken(f"the server refused a frame: {message}")
        raise KVStoreError(CODES[status], message, method)

    def answer_head(self, op: int, method: str) -> fw.Header:
        """The header of an answer whose data follows (GET): read exactly, no further."""
        self.recv_exact(memoryview(self._head))
        try:
            h = fw.decode_header(self._head, request=False)
        except fw.WireError as exc:
            raise _Broken(str(exc)) from None
        if h.status:
            if h.body_len > fw.MAX_BODY:
                raise _Broken(f"error body of {h.body_len} bytes is past any bound")
            body = memoryview(bytearray(h.body_len))
            self.recv_exact(body)
            self._raise(h, body, method)
        if h.op != op or h.body_len:
            raise _Broken(f"answer to op {h.op} with a body of {h.body_len}, expected {op}")
        return h

    def settle(self) -> None:
        """Read the answers owed to requests sent without waiting, before a new call."""
        while self.owed:
            self.owed -= 1
            self.recv_exact(memoryview(self._head))
            h = fw.decode_header(self._head, request=False)
            body = memoryview(bytearray(h.body_len))
            self.recv_exact(body)
            if h.status:
                log.warning("a release sent without waiting failed (%s); the lease "
                            "expires by itself", bytes(body).decode(errors="replace"))

    def answer(self, op: int, method: str) -> tuple[fw.Header, memoryview]:
        """The header and body of the answer; KVStoreError if it is an error frame.
        The body is a view of this connection's buffer, valid until its next call.

        Nothing can follow the answer on the wire (the server answers only what was
        asked, and owed answers were read first), so one recv never reads past it."""
        buf = self._rbuf
        try:
            got = self.sock.recv_into(buf)
        except OSError as exc:
            raise _failed(exc, "receiving") from None
        if not got:
            raise _Broken("the server closed the connection")
        if got < fw.HEADER.size:
            self.recv_exact(buf[got:fw.HEADER.size])
            got = fw.HEADER.size
        try:
            h = fw.decode_header(buf[:fw.HEADER.size], request=False)
        except fw.WireError as exc:
            raise _Broken(str(exc)) from None
        if h.body_len > fw.MAX_BODY + fw.MAX_KEYS * 8 or got > fw.HEADER.size + h.body_len:
            raise _Broken(f"answer of {got} bytes, body of {h.body_len}: out of step")
        end = fw.HEADER.size + h.body_len
        if end <= len(buf):
            self.recv_exact(buf[got:end])
            body = buf[fw.HEADER.size:end]
        else:
            body = memoryview(bytearray(h.body_len))
            body[:got - fw.HEADER.size] = buf[fw.HEADER.size:got]
            self.recv_exact(body[got - fw.HEADER.size:])
        if h.status:
            self._raise(h, body, method)
        if h.op != op:
            raise _Broken(f"answer to op {h.op}, expected {op}")
        return h, body


def _keys_body(layout_id: bytes, key_size: int, packed: bytes) -> bytes:
    return fw.LAYOUT_HEAD.pack(layout_id) + fw.encode_keys(key_size, packed)


class FastPath:
    """A pool of fast-path connections to one server address."""

    def __init__(self, address: str, *, token: str | None = None,
                 tls: ssl.SSLContext | None = None,
                 timeout: float | Callable[[], float] = 10.0,
                 connections: int = 4) -> None:
        """address: HOST:PORT, or a path (with a '/') of a Unix socket. tls: wrap TCP
        connections (the server name is the host of address). connections: most
        connections one Get is striped over."""
        self.address = address
        self.token = token or ""
        self.tls = tls
        # Seconds a call may wait for progress; a callable is asked at every call, so a
        # client whose timeout changes (KVStoreClient.timeout) is obeyed at once.
        self._timeout = timeout if callable(timeout) else (lambda: timeout)
        self.connections = max(1, connections)
        # Idle connections, most recent last; deque's append and pop are atomic, so
        # taking one costs 24 ns where a queue.LifoQueue took 2 us (dev VM).
        self._idle: collections.deque[_Conn] = collections.deque()
        self._lease_lock = threading.Lock()        # guards _lease_conn and its use
        self._lease_conn: _Conn | None = None
        self._stripes: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False
        self.tenant = ""

    # -- connections ------------------------------------------------------------------
    def _connect(self) -> _Conn:
        try:
            if "/" in self.address:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(self._timeout())
                sock.connect(self.address)
            else:
                host, _, port = self.address.rpartition(":")
                host = host.strip("[]")
                sock = socket.create_connection((host, int(port)), timeout=self._timeout())
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self.tls is not None:
                    sock = self.tls.wrap_socket(sock, server_hostname=host)
        except (OSError, ValueError) as exc:
            raise FastPathUnavailable(f"cannot connect to the fast path at "
                                      f"{self.address}: {exc}") from None
        # Blocking from here, with the timeout in the kernel (SO_RCVTIMEO/SO_SNDTIMEO):
        # a Python timeout would poll() before every recv.
        sock.settimeout(None)
        conn = _Conn(sock)
        try:
            conn.use_timeout(self._timeout())
            conn.send(fw.Op.HELLO, self.token.encode())
            _, body = conn.answer(fw.Op.HELLO, "Hello")
        except (_Broken, _Timeout) as exc:
            conn.close()
            raise FastPathUnavailable(f"fast path at {self.address}: {exc}") from None
        except KVStoreError as exc:
            conn.close()
            if exc.code == grpc.StatusCode.UNAVAILABLE:
                raise FastPathUnavailable(exc.message) from None
            raise
        self.tenant = bytes(body).decode()
        return conn

    def _take(self) -> _Conn:
        try:
            return self._idle.pop()
        except IndexError:
            return self._connect()

    def _give(self, conn: _Conn) -> None:
        if self._closed or len(self._idle) >= 2 * self.connections:
            conn.close()
        else:
            self._idle.append(conn)

    def check(self) -> None:
        """Open (and keep) one connection now; FastPathUnavailable if none can be."""
        self._give(self._take())

    def close(self) -> None:
        self._closed = True
        while True:
            try:
                self._idle.pop().close()
            except IndexError:
                break
        with self._lease_lock:
            if self._lease_conn is not None:
                self._lease_conn.close()
                self._lease_conn = None
        if self._stripes is not None:
            self._stripes.shutdown(wait=False)

    def _run(self, method: str, fn: Callable[[_Conn], T]) -> T:
        """fn on a pooled connection; once more on a fresh one if it broke."""
        for attempt in (0, 1):
            conn = self._take() if attempt == 0 else self._connect()
            try:
                conn.use_timeout(self._timeout())
                result = fn(conn)
            except _Timeout as exc:
                conn.close()
                raise _deadline(method, exc) from None
            except _Broken as exc:
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
            self._give(conn)
            return result
        raise AssertionError("unreachable")

    def _leased(self, method: str, fn: Callable[[_Conn], T]) -> T:
        """fn on the lease connection, under its lock."""
        with self._lease_lock:
            for attempt in (0, 1):
                if self._lease_conn is None:
                    self._lease_conn = self._connect()
                try:
                    self._lease_conn.use_timeout(self._timeout())
                    self._lease_conn.settle()
                    return fn(self._lease_conn)
                except _Timeout as exc:
                    self._lease_conn.close()
                    self._lease_conn = None
                    raise _deadline(method, exc) from None
                except _Broken as exc:
                    self._lease_conn.close()
                    self._lease_conn = None
                    if attempt:
                        raise KVStoreError(grpc.StatusCode.UNAVAILABLE,
                                           f"fast-path connection broke twice: {exc}",
                                           method) from None
            raise AssertionError("unreachable")

    @staticmethod
    def _simple(conn: _Conn, op: fw.Op, body: bytes, method: str) -> memoryview:
        conn.send(op, body)
        return conn.answer(op, method)[1]

    # -- control ------------------------------------------------------------------------
    def lookup(self, layout_ids: list[bytes], key_size: int, packed: bytes,
               lease_ms: int = 0) -> tuple[int, int]:
        """(leading keys present in every layout, lease id or 0)."""
        body = (fw.LOOKUP_HEAD.pack(lease_ms, len(layout_ids)) + b"".join(layout_ids)
                + fw.encode_keys(key_size, packed))
        run = self._leased if lease_ms else self._run
        answer = run("Lookup", lambda c: self._simple(c, fw.Op.LOOKUP, body, "Lookup"))
        return fw.COUNT_LEASE.unpack_from(answer)

    def exists(self, layout_id: bytes, key_size: int, packed: bytes) -> list[bool]:
        answer = self._run("Exists", lambda c: self._simple(
            c, fw.Op.EXISTS, _keys_body(layout_id, key_size, packed), "Exists"))
        (n,) = fw.COUNT.unpack_from(answer)
        bits = np.unpackbits(np.frombuffer(answer[fw.COUNT.size:], dtype=np.uint8),
                             bitorder="little")
        return bits[:n].astype(bool).tolist()

    def delete(self, layout_id: bytes, key_size: int, packed: bytes) -> int:
        answer = self._run("Delete", lambda c: self._simple(
            c, fw.Op.DELETE, _keys_body(layout_id, key_size, packed), "Delete"))
        return fw.COUNT.unpack_from(answer)[0]

    def acquire(self, layout_id: bytes, key_size: int, packed: bytes, region_token: bytes,
                lease_ms: int = 0) -> FastLease:
        body = fw.LEASED_HEAD.pack(layout_id, region_token, lease_ms) + fw.encode_keys(
            key_size, packed)
        answer = self._leased("Acquire", lambda c: self._simple(c, fw.Op.ACQUIRE, body,
                                                                "Acquire"))
        (lease_id,) = fw.LEASE.unpack_from(answer)
        return FastLease(lease_id, fw.unpack_u64(answer[fw.LEASE.size:]).copy())

    def reserve(self, layout_id: bytes, key_size: int, packed: bytes, region_token: bytes,
                lease_ms: int = 0) -> FastLease:
        body = fw.LEASED_HEAD.pack(layout_id, region_token, lease_ms) + fw.encode_keys(
            key_size, packed)
        answer = self._leased("Reserve", lambda c: self._simple(c, fw.Op.RESERVE, body,
                                                                "Reserve"))
        lease_id, skipped = fw.RESERVED.unpack_from(answer)
        return FastLease(lease_id, fw.unpack_u64(answer[fw.RESERVED.size:]).copy(), skipped)

    def _end(self, op: fw.Op, method: str, lease_id: int) -> int:
        answer = self._leased(method, lambda c: self._simple(c, op, fw.LEASE.pack(lease_id),
                                                             method))
        return fw.LEASE.unpack_from(answer)[0]

    def commit(self, lease_id: int) -> int:
        return self._end(fw.Op.COMMIT, "Commit", lease_id)

    def abort(self, lease_id: int) -> bool:
        return bool(self._end(fw.Op.ABORT, "Abort", lease_id))

    def release(self, lease_id: int) -> bool:
        return bool(self._end(fw.Op.RELEASE, "ReleaseLease", lease_id))

    def release_later(self, lease_id: int) -> None:
        """Release without waiting for the answer: it is read before the lease
        connection's next call. Nothing is lost if the connection breaks first: the
        server releases a closed connection's leases itself."""
        with self._lease_lock:
            conn = self._lease_conn
            if conn is None:         # the connection that took it is gone, and its leases
                return
            try:
                conn.send(fw.Op.RELEASE, fw.LEASE.pack(lease_id))
                conn.owed += 1
            except (_Broken, _Timeout):
                conn.close()
                self._lease_conn = None

    # -- page bytes ---------------------------------------------------------------------
    def put(self, layout_id: bytes, key_size: int, packed: bytes, data: memoryview
            ) -> tuple[int, int]:
        """(stored, skipped); data: the pages, back to back, as one flat byte view."""
        body = _keys_body(layout_id, key_size, packed)

        def call(c: _Conn) -> tuple[int, int]:
            c.send(fw.Op.PUT, body, data)
            return fw.PUT_DONE.unpack_from(c.answer(fw.Op.PUT, "Put")[1])

        return self._run("Put", call)

    def get_into(self, layout_id: bytes, key_size: int, packed: bytes, out: memoryview,
                 page_bytes: int) -> None:
        """The pages of the keys, page after page, into out (n * page_bytes bytes);
        striped over several connections when it is large."""
        n = len(packed) // key_size if key_size else 0
        stripes = min(self.connections, n, max(1, out.nbytes // STRIPE_MIN_BYTES))
        if stripes <= 1:
            self._get_part(layout_id, key_size, packed, out)
            return
        if self._stripes is None:
            self._stripes = concurrent.futures.ThreadPoolExecutor(
                self.connections, thread_name_prefix="kvstore-fast")
        bounds = np.linspace(0, n, stripes + 1).astype(int).tolist()
        parts = [self._stripes.submit(
            self._get_part, layout_id, key_size, packed[a * key_size:b * key_size],
            out[a * page_bytes:b * page_bytes]) for a, b in zip(bounds, bounds[1:])]
        for part in parts:
            part.result()

    def _get_part(self, layout_id: bytes, key_size: int, packed: bytes, out: memoryview,
                  flags: int = fw.PAGE_MAJOR) -> None:
        body = _keys_body(layout_id, key_size, packed)

        def call(c: _Conn) -> None:
            c.send(fw.Op.GET, body, flags=flags)
            c.answer_into(fw.Op.GET, "Get", out)

        self._run("Get", call)

    def get_layers(self, layout_id: bytes, key_size: int, packed: bytes, layers: int,
                   layer_bytes: int, slab: Callable[[int], np.ndarray]):
        """Yield each layer as it arrives: the server sends every page's layer 0, then
        layer 1, ...; slab(layer) gives the (n, layer_bytes) buffer to fill."""
        body = _keys_body(layout_id, key_size, packed)
        n = len(packed) // key_size if key_size else 0
        conn = self._take()
        try:
            conn.use_timeout(self._timeout())
            conn.send(fw.Op.GET, body, flags=fw.LAYER_MAJOR)
            h = conn.answer_head(fw.Op.GET, "Get")
            if h.data_len != n * layers * layer_bytes:
                raise _Broken(f"Get answered {h.data_len} bytes, expected "
                              f"{n * layers * layer_bytes}")
            for layer in range(layers):
                buf = slab(layer)
                conn.recv_exact(memoryview(buf).cast("B"))
                yield layer, buf
        except _Timeout as exc:
            conn.close()
            raise _deadline("Get", exc) from None
        except _Broken as exc:
            conn.close()
            raise KVStoreError(grpc.StatusCode.UNAVAILABLE,
                               f"fast-path connection broke: {exc}", "Get") from None
        except BaseException:
            conn.close()          # the consumer stopped early, or an error frame
            raise
        self._give(conn)
