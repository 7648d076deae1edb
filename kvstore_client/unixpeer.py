"""Who listens on the server's Unix socket: checked before a token is sent there.

A Unix socket's name is only a name: once the server that bound it is gone, any local
user who may write its folder can bind one there, and a client that trusted the name
gave that user its token and read pages at the offsets that user chose. So the client
takes who the server is from Attach (over gRPC, which reached the real server) and,
before it sends anything over the socket, checks three things against it:

- the folder holding the socket is a real folder (not a link) owned by the server's uid
  and writable by nobody else, so no one else can have put a name in it;
- the socket file is a socket owned by the server's uid;
- the process at the other end, as the kernel reports it (SO_PEERCRED, the uid and gid
  it had when it listened), has the server's uid and gid.

The last is the one that cannot be faked; the first two make the failure clear and cost
two lstat calls. A mismatch means no fast path over that socket: the caller uses gRPC
and says why in the log. The pid is reported but not compared: a client in another pid
namespace (a container beside the server's) sees another number for the same process.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
from dataclasses import dataclass

__all__ = ["ServerIdentity", "UntrustedSocket", "check_path", "check_peer"]

_UCRED = struct.Struct("3i")    # struct ucred: pid, uid, gid


@dataclass(frozen=True, slots=True)
class ServerIdentity:
    """Where the server's Unix socket is and who the server runs as, from Attach."""

    socket_path: str
    uid: int
    gid: int
    pid: int                    # as the server sees itself: logged, never compared


class UntrustedSocket(ConnectionError):
    """The socket, its folder or the process behind it is not the server's: no token
    goes there."""


def check_path(path: str, who: ServerIdentity) -> None:
    """UntrustedSocket unless the socket at path and its folder are who's and only who's;
    OSError (FileNotFoundError: the server is gone) when they cannot be looked at."""
    folder = os.path.dirname(path) or "."
    fst = os.lstat(folder)
    sst = os.lstat(path)
    if not stat.S_ISDIR(fst.st_mode):
        raise UntrustedSocket(f"{folder} is not a folder")
    if fst.st_uid != who.uid or fst.st_mode & 0o022:
        raise UntrustedSocket(f"{folder} belongs to uid {fst.st_uid} with mode "
                              f"{stat.S_IMODE(fst.st_mode):o}; the server is uid {who.uid} "
                              "and its folder is writable by nobody else")
    if not stat.S_ISSOCK(sst.st_mode):
        raise UntrustedSocket(f"{path} is not a socket")
    if sst.st_uid != who.uid:
        raise UntrustedSocket(f"{path} belongs to uid {sst.st_uid}, not the server's "
                              f"uid {who.uid}")


def check_peer(sock: socket.socket, path: str, who: ServerIdentity) -> None:
    """UntrustedSocket unless the process at the other end of the connected Unix socket
    runs as who's uid and gid (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    if uid != who.uid or gid != who.gid:
        raise UntrustedSocket(f"the process listening on {path} (pid {pid}) "
                              f"runs as uid {uid} gid {gid}; the server (pid {who.pid}) "
                              f"runs as uid {who.uid} gid {who.gid}")
