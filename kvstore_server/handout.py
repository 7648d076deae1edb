"""Hand the pool's file descriptor to local clients over a Unix socket (SCM_RIGHTS).

Why: a client that maps the pool needs a read-write descriptor of it, and a read-write
descriptor of a tmpfs file can also truncate it, which takes the pages from under the
server's own mapping: its next touch is a SIGBUS and the process dies (SECURITY.md). A
memfd can be sealed against shrinking (F_SEAL_SHRINK), so a client holding it can write
pages but not cut the file; but a memfd has no path to open. So the server keeps the
sealed memfd and listens on a Unix socket in its place: a client connects, receives the
descriptor with a 16-byte magic, and maps it as it mapped the file. Who may connect is
decided by the socket file's mode and group, as the file's were (0600, or 0660 for
--shm-group), since connecting needs write permission on the socket.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading

# The client's side (kvstore_client.shm) receives what this sends: the magic, the fd.
from kvstore_protocol.region import HANDOUT_MAGIC as MAGIC

__all__ = ["Handout"]

log = logging.getLogger(__name__)


class Handout:
    """A thread that sends `fd` to every process that connects to the socket at `path`."""

    def __init__(self, path: str, fd: int, gid: int = -1) -> None:
        """Bind the socket now (mode 0600; 0660 and group gid when gid >= 0): OSError if
        path exists. close() stops the thread and removes the socket."""
        self.path = path
        self._fd = fd
        self._stop = threading.Event()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            # Created 0600 at bind (umask), then opened to the group: never wider than asked.
            old = os.umask(0o177)
            try:
                self._sock.bind(path)
            finally:
                os.umask(old)
            if gid >= 0:
                os.chown(path, -1, gid)
                os.chmod(path, 0o660)
            self._sock.listen(64)
            self._sock.settimeout(0.2)          # how soon close() is noticed
        except BaseException:
            self._sock.close()
            raise
        self._thread = threading.Thread(target=self._serve, name="pool-handout", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            with conn:
                try:
                    socket.send_fds(conn, [MAGIC], [self._fd])
                except OSError as exc:          # the client went away: its loss only
                    log.debug("pool hand-out failed: %s", exc)

    def close(self) -> None:
        """Stop handing out (idempotent); descriptors already handed out stay valid."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

