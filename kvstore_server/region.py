"""The shared-memory region that holds every page: one MAP_SHARED file, pre-faulted, locked."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import fcntl
import logging
import mmap
import os
import re
import secrets
import socket
import stat
import time
from collections.abc import Callable

import numpy as np

from kvstore_protocol.presence_map import AREA_BYTES
from kvstore_protocol.region import HEADER_BYTES, MAGIC, TOKEN_BYTES, TOKEN_OFFSET

from .handout import Handout

__all__ = ["HANDOUT_NAME", "HEADER_BYTES", "MAGIC", "TOKEN_BYTES", "TOKEN_OFFSET", "Region",
           "region_bytes", "remove_stale"]

log = logging.getLogger(__name__)

# One region per server, created at start and removed at stop. It is a file in a tmpfs
# (/dev/shm) or hugetlbfs folder rather than anonymous memory so that a client on the
# same host can map the very same pages (the zero-copy data plane): the server owns it,
# clients only map it. The file name carries the pid and a random part so a restarted
# server never hands out a stale region. With --shm-group the path is instead a Unix
# socket that hands out a memfd sealed against shrinking, so the group's members, who are
# other users, cannot stop the server by truncating its pool (see _sealed_memfd). That
# socket lies in the server's private folder (kvstore_server.fastpath.unixsock), beside
# the fast path's, not in --shm-dir: a name in a folder anyone may write is anyone's once
# the server has removed it, and whoever bound it would hand clients a pool of its own
# (they would write their pages into it). Clients check the folder, the socket and the
# process that listens against Attach's uid and gid before they take the descriptor
# (kvstore_client.unixpeer).
#
# The region's header (magic, token, the presence map's place) is a format clients read:
# kvstore_protocol.region draws it and holds its constants.
_PAGE = 4096
HANDOUT_NAME = "pool.sock"   # the --shm-group hand-out socket's name in the folder
_STEP = 256 << 20           # allocation and pre-fault step: a progress report each
_HUGE = 2 << 20

# progress(done, total): bytes of start-up work done so far (allocation, then pre-fault).
Progress = Callable[[int, int], None]


def region_bytes(dram: int) -> int:
    """The region's file size for a pool of `dram` bytes: the header, then whole 4 KiB
    pages, then the presence map's area (kvstore_server.store.presence), rounded up to 2 MiB so
    the region can live on hugetlbfs, whose files must be a whole number of huge pages."""
    return -(-(dram // _PAGE * _PAGE + HEADER_BYTES + AREA_BYTES) // _HUGE) * _HUGE


class Region:
    """A MAP_SHARED byte region backed by a file in `directory`; `mem` is a uint8 view."""

    def __init__(self, size: int, directory: str = "/dev/shm", group: str = "",
                 progress: Progress | None = None, allocate: bool = True,
                 socket_folder: str = "") -> None:
        """size: bytes including the 4 KiB header. group: a group whose members' clients may
        map the region too: then `path` is a Unix socket (mode 0660) in socket_folder (a
        folder of the server's own, required with a group) that hands out a sealed memfd
        (_sealed_memfd says why); empty = a file in directory only the server's user may
        open (mode 0600). Clients map what `path` gives either way (kvstore_client.shm).
        progress(done, total) is called between steps of the allocation and the pre-fault.
        allocate=False leaves the file sparse, for tests and benchmarks that touch little of
        a large region (a server always allocates: see _allocate).

        Raises OSError when the folder cannot hold `size` bytes (ENOSPC): the file is
        removed first. Any exception, a signal handler's included, leaves no file."""
        if size <= HEADER_BYTES or size % _PAGE:
            raise ValueError(f"region size must be a multiple of {_PAGE} above {HEADER_BYTES}, "
                             f"got {size}")
        self.size = size
        self.name = f"kvstore-{os.getpid()}-{secrets.token_hex(4)}"
        self.path = os.path.join(directory, self.name)
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self._progress = progress or (lambda done, total: None)
        self._mmap: mmap.mmap | None = None
        self._handout: Handout | None = None
        if group:
            import grp
            if not socket_folder:
                raise ValueError("a pool for a group is handed out by a socket in a folder "
                                 "of the server's own: socket_folder is required")
            self.path = os.path.join(socket_folder, HANDOUT_NAME)
            fd = self._sealed_memfd(self.path, grp.getgrnam(group).gr_gid)
        else:
            fd = self._file(allocate)
        self._fd = fd               # kept open: the lock, or the memfd itself
        assert self._mmap is not None       # mapped by _file or _sealed_memfd
        self.mem: np.ndarray = np.frombuffer(self._mmap, dtype=np.uint8)
        self.mem[:len(MAGIC)] = np.frombuffer(MAGIC, dtype=np.uint8)
        self.mem[TOKEN_OFFSET:TOKEN_OFFSET + TOKEN_BYTES] = np.frombuffer(self.token, np.uint8)
        self.locked: bool = False

    def dup_fd(self) -> int:
        """A descriptor of the pool of the caller's own (close it when done)."""
        return os.dup(self._fd)

    def _file(self, allocate: bool) -> int:
        """The pool as a file at self.path, which clients open (mode 0600)."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)      # held while we live: see remove_stale
            if allocate:
                self._allocate(fd)
            else:
                os.ftruncate(fd, self.size)
            self._mmap = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED,
                                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        return fd

    def _sealed_memfd(self, path: str, gid: int) -> int:
        """The pool as a memfd sealed against shrinking and growing, handed out by a Unix
        socket at path (mode 0660, group gid). Why, for a group and not by default: a
        member of the group is another user, who could otherwise truncate the file and so
        stop the server (SIGBUS); the server's own user can stop it anyway, and a plain
        file keeps --shm-dir's meaning (hugetlbfs, a tmpfs of its own size) for the rest.
        The memfd lives in the kernel's internal tmpfs: --shm-dir holds nothing of it."""
        fd = os.memfd_create(self.name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            self._allocate(fd)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self._mmap = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED,
                                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
            self._handout = Handout(path, fd, gid)
        except BaseException:
            if self._mmap is not None:
                self._mmap.close()
            os.close(fd)
            raise
        return fd

    def _allocate(self, fd: int) -> None:
        """Give the file all its blocks now. With ftruncate alone the file was sparse: a
        tmpfs too small for it let the server start and killed it with SIGBUS at the first
        touch of a page it had no room for (a 1 GiB pool in a 256 MiB tmpfs died in the
        pre-fault, leaving its file). posix_fallocate fails with ENOSPC instead, and tmpfs
        and hugetlbfs hand back what it took. In steps, so progress is reported and a
        signal (SIGTERM during start-up) is handled between them."""
        for start in range(0, self.size, _STEP):
            length = min(_STEP, self.size - start)
            try:
                os.posix_fallocate(fd, start, length)
            except OSError as exc:
                raise OSError(exc.errno, f"{os.strerror(exc.errno or 0)}: {self.path} could "
                              f"take only {start >> 20} of the {self.size >> 20} MiB "
                              "asked for") from None
            self._progress(start + length, 2 * self.size)

    def prefault(self) -> None:
        """Touch every page now, so no request ever waits on a page fault; in steps, so a
        signal is handled between them and progress is reported."""
        for start in range(HEADER_BYTES, self.size, _STEP):
            # past the header: it holds the magic
            self.mem[start:start + _STEP:_PAGE] = 0
            self._progress(self.size + min(start + _STEP, self.size), 2 * self.size)

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
        if self._handout is not None:
            self._handout.close()           # removes the socket
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        if self._mmap is not None:
            self.mem = np.zeros(0, dtype=np.uint8)
            # A view of the pool may still be referenced (e.g. a stream mid-flight at
            # shutdown); then the mapping goes away with the process.
            with contextlib.suppress(BufferError):
                self._mmap.close()
            self._mmap = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


# A region's name, or a Unix socket an older server bound in the folder (its fast path's
# `<name>.sock`, or its --shm-group hand-out at the name itself): both sockets now lie in
# a folder of the server's own (kvstore_server.fastpath.unixsock), removed with it.
_NAME = re.compile(r"kvstore-(\d+)-[0-9a-f]{8}(?:\.sock)?")
_PID_MAX = 1 << 22          # Linux's PID_MAX_LIMIT: no pid is larger


def remove_own(directory: str) -> None:
    """Remove this process's region files and sockets in `directory` (start-up's undo).

    Registered before the region is made, so a SIGTERM or SIGINT that lands between the
    file's creation and the code that would close it (inside `Region()`, or before its
    caller has the object) still leaves nothing behind. Every name that carries our pid
    is ours: a region's name is made with O_EXCL from the pid and a random part."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        match = _NAME.fullmatch(name)
        if match is not None and int(match.group(1)) == os.getpid():
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, name))


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
    removed: list[tuple[str, int]] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        match = _NAME.fullmatch(name)
        if match is None or _running(int(match.group(1))):
            continue
        path = os.path.join(directory, name)
        if _dead_socket(path):          # a fast-path socket, or a --shm-group hand-out
            try:
                os.unlink(path)
                removed.append((path, 0))
            except OSError:
                pass
            continue
        # Only a regular file of the name is a pool: anyone may write in /dev/shm, and
        # opening a FIFO put there blocked the start for ever (O_NONBLOCK, and the type
        # checked on the open file), a symlink must not lead the unlink elsewhere.
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
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


def _dead_socket(path: str) -> bool:
    """Whether path is a Unix socket nobody listens on (its memfd died with its server)."""
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return False
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(path)
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False


def _running(pid: int) -> bool:
    """Whether a process of this pid runs here; a pid no process can have (a name put in
    the folder by hand: os.kill raised OverflowError and the server did not start) runs
    nowhere."""
    if not 0 < pid <= _PID_MAX:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
