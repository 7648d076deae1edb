"""The server's page pool, mapped into this process: the same-host data plane.

Lifecycle of a put through shared memory (docs/architecture.md, "Same-host data plane"):

    Reserve(keys) -> offsets of WRITING slots (keys already stored are skipped, -1)
    write the bytes at those offsets (a memcpy here, or a D2H copy from the GPU)
    Commit -> the pages become visible          | Abort, or the lease runs out -> freed
And of a get:
    Acquire(keys) -> offsets of READY pages, pinned by a lease
    read the bytes (a memcpy, or an H2D copy straight from the mapping)
    ReleaseLease -> unpinned                    | or the lease runs out

The mapping is made once, with MAP_POPULATE so the first copy does not page-fault on
every 4 KiB. The server's region token, read from the mapping, goes with every call as
proof that this process mapped the server's current region.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import socket
import stat
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, cast

import numpy as np

from kvstore_protocol.region import HANDOUT_MAGIC, TOKEN_BYTES, region_id

from .unixpeer import ServerIdentity, UntrustedSocket, check_path, check_peer

if TYPE_CHECKING:
    from .results import LayoutHandle

__all__ = ["Acquired", "Reservation", "SharedRegion", "copy_layer", "copy_pages", "open_pool",
           "region_id"]

PAGE = 4096


def copy_pages(pages: np.ndarray, mem: np.ndarray, offsets: np.ndarray, *,
               to_pool: bool) -> None:
    """Copy (n, page_bytes) `pages` into the pool at `offsets` (to_pool) or out of it;
    an offset of -1 is skipped.

    Pages that lie back to back in the pool (a put's slots are handed out in order) are
    copied with one call per run, when the buffer and the pool sit at the same offset
    within a 4 KiB page; otherwise one call per page. Why: glibc copies at least its
    non-temporal threshold (3/4 of the L3 it is told of) with streaming stores, which do
    not read the destination first, so a long run beats 1 MiB pieces. But that path slows
    below the pieces' speed when the destination lies a few bytes to a few hundred past
    the source modulo 4 KiB (AMD EPYC, glibc 2.36), while 1 MiB pieces run at one speed at
    any offset.
    """
    n, page_bytes = pages.shape
    if not n:
        return
    buf = pages.reshape(-1)
    coaligned = (buf.ctypes.data - mem.ctypes.data) % PAGE == 0
    for i, j, off in _runs(offsets, page_bytes, join=coaligned):
        a, b = i * page_bytes, j * page_bytes
        if to_pool:
            mem[off:off + b - a] = buf[a:b]
        else:
            buf[a:b] = mem[off:off + b - a]


def copy_layer(slab: np.ndarray, mem: np.ndarray, offsets: np.ndarray, layer: int,
               page_bytes: int) -> None:
    """Copy one layer's slab of each page at `offsets` out of the pool into `slab`,
    (n, layer_bytes): one strided copy per run of pages lying back to back in the pool
    (a put's pages form one), not one per page."""
    lb = slab.shape[1]
    for i, j, off in _runs(offsets, page_bytes):
        slab[i:j] = np.lib.stride_tricks.as_strided(
            mem[off + layer * lb:], shape=(j - i, lb), strides=(page_bytes, 1),
            writeable=False)


def _runs(offsets: np.ndarray, page_bytes: int, join: bool = True
          ) -> Iterator[tuple[int, int, int]]:
    """(i, j, offset of page i) for each run of pages i..j-1 that lie back to back in the
    pool (each page alone when not join); offsets of -1 are skipped."""
    offs = offsets.tolist()
    n = len(offs)
    i = 0
    while i < n:
        if offs[i] < 0:
            i += 1
            continue
        j = i + 1
        if join:
            while j < n and offs[j] == offs[j - 1] + page_bytes:
                j += 1
        yield i, j, offs[i]
        i = j


class SharedRegion:
    """The server's region mapped read-write; `mem` is a flat uint8 view of it."""

    def __init__(self, path: str, size: int, token_offset: int,
                 server: ServerIdentity | None = None) -> None:
        """Map the pool at path, as Attach named it. server: who Attach said the server
        is; a hand-out socket (--shm-group) is used only when its folder, the socket and
        the process listening are that uid's (UntrustedSocket otherwise, or when server
        is None), and a pool file only when it is that uid's."""
        fd = open_pool(path, server, os.O_RDWR)
        try:
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._mmap = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.path = path
        self.size = size
        self.mem = np.frombuffer(self._mmap, dtype=np.uint8)
        self.token = self.mem[token_offset:token_offset + TOKEN_BYTES].tobytes()
        self.id = region_id(self.token)

    def pages(self, offsets: np.ndarray, page_bytes: int) -> list[np.ndarray | None]:
        """A view of each page (None where the offset is -1)."""
        mem = self.mem
        return [None if off < 0 else mem[off:off + page_bytes] for off in offsets.tolist()]

    def close(self) -> None:
        self.mem = np.zeros(0, dtype=np.uint8)
        # A caller may still hold a view (BufferError); the mapping goes when that view does.
        with contextlib.suppress(BufferError):
            self._mmap.close()


class Reservation:
    """WRITING slots for a put: fill `views[i]` (None: key i was already stored), then
    `commit()`. As a context manager it commits on success and aborts on an exception."""

    def __init__(self, ns: LayoutHandle, lease_id: int, offsets: np.ndarray, skipped: int,
                 region: SharedRegion, commit: Callable[[int], int],
                 abort: Callable[[int], bool], in_flight: int = 0) -> None:
        self.ns = ns
        self.lease_id = lease_id
        self.offsets = offsets          # int64 byte offsets in the region, -1 = skipped
        self.skipped = skipped
        self.in_flight = in_flight      # keys another put is writing: -1, not stored here
        self.region = region
        self._commit = commit
        self._abort = abort
        self._done = False

    @functools.cached_property
    def views(self) -> list[np.ndarray | None]:
        """A writable view of each reserved page (None: key i was already stored). Made
        on first use: the client's own put copies by offsets (copy_pages) instead."""
        return self.region.pages(self.offsets, self.ns.page_bytes)

    def commit(self) -> int:
        """Make the written pages visible; returns how many were stored."""
        self._done = True
        return self._commit(self.lease_id)

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self._abort(self.lease_id)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, exc_type, *rest) -> None:
        if self._done:
            return
        if exc_type is None:
            self.commit()
        else:
            self.abort()


class Acquired:
    """READY pages pinned for reading: read-only `views[i]`; `release()` when done."""

    def __init__(self, ns: LayoutHandle, lease_id: int, offsets: np.ndarray,
                 region: SharedRegion, release: Callable[[int], object]) -> None:
        self.ns = ns
        self.lease_id = lease_id
        self.offsets = offsets
        self.region = region
        self._release = release
        self._done = False

    @functools.cached_property
    def views(self) -> list[np.ndarray]:
        """A read-only view of each page. Made on first use: the client's own get copies
        by offsets (copy_pages) instead."""
        # An acquire pins every key it names: no offset is -1, so no view is None.
        views = cast("list[np.ndarray]", self.region.pages(self.offsets, self.ns.page_bytes))
        for view in views:
            view.flags.writeable = False
        return views

    def layer(self, layer: int) -> list[np.ndarray]:
        """Each page's slab of one layer (read-only views)."""
        lb = self.ns.layer_bytes
        return [v[layer * lb:(layer + 1) * lb] for v in self.views]

    def release(self) -> None:
        if not self._done:
            self._done = True
            self._release(self.lease_id)

    def __enter__(self) -> Acquired:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def open_pool(path: str, server: ServerIdentity | None, flags: int) -> int:
    """A descriptor of the pool at path, as Attach named it (the caller closes it): from
    the hand-out socket (--shm-group) only when server, who Attach said the server is,
    owns its folder and the socket and listens there (UntrustedSocket otherwise, and when
    server is None); a pool file is opened with flags, and refused (UntrustedSocket)
    when server is known and the file is not its uid's."""
    if stat.S_ISSOCK(os.stat(path).st_mode):
        if server is None:
            raise UntrustedSocket(f"{path}: no server identity (Attach) to check the "
                                  "pool's hand-out socket against")
        return _receive_fd(path, server)
    fd = os.open(path, flags)
    owner = os.fstat(fd).st_uid
    if server is not None and owner != server.uid:
        os.close(fd)
        raise UntrustedSocket(f"{path} belongs to uid {owner}, not the server's "
                              f"uid {server.uid}")
    return fd


def _receive_fd(path: str, server: ServerIdentity, timeout: float = 10.0) -> int:
    """The pool's descriptor from the server's hand-out socket at path (the caller closes
    it); UntrustedSocket if the socket, its folder or the process listening is not
    server's (a descriptor from anyone else would be a pool of theirs, which would then
    receive our pages), OSError if it cannot be reached or sends something else."""
    check_path(path, server)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as s:
        s.settimeout(timeout)
        s.connect(path)
        check_peer(s, path, server)
        msg, fds, _, _ = socket.recv_fds(s, len(HANDOUT_MAGIC), 1)
    if msg != HANDOUT_MAGIC or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise OSError(f"{path} did not hand out a kvstore pool")
    return fds[0]
