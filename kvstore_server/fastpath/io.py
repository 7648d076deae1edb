"""Socket I/O of the fast path: exact reads into caller memory, and page sends.

Two ways to send pages out of the pool were measured (bench/fastpath_bench.py,
`--send`): `socket.sendmsg` of memoryviews of the mapping (the kernel copies from the
mapping into the socket), and `os.sendfile` from the pool's file (tmpfs pages go to the
socket without a user-space copy). Both release the GIL for the whole call. The server
sends with sendmsg unless told otherwise (fastpath.server's `send_mode`);
docs/fastpath.md says why.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Iterable, Iterator

import numpy as np

__all__ = ["IOV_BATCH", "ClientGone", "Reader", "drain", "recv_exact", "runs", "runs_of",
           "send_batch", "send_file", "send_slabs", "send_views", "set_timeouts"]

# A sendmsg takes at most IOV_MAX (1024 on Linux) buffers.
IOV_BATCH = 1024
# ... and, here, at most this many bytes: over loopback one very large call moved the
# same bytes slower than calls of a few MiB (bench/fastpath_bench.py's raw peer sends
# 1 MiB a call). The kernel's reason was not looked into.
SEND_BYTES = 2 << 20


class ClientGone(ConnectionError):
    """The peer closed the connection (or it broke) in the middle of a frame."""


def set_timeouts(sock: socket.socket, seconds: float, send: float | None = None) -> None:
    """Blocking socket whose every recv gives up after `seconds` and every send after
    `send` (default: the same; 0 = never). A plain socket only: over TLS these make
    Python's SSL layer retry without end (see Connection).

    SO_RCVTIMEO/SO_SNDTIMEO rather than settimeout(): a Python timeout makes the socket
    non-blocking underneath, and os.sendfile on it then fails with EAGAIN at once."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                    _timeval(seconds if send is None else send))


def _timeval(seconds: float) -> bytes:
    sec = int(seconds)
    return struct.pack("ll", sec, int((seconds - sec) * 1e6))


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from the socket; ClientGone if it ends first."""
    pos, n = 0, len(view)
    while pos < n:
        got = sock.recv_into(view[pos:], n - pos)
        if not got:
            raise ClientGone(f"connection closed after {pos} of {n} bytes")
        pos += got


def drain(sock: socket.socket, nbytes: int, scratch: memoryview) -> None:
    """Read and drop nbytes (a refused Put's data), through one bounded buffer."""
    while nbytes:
        take = min(nbytes, len(scratch))
        recv_exact(sock, scratch[:take])
        nbytes -= take


class Reader:
    """A connection's incoming bytes, read with as few system calls as the peer allows.

    Why: a small request is a header and a body, and reading them exactly took two
    recv_into calls, each a trip out of and back into the GIL; a client that pipelines
    (a release sent without waiting, then an acquire) has two frames waiting at once.
    Here one recv_into fills a buffer with whatever has arrived, and headers and bodies
    are views of it. Each receive asks for what the frame still needs, or READ_AHEAD
    bytes where that is more: enough for many small frames, while a Put's page bytes
    mostly go straight where they belong: `read_into` copies what the buffer already
    holds (under READ_AHEAD bytes) and receives the rest directly into the caller's
    memory (a reserved pool slot). Reading ahead the whole BUFFER copied a one-page Put
    of 64 KiB through it.

    Between frames a plain socket's receive timeout (SO_RCVTIMEO, --stream-timeout: set
    once, see Connection) may expire `idle_waits` times before the connection counts as
    idle, so the wait for a header needs no timeout of its own and no call pays a
    setsockopt to switch between them."""

    BUFFER = 64 << 10
    READ_AHEAD = 4 << 10

    def __init__(self, sock: socket.socket, idle_waits: int = 1) -> None:
        self.sock = sock
        self.idle_waits = idle_waits
        self._view = memoryview(bytearray(self.BUFFER))
        self._start = 0          # buffered bytes are _view[_start:_end]
        self._end = 0
        # time.monotonic() by which every byte asked for must have come (the HELLO's one
        # deadline): each receive waits only what is left of it (sock.settimeout, which
        # Python's SSL layer honours too), so a peer that trickles a byte at a time is
        # cut off all the same. 0 = none: the socket's own timeouts apply.
        self.deadline = 0.0

    def _fill(self, n: int, waits: int = 1) -> bool:
        """Have at least n (<= BUFFER) bytes buffered; False if the peer closed before
        any byte of them came, ClientGone if it closed part way. waits: receive timeouts
        that may pass while none of them has come (more than 1 only between frames)."""
        if self._start + n > self.BUFFER:                   # room at the end: compact
            have = self._end - self._start
            self._view[:have] = self._view[self._start:self._end]
            self._start, self._end = 0, have
        while self._end - self._start < n:
            if self.deadline:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"deadline passed with {self._end - self._start} "
                                       f"of {n} bytes come")
                self.sock.settimeout(left)
            want = max(n - (self._end - self._start), self.READ_AHEAD)
            try:
                got = self.sock.recv_into(self._view[self._end:], min(want, self.BUFFER -
                                                                       self._end))
            except BlockingIOError:       # SO_RCVTIMEO expired with nothing received
                waits -= 1
                if waits <= 0 or self._end > self._start:
                    raise
                continue
            if not got:
                if self._end == self._start:
                    return False
                raise ClientGone(f"connection closed after {self._end - self._start} "
                                 f"of {n} bytes")
            self._end += got
        return True

    def buffered(self) -> int:
        """Bytes received and not yet taken: what the peer sent ahead."""
        return self._end - self._start

    def head(self, n: int) -> memoryview | None:
        """The next n bytes (a frame's header), valid until the next read; None when the
        peer closed between frames. Waits up to idle_waits receive timeouts for them."""
        if self._end - self._start < n and not self._fill(n, self.idle_waits):
            return None
        view = self._view[self._start:self._start + n]
        self._start += n
        return view

    def take(self, n: int) -> memoryview:
        """The next n bytes (a body): a view of the buffer, valid until the next read,
        when they fit it; else memory of their own."""
        if n > self.BUFFER:
            out = memoryview(bytearray(n))
            self.read_into(out)
            return out
        if self._end - self._start < n and not self._fill(n):
            raise ClientGone(f"connection closed before a body of {n} bytes")
        view = self._view[self._start:self._start + n]
        self._start += n
        return view

    def read_into(self, view: memoryview) -> None:
        """Fill view: what is buffered first, then straight from the socket."""
        have = min(self._end - self._start, len(view))
        if have:
            view[:have] = self._view[self._start:self._start + have]
            self._start += have
        if have < len(view):
            recv_exact(self.sock, view[have:])

    def skip(self, nbytes: int, scratch: memoryview) -> None:
        """Read and drop nbytes (a refused Put's data), through one bounded buffer."""
        have = min(self._end - self._start, nbytes)
        self._start += have
        drain(self.sock, nbytes - have, scratch)


# Up to this many entries, runs() walks Python ints. Why: its numpy form (five calls on
# tiny arrays) costs about the same at any length below ~100, where the walk grows with
# the entries and stays cheaper up to about a hundred of them. An engine's calls are a
# layer's or a block's few pages.
_RUNS_IN_PYTHON = 64


def runs(offsets: np.ndarray, size: int) -> Iterator[tuple[int, int, int]]:
    """(first index, end index, pool offset) of each run of entries whose offsets lie
    back to back, `size` bytes apart; entries with offset -1 form runs of their own."""
    n = len(offsets)
    if not n:
        return
    if n <= _RUNS_IN_PYTHON:
        yield from runs_of(offsets.tolist(), size)
        return
    offs = np.asarray(offsets, dtype=np.int64)
    breaks = np.flatnonzero((np.diff(offs) != size) | (offs[1:] < 0) | (offs[:-1] < 0)) + 1
    starts = [0, *breaks.tolist()]
    ends = [*breaks.tolist(), n]
    first = offs[starts].tolist()
    yield from zip(starts, ends, first, strict=True)


def runs_of(offs: list[int], size: int) -> Iterator[tuple[int, int, int]]:
    """runs() of a list of offsets, in Python ints (a short one: see _RUNS_IN_PYTHON)."""
    n = len(offs)
    i = 0
    while i < n:
        first = prev = offs[i]
        j = i + 1
        if first >= 0:
            while j < n and offs[j] == prev + size:
                prev += size
                j += 1
        yield i, j, first
        i = j


def send_views(sock: socket.socket, views: Iterable[memoryview]) -> None:
    """Send the views in order, each sendmsg at most IOV_BATCH views and about
    SEND_BYTES bytes (a view larger than that goes in pieces). views may be a generator:
    it is read one batch ahead of the socket, no further."""
    batch: list[memoryview] = []
    size = 0
    for view in views:
        while view.nbytes:
            take = view if view.nbytes <= SEND_BYTES - size else view[:SEND_BYTES - size]
            batch.append(take)
            size += take.nbytes
            view = view[take.nbytes:]
            if size >= SEND_BYTES or len(batch) == IOV_BATCH:
                send_batch(sock, batch)
                batch, size = [], 0
    if batch:
        send_batch(sock, batch)


def send_slabs(sock: socket.socket, mem: memoryview, offsets: np.ndarray, layers: int,
               size: int) -> None:
    """Layer after layer, each page's slab of `size` bytes (page o's slab of layer l is
    at o + l * size): a layer-major Get's answer. size is at most SEND_BYTES.

    send_views took each slab through a loop of its own (a dozen Python steps a slab);
    a 32k-token 8B hit is 65,536 slabs, sent by a thread per stripe that share one GIL.
    Here a layer's slabs are made in one comprehension and go out in sendmsg calls of
    `per` slabs each, across layers, so a short stripe still fills its calls."""
    per = max(1, min(IOV_BATCH, SEND_BYTES // size))
    whole = per * size
    pending: list[memoryview] = []
    for base in range(0, layers * size, size):
        pending += [mem[a:a + size] for a in (offsets + base).tolist()]
        if len(pending) < per:
            continue
        full = len(pending) - len(pending) % per
        for i in range(0, full, per):
            batch = pending[i:i + per]
            sent = sock.sendmsg(batch)
            if sent != whole:
                send_batch(sock, batch, sent)
        del pending[:full]
    if pending:
        send_batch(sock, pending)


def send_batch(sock: socket.socket, batch: list[memoryview], sent: int = 0) -> None:
    """sendmsg until every view of the batch (at most IOV_BATCH) is sent; sent: bytes
    of it a sendmsg already took (one a timeout cut short)."""
    i = 0
    while i < len(batch):
        if not sent:
            sent = sock.sendmsg(batch[i:])
        # Skip the views sent whole; resend the rest of a partly sent one.
        while i < len(batch) and sent >= batch[i].nbytes:
            sent -= batch[i].nbytes
            i += 1
        if sent:
            batch[i] = batch[i][sent:]
            sent = 0


def send_file(sock: socket.socket, fd: int, offset: int, count: int) -> None:
    """Send count bytes of file fd from offset with sendfile (no user-space copy)."""
    out = sock.fileno()
    while count:
        sent = os.sendfile(out, fd, offset, min(count, SEND_BYTES))
        if not sent:
            raise ClientGone("sendfile sent nothing: the connection is gone")
        offset += sent
        count -= sent
