"""The fast path's Unix socket, in a folder that only the server's user may write.

Why a folder of its own. The socket used to lie beside the pool, at `<pool>.sock` in
/dev/shm, where every local user may make names. Two faults followed. After a graceful
stop removed the socket, another user bound one at the same name and received the token
of every client that reconnected, then answered their Acquires with offsets of its own
choosing into the old mapping: wrong pages, served as hits. And a name made at
`<pool>.sock` while the pool was being allocated (seconds, with the pool's name already
visible) made start-up fail with exit 78, which systemd is told not to restart.

So, at start and before the pool is allocated, the server makes a folder with a fresh
random name by mkdir, which fails rather than reuse a name that someone else made (then
another name is tried): nobody can take or block it in advance. It belongs to the
server's user, mode 0750 with the pool's group, so nobody else can make, remove or
replace a name inside it, and the users who may map the pool may still reach the socket
(whose own mode and group are the pool's). Attach reports the socket's exact path and
the server's uid, gid and pid; a client checks the folder, the socket file and the
listening process (SO_PEERCRED) against them before it sends a token
(kvstore_client.unixpeer). The folder is removed at stop; one left by a server that was
killed is removed at the next start (remove_stale_folders).

    <socket_dir>/kvstore-<pid>-<8 hex>.d/     0750  server's user, pool's group
                                   fast.sock   0600 or 0660, as the pool
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import socket
import stat

__all__ = ["SocketFolder", "remove_stale_folders", "socket_path", "unix_listener"]

log = logging.getLogger(__name__)

FOLDER_MODE = 0o750
_TRIES = 8                  # fresh names tried when one is taken (32 random bits each)
_FOLDER = re.compile(r"kvstore-(\d+)-[0-9a-f]{8}\.d")


# The socket's name in its folder: short, since a Unix socket's whole path must fit in
# sun_path (108 bytes), and the folder's name already carries the pid and a random part.
SOCKET_NAME = "fast.sock"
_SUN_PATH = 107             # bytes of a path bind() takes (sun_path, less its NUL)


def socket_path(folder: str) -> str:
    """Where the fast path's Unix socket lives in the server's folder."""
    return os.path.join(folder, SOCKET_NAME)


class SocketFolder:
    """A folder made fresh (mkdir, never reused) in `base`, owned by this process's user;
    `path`; `close()` removes it and what it holds."""

    def __init__(self, base: str, gid: int = -1) -> None:
        """gid: the group that may enter it (the pool's, for --shm-group); -1 = this
        process's own. Raises OSError when base cannot hold a folder of ours (missing,
        not writable, or a path too long for a socket in it): a setting, not something
        another user did."""
        longest = len(os.fsencode(socket_path(os.path.join(base,
                                                           "kvstore-4194304-00000000.d"))))
        if longest > _SUN_PATH:
            raise OSError(f"{base} is too long a path for a Unix socket in a folder in it "
                          f"({longest} bytes of at most {_SUN_PATH}): choose a shorter one")
        last: OSError | None = None
        for _ in range(_TRIES):
            path = os.path.join(base, f"kvstore-{os.getpid()}-{secrets.token_hex(4)}.d")
            try:
                os.mkdir(path, 0o700)
            except FileExistsError as exc:      # someone else made this name: another
                last = exc
                continue
            try:
                if gid >= 0:
                    os.chown(path, -1, gid)
                os.chmod(path, FOLDER_MODE)
            except OSError:
                os.rmdir(path)
                raise
            self.path = path
            return
        raise OSError(f"{base}: {_TRIES} fresh folder names were all taken ({last})")

    def close(self) -> None:
        """Remove the folder and its sockets (idempotent)."""
        shutil.rmtree(self.path, ignore_errors=True)


def remove_stale_folders(base: str) -> list[str]:
    """Remove the socket folders, in base, of servers of this user that are gone (killed:
    their stop never ran); returns the paths removed. A folder is gone when the pid in its
    name runs nowhere here and no socket in it accepts a connection (a server in another
    pid namespace that shares the folder still answers). Another user's is never touched."""
    removed: list[str] = []
    try:
        names = os.listdir(base)
    except OSError:
        return removed
    for name in names:
        match = _FOLDER.fullmatch(name)
        if match is None or _running(int(match.group(1))):
            continue
        path = os.path.join(base, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                continue
            if any(_answers(os.path.join(path, entry)) for entry in os.listdir(path)):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
        log.info("removed %s: the socket folder of a server that did not stop cleanly", path)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError, ValueError):
        return False
    except PermissionError:
        return True
    return pid > 0


def _answers(path: str) -> bool:
    """Whether path is a Unix socket that someone listens on."""
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return False
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(1.0)
            s.connect(path)
    except OSError:
        return False
    return True


def unix_listener(path: str, pool_path: str) -> socket.socket:
    """A listening Unix socket at path (in a SocketFolder: a fresh name), with the mode
    and group of the pool at pool_path: whoever may map the pool may connect, nobody
    else. bind() fails rather than replace an existing name."""
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old = os.umask(0o177)
        try:
            lsock.bind(path)
        finally:
            os.umask(old)
        st = os.stat(pool_path)
        os.chown(path, -1, st.st_gid)
        os.chmod(path, st.st_mode & 0o660)
        lsock.listen(128)
    except OSError:
        lsock.close()
        raise
    return lsock
