"""One fast-path connection: authenticate once, then answer frames in order until it ends.

    accept -> [TLS handshake] -> HELLO (token) -> refused: error frame, close
                                              -> frames: LOOKUP, GET, PUT, ... one answer each
    end (peer closed, timeout, malformed frame, server stopping) -> leases released, closed

A request the store refuses (unknown layout, missing key, quota) gets an error frame and
the connection goes on. A frame that breaks the format gets a PROTOCOL error frame and
the connection is closed: after a bad length nothing that follows can be trusted.
Nothing a client sends can end the thread other than by ending its own connection.

The connection acts for its tenant under exactly the gRPC path's rules: its token (from
HELLO) and its TLS client certificate are checked by the same Authenticator.identify as
a gRPC call's, and looked up again before every request (two dict gets of their
SHA-256s, hashed once at HELLO), so a token or certificate revoked by SIGHUP stops
working on open connections too and a changed quota applies at once.

Deadlines (docs/fastpath.md, "Bounds"). Before it is authenticated a connection may cost
the server little and not for long: its HELLO body is at most MAX_HELLO_BODY bytes (a
longer one is refused before a byte of it is read or allocated), and the TLS handshake
and the whole HELLO must be done by one deadline set at accept (server.py), however the
bytes trickle in. After HELLO, waiting for the next frame is bounded by the idle timeout
(300 s: a pooled connection may rest) and everything inside a frame (its body, a Put's
pages, the answer, a Get's pages) by --stream-timeout per receive or send, so a peer that
stops reading a Get, or stops sending a Put, loses its pins and reservations within it,
as a stalled gRPC stream does. Over TLS these are Python timeouts (sock.settimeout): a
blocking SSL socket whose SO_RCVTIMEO fires retries the read without end.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import mmap
import socket
import ssl
import time
from collections.abc import Callable

import grpc

from kvstore_protocol import fastwire as fw
from kvstore_protocol.carriage import call_body_bytes
from kvstore_protocol.keys import MalformedKeys

from ..auth import ANONYMOUS, Authenticator, Principal, Role, token_digest
from ..errors import Outcome, StoreError
from ..peercert import Digest, der_digest
from ..rpc.limits import MAX_KEYS_LIMIT, request_message_bytes
from .io import ClientGone, Reader, set_timeouts
from .ops import SEND_SENDMSG, Ops, Session, status_of, table

__all__ = ["Connection"]

log = logging.getLogger(__name__)

_NAMES: dict[int, str] = {op: "Fast" + op.name.title() for op in fw.Op}
# Plain ints and the OK code, looked up once: every frame compares its op with these, and
# an IntEnum member read through its class, or hashed as a dict key, runs Python code.
_HELLO = int(fw.Op.HELLO)
_RELEASE = int(fw.Op.RELEASE)
_CALL = int(fw.Op.CALL)
_QUIET = fw.QUIET
_OK_CODE = fw.GRPC_CODES[fw.Status.OK]
SCRATCH_BYTES = 256 << 10      # per connection: a small Put's pages, a refused Put's data
# A request body up to this long that is over the server's limit is read past and refused
# (the connection goes on); a longer one is taken for a malformed frame: the connection
# closes. The largest limit a server may be set to (limits.MAX_KEYS_LIMIT) is under it,
# for a CALL's body too (a request message, limits.request_message_bytes).
_SKIPPABLE_BODY = max(fw.request_body_bytes(MAX_KEYS_LIMIT),
                      call_body_bytes(request_message_bytes(MAX_KEYS_LIMIT)))
# Quiet RELEASEs held back for the frame behind them (Connection._apply) at most: a
# client that sends nothing but releases has them applied in batches of this many.
_LATER_MAX = 64
# The longest RELEASE body held back: a lease id and the pages read (ops.release refuses
# any other length). Each one held is a copy of its body, and a body that came with the
# header behind it may be as long as the connection's read buffer (Reader.BUFFER, 64
# KiB): held back 64 at a time, a peer that sent each body's end with the next header
# had a connection hold 4 MiB (tests/integration/test_fastpath_release.py). A longer one
# is applied, that is refused, at once.
_LATER_BODY = fw.LEASE.size + fw.READ.size
# The calls refused (RESOURCE_EXHAUSTED) when the leases clients hold reach
# --lease-memory: releases held back are applied before one of these, so that holding
# them back never fails a call that applying them first would have let through. A leased
# LOOKUP at the limit answers its count without a lease instead (the release follows its
# answer at once), and a Put's or Get's own pins are not counted.
_BUDGETED = frozenset({int(fw.Op.ACQUIRE), int(fw.Op.RESERVE)})
# The longest HELLO body read: a token (a bearer token is tens of bytes; 4 KiB leaves room
# for any a deployment makes). A HELLO that declares more is refused before its body is
# read: nothing is allocated for a length an unauthenticated peer declares.
MAX_HELLO_BODY = 4096


# A small Put's pages are received into the scratch and copied from it into their pool
# slots (ops.Ops._put_small). Pool pages start on a 4 KiB boundary, and the CPU copies
# far slower where the destination lies a few bytes past the source modulo 4 KiB: on the
# dev VM a 64 KiB copy into a pool page took 1.5 us from a source on a page boundary,
# 23 us from one 8 or 16 bytes short of it, which is where a heap allocation (a
# bytearray) may land. A mapping of its own starts on a page boundary, so every copy out
# of the scratch takes the fast case.
def _scratch() -> memoryview:
    """The connection's scratch: SCRATCH_BYTES, page-aligned (see above)."""
    return memoryview(mmap.mmap(-1, SCRATCH_BYTES))


def _quiet(op: int, body: bytes, status: fw.Status = fw.Status.OK, flags: int = 0) -> None:
    """The answer to a quiet RELEASE: none; a failed one is only logged (and counted)."""
    if status is not fw.Status.OK:
        log.debug("fast path: a quiet release failed: %s", body.decode(errors="replace"))


class Refused(Exception):
    """The HELLO was refused; the connection ends after its error frame."""

    def __init__(self, status: fw.Status, message: str) -> None:
        super().__init__(message)
        self.status = status


class Connection:
    """Serves one accepted socket on the calling thread (`run`)."""

    def __init__(self, sock: socket.socket, ops: Ops, auth: Authenticator | None, *,
                 idle_timeout: float, stream_timeout: float, plain: bool,
                 observe: Callable[[str, float, grpc.StatusCode], None],
                 refused: Callable[[str], None], hello_deadline: float,
                 admit: Callable[[str], str | None]) -> None:
        """hello_deadline: time.monotonic() by which HELLO must have come whole. admit:
        called with the tenant once HELLO is accepted; None admits the connection, a
        message refuses it BUSY (admission.py)."""
        self.sock = sock
        self.ops = ops
        self.auth = auth
        self.idle_timeout = idle_timeout
        # Inside a frame: --stream-timeout, or the idle timeout where that is 0 (never).
        self.stream_timeout = stream_timeout or idle_timeout
        self.plain = plain
        self.hello_deadline = hello_deadline
        self._admit = admit
        self._observe = observe
        self._refused = refused
        self._table = table(ops)
        # A plain socket's receives wait --stream-timeout (SO_RCVTIMEO, set once at
        # HELLO); the wait for a header lets that pass this often before the connection
        # is idle (Reader). Over TLS a Python timeout is switched around it instead.
        ticks = -(-idle_timeout // self.stream_timeout) if self.stream_timeout else 1
        self._reader = Reader(sock, idle_waits=int(ticks) if plain else 1)
        self._token: Digest | None = None     # SHA-256 of HELLO's token; None: none sent
        self._cert: Digest | None = None      # SHA-256 of the TLS client certificate
        self._granted = 0                     # HELLO flags granted (QUIET, ALIGNED)

    # -- who --------------------------------------------------------------------------
    def _principal(self) -> Principal:
        if self.auth is None:
            return ANONYMOUS
        principal = self.auth.identify(self._token, self._cert)
        if principal.role is not Role.TENANT:
            raise StoreError(Outcome.DENIED, f"{principal.role.value} {principal.name!r} may "
                                             "not use the fast path: it needs a tenant token "
                                             "or certificate")
        return principal

    def _hello(self) -> None:
        self._reader.deadline = self.hello_deadline
        h = self._read_header()
        if h is None:
            raise ClientGone("closed before HELLO")
        if h.op != fw.Op.HELLO:
            raise fw.WireError(f"the first frame must be HELLO, got op {h.op}")
        if h.body_len > MAX_HELLO_BODY or h.data_len:
            raise fw.WireError(f"a HELLO body of {h.body_len} bytes (and {h.data_len} of "
                               f"data) is over the limit of {MAX_HELLO_BODY} bytes: it "
                               "holds a token and nothing else")
        body = self._read_body(h)
        self._reader.deadline = 0.0
        try:
            token = bytes(body).decode().strip()
        except UnicodeDecodeError:
            raise Refused(fw.Status.UNAUTHENTICATED, "token is not UTF-8") from None
        self._token = token_digest(token) if token else None
        if isinstance(self.sock, ssl.SSLSocket):         # mTLS: the certificate it showed
            self._cert = der_digest(self.sock.getpeercert(binary_form=True))
        try:
            principal = self._principal()
        except StoreError as exc:
            raise Refused(status_of(exc), exc.message) from None
        busy = self._admit(principal.name)
        if busy is not None:
            raise Refused(fw.Status.BUSY, busy)
        # From here on: idle between frames, --stream-timeout inside one (module doc).
        if self.plain:
            self.sock.settimeout(None)       # blocking again (the deadline set a timeout)
            set_timeouts(self.sock, self.stream_timeout)
        else:
            self.sock.settimeout(self.stream_timeout or None)
        # A client that offers quiet releases gets them (fastwire.QUIET), one that
        # reads aligned Get answers gets those (fastwire.ALIGNED), and one that carries
        # unary calls in CALL frames gets that where this server serves them (CALLS).
        self._granted = h.flags & (fw.QUIET | fw.ALIGNED
                                   | (fw.CALLS if self.ops.carriage is not None else 0))
        self._reply(fw.Op.HELLO, principal.name.encode(), flags=self._granted)

    # -- frames -------------------------------------------------------------------------
    def _read_header(self) -> fw.Header | None:
        """The next frame's header; None when the peer closed between frames."""
        head = self._reader.head(fw.HEADER.size)
        if head is None:
            return None
        return fw.decode_header(head, request=True, max_body=_SKIPPABLE_BODY)

    def _read_body(self, h: fw.Header) -> memoryview:
        """The body: a view valid until the next read (ops copy what they keep); its
        length is bounded, decode_header checked it."""
        return self._reader.take(h.body_len)

    def _reply(self, op: int, body: bytes, status: fw.Status = fw.Status.OK,
               flags: int = 0) -> None:
        self.sock.sendall(fw.encode_header(op, len(body), 0, status, flags) + body)

    def run(self) -> None:
        """Serve until the connection ends; never raises."""
        session = None
        try:
            self._hello()
            session = Session(self.sock, self._reader, self.plain,
                              _scratch(), ANONYMOUS,
                              bytes(fw.ALIGN_PAD) if self._granted & fw.ALIGNED else b"")
            if session.pad and self.plain and self.ops.send_mode == SEND_SENDMSG:
                # A small Get's answer may go under the store's lock (Ops.send_now).
                session.now = functools.partial(self.ops.send_now, session)
            self._frames(session)
        except Refused as exc:
            self._refused(exc.status.name.lower())
            log.debug("fast path: refused a connection: %s", exc)
            self._try_reply(fw.Op.HELLO, str(exc), exc.status)
        except fw.WireError as exc:
            self._refused("protocol")
            log.info("fast path: closing a connection after a malformed frame: %s", exc)
            self._try_reply(0, str(exc), exc.status)
        except TimeoutError as exc:
            if session is None:                 # the HELLO's deadline passed
                self._refused("deadline")
                log.debug("fast path: no HELLO in time: %s", exc)
                self._try_reply(fw.Op.HELLO, "no HELLO within the deadline of a connection "
                                "not yet authenticated: closed", fw.Status.UNAUTHENTICATED)
            else:
                log.info("fast path: closing a connection that stalled: %s", exc)
        except (ClientGone, OSError) as exc:
            log.debug("fast path: connection ended: %s", exc)
        except Exception:                   # the server must survive any connection
            log.exception("fast path: connection failed")
            self._try_reply(0, "internal error; see the server log", fw.Status.INTERNAL)
        finally:
            if session is not None:
                self._end_leases(session)
            with contextlib.suppress(OSError):
                self.sock.close()

    def _call(self, s: Session, h: fw.Header, body: memoryview) -> None:
        start = time.perf_counter()
        code = _OK_CODE
        op = h.op               # an int decode_header checked; the tables take it as is
        # A quiet RELEASE gets no answer, not even an error (fastwire.QUIET).
        reply = _quiet if op == _RELEASE and h.flags & _QUIET else self._reply
        try:
            if self.auth is not None:       # without an auth file: ANONYMOUS, as set
                try:
                    s.who = self._principal()
                except StoreError:              # revoked: a PUT's pages still follow,
                    s.reader.skip(h.data_len, s.scratch)   # read past them to stay in step
                    raise
            answer = self._table[op](s, h, body)
            if answer is not None:
                reply(op, answer)
        except StoreError as exc:
            status = status_of(exc)
            code = fw.GRPC_CODES[status]
            reply(op, exc.message.encode(), status, fw.reason_flags(exc.reason))
        except fw.WireError as exc:
            if exc.status is fw.Status.PROTOCOL:
                raise
            code = fw.GRPC_CODES[exc.status]
            reply(op, str(exc).encode(), exc.status)
        except (MalformedKeys, ValueError) as exc:
            code = fw.GRPC_CODES[fw.Status.INVALID]
            reply(op, str(exc).encode(), fw.Status.INVALID)
        except (ClientGone, OSError):
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            self._observe(_NAMES[op], time.perf_counter() - start, code)

    def _frames(self, session: Session) -> None:
        """Answer frames until the peer closes between two (returns) or the connection
        fails (raises: run says how each ends)."""
        # A plain socket's timeouts are set once, at HELLO: every receive and send waits
        # --stream-timeout, and the wait for a header lets it pass until the idle
        # timeout (Reader.idle_waits). A setsockopt pair around each Put's pages cost
        # two system calls a Put. Over TLS a Python timeout is one value for both,
        # switched around the wait for each header.
        plain, reader = self.plain, self._reader
        max_body, max_call_body = self.ops.max_body, self.ops.max_call_body
        later: list[tuple[fw.Header, bytes]] = []     # quiet RELEASEs held back (_apply)
        try:
            while True:
                if later and reader.buffered() < fw.HEADER.size:
                    self._apply(session, later)       # nothing more to answer first
                if not plain:
                    self.sock.settimeout(self.idle_timeout or None)
                h = self._read_header()
                if h is None:
                    return
                if not plain:
                    self.sock.settimeout(self.stream_timeout or None)
                if h.op == _HELLO:
                    raise fw.WireError("HELLO comes once, first")
                if h.body_len > (max_call_body if h.op == _CALL else max_body):
                    self._refuse_body(session, h)
                    continue
                body = reader.take(h.body_len)
                if h.op == _RELEASE and h.flags & _QUIET and h.body_len <= _LATER_BODY \
                        and reader.buffered() >= fw.HEADER.size:
                    later.append((h, bytes(body)))
                    if len(later) >= _LATER_MAX:        # a stream of releases alone
                        self._apply(session, later)
                    continue
                if later and h.op in _BUDGETED:
                    self._apply(session, later)       # their leases' memory first
                self._call(session, h, body)
                if later:
                    self._apply(session, later)
        finally:
            # Ended with releases held back (the frame behind them broke off, or was
            # malformed): they are applied all the same. A lease taken elsewhere (on
            # another connection, over gRPC) is not among this one's, which _end_leases
            # ends; its release came whole and must not be lost.
            if later:
                with contextlib.suppress(Exception):
                    self._apply(session, later)

    # A client sends a quiet RELEASE (fastwire.QUIET: no answer) in the same send as
    # its next request (kvstore_client.ahead): a scheduler's leased lookup follows the
    # release of the one before. Applied in order, the release's work came before that
    # request's answer, in the caller's latency, though nothing answers it. So a quiet
    # RELEASE with another frame already behind it waits for that frame's answer, and
    # is applied right after it (before it, where that frame is an ACQUIRE or RESERVE:
    # _BUDGETED); one with nothing behind it is applied before the connection waits for
    # more, as before. Nothing can tell the two orders apart but the time the pages
    # stay pinned, a frame longer; a connection that ends with some held back applies
    # them on its way out (_frames).
    def _apply(self, s: Session, later: list[tuple[fw.Header, bytes]]) -> None:
        """Apply the quiet RELEASEs held back (in the order they came), and forget them."""
        for h, body in later:
            self._call(s, h, memoryview(body))
        later.clear()

    def _refuse_body(self, s: Session, h: fw.Header) -> None:
        """A request over the body limit (more keys than the server takes): its bytes are
        read past and it is refused, and the connection goes on. Closing it, as for a
        malformed frame, ended every lease the connection held, and a client's lease
        lane carries the leases of all its threads: one thread's oversized Acquire let
        another's pinned pages be reused while it read them."""
        s.reader.skip(h.body_len + h.data_len, s.scratch)
        status = fw.Status.INVALID
        message = (f"body of {h.body_len} bytes is over the limit of {self.ops.max_body} "
                   f"(at most {self.ops.limits.max_keys} keys per request, "
                   "--max-keys-per-request): split it")
        if h.op == fw.Op.CALL:       # as gRPC refuses a message past its limit
            status = fw.Status.EXHAUSTED
            message = (f"a CALL of {h.body_len} bytes is over the limit of "
                       f"{self.ops.max_call_body} (one request message, set by "
                       "--max-keys-per-request): split it")
        if not (h.op == fw.Op.RELEASE and h.flags & fw.QUIET):
            self._reply(h.op, message.encode(), status)
        self._observe(_NAMES[h.op], 0.0, fw.GRPC_CODES[status])

    def _try_reply(self, op: int, message: str, status: fw.Status) -> None:
        try:
            self.sock.settimeout(1.0)
            self._reply(op, message.encode(), status)
        except OSError:
            pass

    def _end_leases(self, s: Session) -> None:
        """Undo what the connection still holds: a client gone mid-call leaves no pin."""
        store = self.ops.store
        for lease_id in list(s.leases):
            try:
                store.release(lease_id)
            except Exception:
                log.exception("fast path: releasing lease %d failed", lease_id)
        s.leases.clear()
