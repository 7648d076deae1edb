"""One action on a server's pool as another user, in a process of its own (test_pool_file).

    python pool_as_user.py UID GID ACTION PATH [SERVER_UID SERVER_GID SERVER_PID]

Started as root, it imports what it needs, becomes UID:GID with no supplementary groups,
does ACTION and prints `ok`, or the class name of the OSError that stopped it (anything
else is a traceback on stderr and nothing on stdout). A fresh interpreter started with
exec, not a fork of the test process: a fork copies that process's page tables and runs
every library's fork handlers, a cost that grows with what a long run has left in it.

ACTION: open (read-write), truncate (to 0), shrink (map the pool as a client does, then
ftruncate the descriptor the hand-out socket gives), receive (a descriptor from the
hand-out socket).
"""

from __future__ import annotations

import os
import sys

from kvstore_client.shm import SharedRegion, _receive_fd
from kvstore_client.unixpeer import ServerIdentity


def _shrink(path: str, server: ServerIdentity) -> None:
    region = SharedRegion(path, 64 << 20, 16, server)       # as a client maps it
    assert region.mem[:14].tobytes() == b"kvstore-region"
    fd = _receive_fd(path, server)
    try:
        os.ftruncate(fd, 0)
    finally:
        os.close(fd)


def main(argv: list[str]) -> None:
    uid, gid, action, path = int(argv[0]), int(argv[1]), argv[2], argv[3]
    server = (ServerIdentity(path, int(argv[4]), int(argv[5]), int(argv[6]))
              if len(argv) > 4 else None)
    actions = {
        "open": lambda: os.close(os.open(path, os.O_RDWR)),
        "truncate": lambda: os.truncate(path, 0),
        "shrink": lambda: _shrink(path, server),
        "receive": lambda: os.close(_receive_fd(path, server)),
    }
    act = actions[action]
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    try:
        act()
    except OSError as exc:
        print(type(exc).__name__)
    else:
        print("ok")


if __name__ == "__main__":
    main(sys.argv[1:])
