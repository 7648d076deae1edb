"""One fast-path connection: frames out, answers in (kvstore_protocol.fastwire).

Not thread-safe: FastPath (kvstore_client.fastpath) lends a connection to one call at a
time. A socket failure becomes Broken (the call is tried once more on a fresh
connection) or Timeout (nothing moved for the call's timeout: DEADLINE_EXCEEDED, not
retried); an error frame becomes KVStoreError with the status gRPC would give.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import struct

import grpc

from kvstore_protocol import fastwire as fw

from .errors import KVStoreError

__all__ = ["Broken", "Conn", "Timeout", "deadline"]

log = logging.getLogger(__name__)

ANSWER_BUFFER = 64 << 10     # per connection
SEND_BYTES = 2 << 20         # at most per send of page bytes (Conn.send)

_GET = int(fw.Op.GET)
_PUT = int(fw.Op.PUT)
_HEADER = fw.HEADER
_HEAD = fw.HEADER.size
_MAGIC = fw.MAGIC
_VERSION = fw.VERSION
# A GET request's header, layout id and keys' head, packed at once (Conn.get).
_GET_REQUEST = struct.Struct(fw.HEADER.format + fw.LAYOUT_KEYS_HEAD.format.lstrip("<"))
_SMALL_BODY = 65536          # a body below this goes in one send with its header
# A PUT request's header, layout id and keys' head, packed at once (Conn.put).
_PUT_REQUEST = _GET_REQUEST
_KEYS_HEAD = fw.LAYOUT_KEYS_HEAD.size


class Broken(ConnectionError):
    """A connection broke mid-call: retried once on a fresh one."""


class Timeout(ConnectionError):
    """No byte moved for the call's timeout: the server is stalled, not gone. Not
    retried (as gRPC's DEADLINE_EXCEEDED is not); the connection is dropped."""


def _failed(exc: OSError, what: str) -> ConnectionError:
    """The error a socket failure becomes: SO_RCVTIMEO/SO_SNDTIMEO expiring shows as
    EAGAIN (BlockingIOError) on a blocking socket."""
    if isinstance(exc, (BlockingIOError, TimeoutError, socket.timeout)):
        return Timeout(f"{what}: nothing moved within the timeout")
    return Broken(f"{what} failed: {exc}")


def deadline(method: str, exc: Exception) -> KVStoreError:
    return KVStoreError(grpc.StatusCode.DEADLINE_EXCEEDED, f"fast path: {exc}", method)


class Conn:
    """One authenticated connection; not thread-safe (a caller holds it for a call)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        # A GET answer's header, and its ALIGN_PAD body where the server granted ALIGNED.
        self._head = bytearray(fw.HEADER.size + fw.ALIGN_PAD)
        self._pre = memoryview(self._head)[:_HEAD]    # what comes before a GET's pages
        self._pad = 0
        self.plain = not isinstance(sock, ssl.SSLSocket)
        self.tcp = self.plain and sock.family in (socket.AF_INET, socket.AF_INET6)
        # Frames that need no answer, held to go in one send with this connection's
        # next request (Conn.hold); b"" when none is.
        self.held = b""
        # Where an answer is received: header and body in one recv when it fits (a
        # lookup's or an acquire's does), so a small call costs one system call.
        self._rbuf = memoryview(bytearray(ANSWER_BUFFER))
        self.owed = 0        # answers of requests sent without waiting (release_later)
        self.quiet = False   # the server sends no answer to a RELEASE flagged QUIET
        self.timeout = -1.0  # the socket's SO_RCVTIMEO/SO_SNDTIMEO now

    @property
    def pad(self) -> int:
        """fastwire.ALIGN_PAD once the server granted ALIGNED, else 0."""
        return self._pad

    @pad.setter
    def pad(self, pad: int) -> None:
        self._pad = pad
        self._pre = memoryview(self._head)[:_HEAD + pad]

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
        """Close, sending what is held first (a QUIET release of a lease with pins
        outlives the connection: it must still reach the server)."""
        with contextlib.suppress(OSError, ConnectionError):
            self.send_held()
        with contextlib.suppress(OSError):
            self.sock.close()

    def send(self, op: int, body: bytes, data: memoryview | None = None, flags: int = 0
             ) -> None:
        head = fw.encode_header(op, len(body), 0 if data is None else data.nbytes,
                                flags=flags)
        if self.held:
            head, self.held = self.held + head, b""
        try:
            frame = head + body if len(body) < 65536 else head
            if data is not None and data.nbytes <= SEND_BYTES and len(body) < 65536 \
                    and self.plain:
                # A Put of a few pages: frame and pages in one sendmsg, not two sends.
                self._sendmsg(frame, data)
                return
            self.sock.sendall(frame)
            if len(body) >= 65536:
                self.sock.sendall(body)
            if data is not None:
                # In pieces: one send of 128 MiB moved less over loopback than
                # sends of a few MiB (the server's send_views says more).
                if data.ndim != 1 or data.itemsize != 1:
                    data = data.cast("B")
                for start in range(0, data.nbytes, SEND_BYTES):
                    self.sock.sendall(data[start:start + SEND_BYTES])
        except OSError as exc:
            raise _failed(exc, "sending") from None

    # A frame that needs no answer (a QUIET release over TCP) is held here and goes in
    # the one send of this connection's next request: the server wakes once for both,
    # and the client makes one system call, not two. It used to be sent at once flagged
    # MSG_MORE (the kernel held it), which saved the server's wake-up but not the
    # client's system call. When no request follows, the owner sends it by itself
    # (send_held) within a bound it sets (kvstore_client.ahead); closing the connection
    # sends it too.
    def hold(self, op: int, body: bytes, flags: int = 0) -> None:
        """Hold a small frame for the next request's send (see above)."""
        self.held += _HEADER.pack(_MAGIC, _VERSION, op, 0, flags, len(body), 0) + body

    def send_held(self) -> None:
        """Send what is held now (no request followed it)."""
        held, self.held = self.held, b""
        if held:
            try:
                self.sock.sendall(held)
            except OSError as exc:
                raise _failed(exc, "sending") from None

    def _sendmsg(self, frame: bytes, data: memoryview) -> None:
        """frame then data, in one sendmsg when the kernel takes it all (a blocking
        socket does, unless SO_SNDTIMEO cut it short: the rest goes by sendall)."""
        if data.ndim != 1 or data.itemsize != 1:
            data = data.cast("B")
        sent = self.sock.sendmsg([frame, data])
        if sent < len(frame):
            self.sock.sendall(frame[sent:])
            sent = len(frame)
        if sent - len(frame) < data.nbytes:
            self.sock.sendall(data[sent - len(frame):])

    def recv_exact(self, view: memoryview, waitall: bool = False) -> None:
        """Fill view. waitall: the bytes are sure to come (a GET's pages after its
        header said so), so the kernel is asked to fill the whole view in one call
        (MSG_WAITALL): it wakes for each segment but does not return to Python, drop
        and retake the GIL and slice a view each time. A plain socket only (TLS takes
        no flags). SO_RCVTIMEO still ends the wait: with nothing received it is a
        Timeout, with some bytes it returns them and the loop asks again."""
        pos, n = 0, len(view)
        flags = socket.MSG_WAITALL if waitall and self.plain else 0
        try:
            while pos < n:
                got = self.sock.recv_into(view[pos:], n - pos, flags)
                if not got:
                    raise Broken(f"the server closed the connection after {pos} of {n} "
                                  "bytes")
                pos += got
        except OSError as exc:
            if isinstance(exc, ConnectionError) and isinstance(exc, (Broken, Timeout)):
                raise
            raise _failed(exc, "receiving") from None

    def get(self, layout_id: bytes, key_size: int, packed: bytes, out: memoryview) -> None:
        """A page-major GET of the packed keys whose answer fills out: the request in one
        send (header, layout and keys' head packed at once), the answer's header, pad
        and pages in one recvmsg_into where the kernel has them all (a page or a few:
        one system call each way). What an engine calls per layer, so it checks the
        answer with one unpack and one compare, and builds nothing else."""
        n = len(packed) // key_size if key_size else 0
        frame = _GET_REQUEST.pack(_MAGIC, _VERSION, _GET, 0, fw.PAGE_MAJOR,
                                  fw.LAYOUT_KEYS_HEAD.size + len(packed), 0, layout_id,
                                  key_size, n) + packed
        try:
            self.sock.sendall(frame)
        except OSError as exc:
            raise _failed(exc, "sending") from None
        if not self.plain:                    # TLS: no recvmsg
            self.answer_into(_GET, "Get", out)
            return
        pre = self._pre
        try:
            got = self.sock.recvmsg_into([pre, out])[0]
        except OSError as exc:
            raise _failed(exc, "receiving") from None
        nbytes = out.nbytes
        if got == len(pre) + nbytes and _HEADER.unpack_from(pre) == (
                fw.MAGIC, fw.VERSION, _GET, 0, 0, self._pad, nbytes):
            return
        self._answer_rest(_GET, "Get", out, got)

    def answer_into(self, op: int, method: str, out: memoryview) -> None:
        """A GET's answer: the header (and its pad: fastwire.ALIGNED), then the pages
        straight into out. On a plain socket one recvmsg_into fills both, so a one-page
        get costs one system call."""
        size = fw.HEADER.size
        pre = self._pre
        if not self.plain:                    # no recvmsg on TLS
            self.recv_exact(pre[:size])
            got = size
        else:
            try:
                got = self.sock.recvmsg_into([pre, out])[0]
            except OSError as exc:
                raise _failed(exc, "receiving") from None
        self._answer_rest(op, method, out, got)

    def _answer_rest(self, op: int, method: str, out: memoryview, got: int) -> None:
        """The rest of a GET's answer once a first receive brought `got` bytes of it
        (the header and pad first, then the pages into out): checked, and completed."""
        size = fw.HEADER.size
        pre = self._pre
        if not got:
            raise Broken("the server closed the connection")
        if got < size:
            self.recv_exact(pre[got:size])
            got = size
        try:
            h = fw.decode_header(pre[:size], request=False)
        except fw.WireError as exc:
            raise Broken(str(exc)) from None
        if h.status:
            if h.body_len > fw.MAX_ANSWER_BODY or got - size > h.body_len:
                raise Broken(f"error body of {h.body_len} bytes is past any bound")
            # What came of the body lies in the pad, then at the start of out.
            come = bytes(pre[size:min(got, len(pre))]) + bytes(out[:max(0, got - len(pre))])
            rest = memoryview(bytearray(h.body_len - len(come)))
            self.recv_exact(rest)
            self._raise(h, memoryview(come + bytes(rest)), method)
        if h.op != op or h.body_len != self.pad or h.data_len != out.nbytes:
            raise Broken(f"answer to op {h.op} with {h.body_len} + {h.data_len} bytes, "
                         f"expected op {op} with {self.pad} + {out.nbytes} bytes")
        if got < len(pre):
            self.recv_exact(pre[got:])
            got = len(pre)
        self.recv_exact(out[got - len(pre):], waitall=True)

    @staticmethod
    def _raise(h: fw.Header, body: memoryview, method: str) -> None:
        status = (fw.Status(h.status) if h.status in fw.Status._value2member_map_
                  else fw.Status.INTERNAL)
        message = bytes(body).decode(errors="replace")
        if status is fw.Status.PROTOCOL:
            raise Broken(f"the server refused a frame: {message}")
        raise KVStoreError(fw.GRPC_CODES[status], message, method,
                           fw.reason_of_flags(h.flags))

    def answer_head(self, op: int, method: str) -> fw.Header:
        """The header of an answer whose data follows (GET): read exactly, no further."""
        head = memoryview(self._head)[:fw.HEADER.size]
        self.recv_exact(head)
        try:
            h = fw.decode_header(head, request=False)
        except fw.WireError as exc:
            raise Broken(str(exc)) from None
        if h.status:
            if h.body_len > fw.MAX_ANSWER_BODY:
                raise Broken(f"error body of {h.body_len} bytes is past any bound")
            body = memoryview(bytearray(h.body_len))
            self.recv_exact(body)
            self._raise(h, body, method)
        if h.op != op or h.body_len != self.pad:
            raise Broken(f"answer to op {h.op} with a body of {h.body_len}, expected {op} "
                         f"with {self.pad}")
        if self.pad:
            self.recv_exact(memoryview(self._head)[fw.HEADER.size:])
        return h

    def settle(self) -> None:
        """Read the answers owed to requests sent without waiting (releases, lookups
        answered here: FastPath.lookup_later), before a new call."""
        head = memoryview(self._head)[:fw.HEADER.size]
        while self.owed:
            self.owed -= 1
            self.recv_exact(head)
            h = fw.decode_header(head, request=False)
            body = memoryview(bytearray(h.body_len))
            self.recv_exact(body)
            if h.status:
                log.warning("a release or lookup sent without waiting failed (%s); a "
                            "lease it would have ended expires by itself",
                            bytes(body).decode(errors="replace"))

    def call(self, op: int, body: bytes, method: str, flags: int = 0) -> bytes:
        """A request with no data, and its answer's body (_answer_body). Sent first, then
        the answers owed to requests sent without waiting are read, then this one's:
        sending first lets the server go from a release straight to this call; reading
        the owed answers first took a round trip more."""
        if len(body) < _SMALL_BODY:
            frame = _HEADER.pack(_MAGIC, _VERSION, op, 0, flags, len(body), 0) + body
            if self.held:
                frame, self.held = self.held + frame, b""
            try:
                self.sock.sendall(frame)
            except OSError as exc:
                raise _failed(exc, "sending") from None
        else:
            self.send(op, body, flags=flags)
        if self.owed:
            self.settle()
        return self._answer_body(op, method)

    def put(self, layout_id: bytes, key_size: int, packed: bytes, data: memoryview
            ) -> bytes:
        """A PUT of data (the pages) under the layout and packed keys; its answer's
        body. A Put of a few pages (what an engine saves per layer): header, layout,
        keys' head in one pack, and frame and pages in one sendmsg."""
        body_len = _KEYS_HEAD + len(packed)
        nbytes = data.nbytes
        if (nbytes <= SEND_BYTES and body_len < _SMALL_BODY and self.plain
                and data.ndim == 1 and data.itemsize == 1):
            frame = _PUT_REQUEST.pack(_MAGIC, _VERSION, _PUT, 0, 0, body_len, nbytes,
                                      layout_id, key_size,
                                      len(packed) // key_size if key_size else 0) + packed
            try:
                sent = self.sock.sendmsg([frame, data])
                if sent < len(frame) + nbytes:      # SO_SNDTIMEO cut it short
                    if sent < len(frame):
                        self.sock.sendall(frame[sent:])
                        sent = len(frame)
                    self.sock.sendall(data[sent - len(frame):])
            except OSError as exc:
                raise _failed(exc, "sending") from None
        else:
            self.send(_PUT, fw.LAYOUT_KEYS_HEAD.pack(
                layout_id, key_size, len(packed) // key_size if key_size else 0) + packed,
                data)
        return self._answer_body(_PUT, "Put")

    def _answer_body(self, op: int, method: str) -> bytes:
        """The body of the answer to op, copied (the connection may serve another call
        before the caller reads it). One whole in one receive, as a small answer is, is
        checked with one unpack; anything else goes through answer's checks."""
        buf = self._rbuf
        try:
            got = self.sock.recv_into(buf)
        except OSError as exc:
            raise _failed(exc, "receiving") from None
        if got >= _HEAD:
            magic, version, h_op, status, _, body_len, data_len = _HEADER.unpack_from(buf)
            if (got == _HEAD + body_len and h_op == op and not status and not data_len
                    and magic == _MAGIC and version == _VERSION):
                return bytes(buf[_HEAD:got])
        return bytes(self._answer_got(got, op, method)[1])

    def answer(self, op: int, method: str) -> tuple[fw.Header, memoryview]:
        """The header and body of the answer; KVStoreError if it is an error frame.
        The body is a view of this connection's buffer, valid until its next call.

        Nothing can follow the answer on the wire (the server answers only what was
        asked, and owed answers were read first), so one recv never reads past it."""
        try:
            got = self.sock.recv_into(self._rbuf)
        except OSError as exc:
            raise _failed(exc, "receiving") from None
        return self._answer_got(got, op, method)

    def _answer_got(self, got: int, op: int, method: str) -> tuple[fw.Header, memoryview]:
        """answer, once its first receive brought `got` bytes into the buffer."""
        buf = self._rbuf
        if not got:
            raise Broken("the server closed the connection")
        if got < fw.HEADER.size:
            self.recv_exact(buf[got:fw.HEADER.size])
            got = fw.HEADER.size
        try:
            h = fw.decode_header(buf[:fw.HEADER.size], request=False)
        except fw.WireError as exc:
            raise Broken(str(exc)) from None
        if h.body_len > fw.MAX_ANSWER_BODY or got > fw.HEADER.size + h.body_len:
            raise Broken(f"answer of {got} bytes, body of {h.body_len}: out of step")
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
            raise Broken(f"answer to op {h.op}, expected {op}")
        return h, body
