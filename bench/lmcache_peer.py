"""LMCache's standalone server as a bench peer: its process, and a client of its wire format.

The server is LMCache's own (`python -m lmcache.v1.server HOST PORT cpu`), run by a
Python where the `lmcache` package imports; that is usually another environment than
the bench's, since the package wants torch. This side imports neither: `LMCacheClient`
speaks the wire format with a socket, and a GET's bytes land straight in the caller's
buffer, as our client's and the RESP client's do, so a comparison is of the servers.

The wire format (LMCache 0.5.x, lmcache/v1/protocol.py), in the machine's byte order:

- a request is 9 int32 and a 150-byte key: command (PUT 1, GET 2, EXIST 3, HEALTH 5),
  length, memory format, dtype, location, the shape's 4 dimensions; a PUT's `length`
  bytes follow it;
- a reply (to GET, EXIST, HEALTH; a PUT has none) is 9 int32: code (200 found or well,
  400 not found), length, memory format, dtype, the shape's 4 dimensions, location; a
  found GET's `length` bytes follow it.

The key is LMCache's cache-engine key as text, `model@world_size@worker_id@hash@dtype`
(the hash in hex), which the server parses and refuses otherwise.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from .rawpeer import connect

__all__ = ["LMCacheClient", "LMCacheServer", "cache_key", "lmcache_imports"]

# Native order and sizes, as the server packs and unpacks them.
REQUEST = struct.Struct("9i150s")
REPLY = struct.Struct("9i")
PUT, GET, EXIST, HEALTH = 1, 2, 3, 5
OK, MISSING = 200, 400
BINARY = 4          # MemoryFormat.BINARY: plain bytes, shape [length, 0, 0, 0]
UINT8 = 6           # the dtype numbering of the wire, not of the key text
KEY_BYTES = 150


def cache_key(n: int, model: str = "kvstore-peers") -> str:
    """The n-th key of a one-worker cache of uint8 values, as the server parses keys."""
    return f"{model}@1@0@{n:x}@uint8"


def _request(command: int, key: str, length: int = 0) -> bytes:
    raw = key.encode()
    if len(raw) > KEY_BYTES:
        raise ValueError(f"an LMCache key is at most {KEY_BYTES} bytes: {key!r}")
    # The server strips the key's text of whitespace only: pad with spaces, not the NULs
    # struct would pad with, or the key it parses ends in NULs and it drops the connection.
    return REQUEST.pack(command, length, BINARY, UINT8, 0, length, 0, 0, 0,
                        raw.ljust(KEY_BYTES))


class LMCacheClient:
    """PUT, GET into a buffer, EXIST and HEALTH over one connection to an LMCache server."""

    def __init__(self, port: int, host: str = "127.0.0.1", timeout: float = 60) -> None:
        self.sock = connect(host, port, timeout)
        self._reply = memoryview(bytearray(REPLY.size))

    def _read_reply(self) -> tuple[int, ...]:
        pos = 0
        while pos < REPLY.size:
            n = self.sock.recv_into(self._reply[pos:])
            if not n:
                raise ConnectionError("the LMCache server closed the connection")
            pos += n
        return REPLY.unpack(self._reply)

    def health(self) -> None:
        self.sock.sendall(_request(HEALTH, cache_key(0)))
        code = self._read_reply()[0]
        if code != OK:
            raise RuntimeError(f"LMCache HEALTH answered code {code}")

    def exists(self, key: str) -> bool:
        self.sock.sendall(_request(EXIST, key))
        return self._read_reply()[0] == OK

    def put(self, key: str, value: memoryview) -> None:
        """Store value under key. The server answers a PUT with nothing, so a refused one
        shows only as the connection closing; exists() after it tells."""
        self.sock.sendall(_request(PUT, key, value.nbytes))
        self.sock.sendall(value)

    def getter(self, key: str, size: int) -> Callable[[memoryview], None]:
        """get(out): the value of key, `size` bytes, received into out (out.nbytes == size)."""
        request = _request(GET, key)
        reply = self._reply

        def get(out: memoryview) -> None:
            self.sock.sendall(request)
            # One receive for the reply's head and as much of the value as has come, the
            # same first receive the RESP client makes; then the rest of the value.
            got = self.sock.recvmsg_into([reply, out])[0]
            if not got:
                raise ConnectionError("the LMCache server closed the connection")
            while got < REPLY.size:
                n = self.sock.recv_into(reply[got:])
                if not n:
                    raise ConnectionError("the LMCache server closed the connection")
                got += n
            code, length = REPLY.unpack(reply)[:2]
            if code != OK or length != size:
                raise RuntimeError(f"LMCache GET {key!r} answered code {code} with "
                                   f"{length} bytes, expected {OK} with {size}")
            pos = got - REPLY.size
            while pos < size:
                n = self.sock.recv_into(out[pos:], size - pos, socket.MSG_WAITALL)
                if not n:
                    raise ConnectionError("the LMCache server closed the connection")
                pos += n
        return get

    def close(self) -> None:
        self.sock.close()


def lmcache_imports(python: str) -> bool:
    """Whether the `lmcache` package can be found by the interpreter at path python."""
    try:
        out = subprocess.run(
            [python, "-c", "import importlib.util, sys; "
             "sys.exit(importlib.util.find_spec('lmcache') is None)"],
            capture_output=True, timeout=60, check=False)
    except OSError:
        return False
    return out.returncode == 0


# Runs the server's module as `python -m` would, with a thread that ends the process once
# its parent is gone: a bench killed part-way cannot stop it, and it would otherwise keep
# its port and memory and share the machine's cores with the next run.
_LAUNCH = """\
import os, runpy, threading, time
parent = os.getppid()
def watch():
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)
threading.Thread(target=watch, daemon=True).start()
runpy.run_module("lmcache.v1.server", run_name="__main__", alter_sys=True)
"""


class LMCacheServer:
    """LMCache's server, CPU storage, on a free loopback port, run by the Python given."""

    def __init__(self, python: str = sys.executable, wait: float = 180) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        # Its log goes to a file, read back only to say why it did not start.
        self.log = tempfile.TemporaryFile(prefix="kvstore-peers-lmcache-")  # noqa: SIM115 - closed at close()
        self.proc = subprocess.Popen(
            [python, "-c", _LAUNCH, "127.0.0.1", str(self.port), "cpu"],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)
        # It listens only once torch and lmcache have imported: seconds, more when the
        # machine is busy. Ready is a HEALTH answered.
        deadline = time.monotonic() + wait
        while True:
            try:
                probe = LMCacheClient(self.port, timeout=10)
                try:
                    probe.health()
                finally:
                    probe.close()
                return
            except (OSError, RuntimeError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    why = (f"exited with {self.proc.returncode}"
                           if self.proc.poll() is not None
                           else f"did not answer in {wait:.0f} s")
                    tail = self._log_tail()
                    self.close()
                    raise RuntimeError(f"the LMCache server ({python}) {why}; its last "
                                       f"output:\n{tail}") from None
                time.sleep(0.1)

    def _log_tail(self, lines: int = 15) -> str:
        self.log.seek(0)
        text = self.log.read().decode(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        with contextlib.suppress(OSError):
            self.log.close()
