"""The shared-memory region that holds every page: one MAP_SHARED file, pre-faulted, locked."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import secrets

import numpy as np

__all__ = ["Region"]

log = logging.getLogger(__name__)

# One region per server, created at start and removed at stop. It is a file in a tmpfs
# (/dev/shm) or hugetlbfs folder rather than anonymous memory so that a client on the
# same host can map the very same pages (the zero-copy data plane): the server owns it,
# clients only map it. The file name carries the pid and a random part so a restarted
# server never hands out a stale region.
_PAGE = 4096


class Region:
    """A MAP_SHARED byte region backed by a file in `directory`; `mem` is a uint8 view."""

    def __init__(self, size: int, directory: str = "/dev/shm", mode: int = 0o600) -> None:
        if size <= 0 or size % _PAGE:
            raise ValueError(f"region size must be a positive multiple of {_PAGE}, got {size}")
        self.size = size
        self.name = f"kvstore-{os.getpid()}-{secrets.token_hex(4)}"
        self.path = os.path.join(directory, self.name)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
        try:
            os.ftruncate(fd, size)
            self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED,
                                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)
        self.mem = np.frombuffer(self._mmap, dtype=np.uint8)
        self.locked = False

    def prefault(self) -> None:
        """Touch every page now, so no request ever waits on a page fault or on tmpfs
        allocation; a region larger than free memory fails here, at start, not later."""
        self.mem[::_PAGE] = 0

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
