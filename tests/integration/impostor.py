"""The other local user of test_unix_socket_trust, as a process of its own:

    python impostor.py UID GID RECEIVED

Started as root, it becomes UID:GID with no supplementary groups and takes commands, one
a line on stdin, answering each with a line on stdout (test_unix_socket_trust.Impostor
sends them): `bind PATH` binds a listening Unix socket there (making the folders on the
way, as that user may), answers HELLO with OK as a server would and appends every byte
it receives to RECEIVED; `block SHM_DIR` makes a folder at `<pool>.sock` the moment a
server's pool file appears there; `presence PATH` makes a file that looks like a live
server's presence map with every counter 0; `handout SIZE PATH` binds a socket that
hands every caller a pool of this user's own. Each answers `ok` (block: the name made)
or the class name of the OSError that stopped it.

A fresh interpreter started with exec, not a fork of the test process: a fork copies that
process's page tables and runs every library's fork handlers, a cost that grows with
what a long run has left in it.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import socket
import sys
import threading
import time

from kvstore_client import presence
from kvstore_protocol import fastwire as fw
from kvstore_protocol.region import HANDOUT_MAGIC

REGION_MAGIC = b"kvstore-region\x00\x01"     # kvstore_server.region.MAGIC
RECEIVED = ""                                 # set from argv in main


def serve_commands() -> None:
    """Each command line on stdin, its answer a line on stdout; until stdin closes."""
    for line in sys.stdin:
        verb, _, arg = line.strip().partition(" ")
        if verb == "bind":
            answer = _bind(arg)
        elif verb == "block":
            answer = _block(arg)
        elif verb == "presence":
            answer = _presence(arg)
        elif verb == "handout":
            size, _, path = arg.partition(" ")
            answer = _handout(path, int(size))
        else:
            answer = f"unknown command {verb!r}"
        print(answer, flush=True)


def _bind(path: str) -> str:
    try:
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        lsock.bind(path)
        os.chmod(path, 0o777)
        lsock.listen(16)
    except OSError as exc:
        return type(exc).__name__
    threading.Thread(target=_serve, args=(lsock,), daemon=True).start()
    return "ok"


def _serve(lsock: socket.socket) -> None:
    while True:
        conn, _ = lsock.accept()
        conn.settimeout(5.0)
        try:
            while True:
                data = conn.recv(65536)
                if not data:
                    break
                with open(RECEIVED, "ab") as f:
                    f.write(data)
                if data[2] == fw.Op.HELLO:          # as a server would: OK, a tenant
                    conn.sendall(fw.encode_header(fw.Op.HELLO, 1, 0) + b"a")
        except OSError:
            pass
        finally:
            conn.close()


def _handout(path: str, size: int) -> str:
    try:
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        pool = os.memfd_create("forged-pool")
        os.ftruncate(pool, size)
        os.pwrite(pool, REGION_MAGIC + secrets.token_bytes(16), 0)
        lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        lsock.bind(path)
        os.chmod(path, 0o777)
        lsock.listen(16)
    except OSError as exc:
        return type(exc).__name__

    def serve() -> None:
        while True:
            conn, _ = lsock.accept()
            with open(RECEIVED, "ab") as f:
                f.write(b"handout\n")
            with conn:
                socket.send_fds(conn, [HANDOUT_MAGIC], [pool])
    threading.Thread(target=serve, daemon=True).start()
    return "ok"


def _presence(path: str) -> str:
    page, bits = 4096, 12
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        os.ftruncate(fd, page + (1 << bits))
        head = mmap.mmap(fd, page)
    except OSError as exc:
        return type(exc).__name__

    def beat() -> None:
        while True:
            presence.HEADER.pack_into(head, presence.HEADER_AT, presence.MAGIC, page,
                                      bits, 0, time.monotonic())
            time.sleep(0.2)
    threading.Thread(target=beat, daemon=True).start()
    return "ok"


def _block(shm_dir: str) -> str:
    pool = re.compile(r"kvstore-\d+-[0-9a-f]{8}")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for name in os.listdir(shm_dir):
            if pool.fullmatch(name):
                try:
                    os.mkdir(os.path.join(shm_dir, name + ".sock"))
                except OSError as exc:
                    return type(exc).__name__
                return name + ".sock"
        time.sleep(0.001)
    return "no pool appeared"


def main(argv: list[str]) -> None:
    global RECEIVED
    uid, gid, RECEIVED = int(argv[0]), int(argv[1]), argv[2]
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    serve_commands()


if __name__ == "__main__":
    main(sys.argv[1:])
