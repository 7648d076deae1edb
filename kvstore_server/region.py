"""The shared-memory region that holds every page: one MAP_SHARED file, pre-faulted, locked."""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import logging
import mmap
import os
import re
import secrets
import time

import numpy as np

__all__ = ["Region", "HEADER_BYTES", "TOKEN_OFFSET", "TOKEN_BYTES", "MAGIC", "remove_stale"]

log = logging.getLogger(__name__)

# One region per server, created at start and removed at stop. It is a file in a tmpfs
# (/dev/shm) or hugetlbfs folder rather than anonymous memory so that a client on the
# same host can map the very same pages (the zero-copy data plane): the server owns it,
# clients only map it. The file name carries the pid and a random part so a restarted
# server never hands out a stale region.
#
# The first 4 KiB are a header; pages start after it:
#
#     0               16              32                      4096
#     | magic (16 B)  | token (16 B)  | zero ...              | pool slots ...
#
# The token is random per region. A client proves it mapped this very region (so it is
# on this host and may read the file) by sending the token back with every data-plane
# call; a restarted server has a new token, so a stale mapping is refused, never read.
_PAGE = 4096
HEADER_BYTES = _PAGE
MAGIC = b"kvstore-region\x00\x01"
TOKEN_OFFSET = 16
TOKEN_BYTES = 16


class Region:
    """A MAP_SHARED byte region backed by a file in `directory`; `mem` is a uint8 view."""

    def __init__(self, size: int, directory: str = "/dev/shm", group: str = "") -> None:
        """size: bytes including the 4 KiB header. group: a group whose members' clients may
        map the region too (mode 0660); empty = the server's user only (mode 0600)."""
        if size <= HEADER_BYTES or size % _PAGE:
            raise ValueError(f"region size must be a multiple of {_PAGE} above {HEADER_BYTES}, "
                             f"got {size}")
        self.size = size
        self.name = f"kvstore-{os.getpid()}-{secrets.token_hex(4)}"
        self.path = os.path.join(directory, self.name)
        self.token = secrets.token_bytes(TOKEN_BYTES)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)      # held while we live: see remove_stale
            if group:
                import grp
                os.fchown(fd, -1, grp.getgrnam(group).gr_gid)
                os.fchmod(fd, 0o660)
            os.ftruncate(fd, size)
            self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED,
                                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        self._fd = fd               # kept open for the lock; closed with the region
        self.mem = np.frombuffer(self._mmap, dtype=np.uint8)
        self.mem[:len(MAGIC)] = np.frombuffer(MAGIC, dtype=np.uint8)
        self.mem[TOKEN_OFFSET:TOKEN_OFFSET + TOKEN_BYTES] = np.frombuffer(self.token, np.uint8)
        self.locked = False

    def prefault(self) -> None:
        """Touch every page now, so no request ever waits on a page fault or on tmpfs
        allocation; a region larger than free memory fails here, at start, not later."""
        self.mem[HEADER_BYTES::_PAGE] = 0      # past the header: it holds the magic

    def lock(self) -> bool:
        """mlock the region so the kernel never swaps pages out; False (and a log line)
        when RLIMIT_MEMLOCK is too small, which is common outside systemd units that set
        LimitMEMLOCK=infinity."""
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        addr = self.mem.ctypes.data
        if libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(self.size)) == 0:
            self.locked = True
            log.info("pool of %d MiB locked in RAM (mlock)", self.size >> 20)
            return True
        err = ctypes.get_errno()
        log.warning("pool not locked in RAM: mlock failed (%s); raise RLIMIT_MEMLOCK "
                    "(ulimit -l, systemd LimitMEMLOCK=infinity) to lock it",
                    os.strerror(err))
        return False

    def close(self) -> None:
        """Unmap and remove the backing file (idempotent). Clients that still map it keep
        their mapping until they drop it; the memory is freed when the last one does."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        if self._mmap is not None:
            self.mem = np.zeros(0, dtype=np.uint8)
            try:
                self._mmap.close()
            except BufferError:
                # A view of the pool is still referenced (e.g. a stream mid-flight at
                # shutdown); the mapping goes away with the process.
                pass
            self._mmap = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


_NAME = re.compile(r"kvstore-(\d+)-[0-9a-f]{8}")


def remove_stale(directory: str, min_age: float = 60.0) -> list[tuple[str, int]]:
    """Remove the region files of servers that died without stopping; returns (path, bytes)
    of each removed.

    A server killed by SIGKILL, the OOM killer or a crash never runs `close`, and its
    file stays in tmpfs holding the whole pool's memory until someone removes it: a
    restart loop would leak one pool per crash. A live server holds an exclusive flock on
    its file from the moment it creates it, so a file whose lock can be taken has no
    server. To be safe against servers of another pid namespace or of an older version
    (which took no lock), a file is removed only when, besides, the pid in its name is not
    running here and it carries the region magic (or, without it, is `min_age` old: a file
    cut short by a crash during start). Clients still mapping a removed file keep their
    mapping; the memory goes when they drop it.
    """
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        match = _NAME.fullmatch(name)
        if match is None or _running(int(match.group(1))):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            st = os.fstat(fd)
            head = os.pread(fd, len(MAGIC), 0)
            if head != MAGIC and time.time() - st.st_mtime < min_age:
                continue
            os.unlink(path)
            removed.append((path, st.st_blocks * 512))
        except OSError:
            continue                    # locked (a live server), or not ours to remove
        finally:
            os.close(fd)
    for path, nbytes in removed:
        log.warning("removed %s (%d MiB): the pool of a server that did not stop cleanly",
                    path, nbytes >> 20)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
