"""A raw TCP peer for the benchmarks: the same bytes as a store call, with no protocol.

Run as its own process, where the server would run (`python -m kvstore_bench.rawpeer
HOST PORT [CONGESTION]`; it prints its port when listening). Each connection is served by a thread,
request after request; a request is 9 bytes, `op u8 | nbytes u64` (little-endian):

    G  the peer sends nbytes from its buffer (sendall of 1 MiB views): a get
    P  the peer receives nbytes into its buffer, then sends one byte: a put

A call's bytes are distinct memory, as a store's pages are: the n-th MiB of a call is the
n-th MiB of the buffer (wrapping past its end), both ways. Sending the first MiB again
for every MiB of a call read a source that stayed in the CPU's cache, where a store's
call of 8 or 32 pages of 1 MiB reads 8 or 32 MiB of its pool: a cheaper call than any
store can make, and so a higher bar only for the large calls.

`RawClient` is the client side: get, put, and a striped get over several connections at
once (threads, each receiving its slice straight into the caller's buffer), the
ceiling a striped fast-path get is measured against.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import threading
import time

import numpy as np

from kvstore_protocol.congestion import set_congestion
from kvstore_server.fastpath.io import set_timeouts

__all__ = ["RawClient", "connect", "exit_with_parent", "read_head", "serve"]

REQUEST = struct.Struct("<cQ")
CHUNK = 1 << 20


def exit_with_parent() -> None:
    """End this process once the one that started it is gone. A bench killed part-way (a
    time limit, ^C) cannot stop its peer, which would otherwise keep its port and memory
    and share the machine's cores with the next run."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def read_head(conn: socket.socket, head: bytearray) -> bool:
    """Fill head with the next request's fixed-size head; False when the peer closed."""
    pos = 0
    while pos < len(head):
        got = conn.recv_into(memoryview(head)[pos:])
        if not got:
            return False
        pos += got
    return True


def _serve_conn(conn: socket.socket, data: memoryview, sink: memoryview) -> None:
    """Answer one connection's requests until it closes: gets from data, puts into
    sink (this connection's own)."""
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    head = bytearray(REQUEST.size)
    with conn:
        while True:
            if not read_head(conn, head):
                return
            op, nbytes = REQUEST.unpack(head)
            pos = 0                          # where in data this call's bytes are
            if op == b"G":
                # In pieces of CHUNK: the server sends at most 2 MiB a sendmsg, as sends
                # of a few MiB moved more over loopback than one of 128 MiB
                # (kvstore_server/fastpath/io.py), so a large get compares like with like.
                while nbytes:
                    take = min(nbytes, CHUNK, len(data) - pos)
                    conn.sendall(data[pos:pos + take])
                    nbytes -= take
                    pos = (pos + take) % len(data)
            else:
                while nbytes:
                    got = conn.recv_into(sink[pos:], min(nbytes, len(sink) - pos))
                    if not got:
                        return
                    nbytes -= got
                    pos = (pos + got) % len(sink)
                conn.sendall(b"k")


def serve(host: str, port: int = 0, buffer_bytes: int = 64 << 20,
          congestion: str = "") -> None:
    """Serve until killed; prints the port once listening. congestion: the TCP
    congestion control its connections send under ("" = the host's), as the server's
    --data-congestion."""
    data = memoryview(np.ones(buffer_bytes, dtype=np.uint8)).cast("B")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if congestion:
            set_congestion(srv, congestion)       # accepted connections take it
        srv.bind((host, port))
        srv.listen(64)
        print(srv.getsockname()[1], flush=True)
        while True:
            conn, _ = srv.accept()
            # A connection's own, as large as the gets' buffer: a put's bytes land in
            # distinct memory as a store's do (np.zeros: a page is mapped when written).
            sink = memoryview(np.zeros(buffer_bytes, dtype=np.uint8)).cast("B")
            threading.Thread(target=_serve_conn, args=(conn, data, sink), daemon=True).start()


# A baseline's client sockets are blocking, bounded by the kernel's own timeouts
# (SO_RCVTIMEO/SO_SNDTIMEO) as our client's are. A Python timeout makes each receive a
# poll first: with one the raw client's 16-byte round trip took 19.0 us against 17.1, and
# a 64 KiB get 28.0 against 25.9 (one CPU, alternating blocks, 5 rounds), so every ratio
# against it read a little better than a plain socket deserves.
def connect(host: str, port: int, timeout: float = 60) -> socket.socket:
    """A TCP connection as every baseline's client opens it: no Nagle delay, blocking,
    each send or receive giving up after `timeout` seconds without progress."""
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.settimeout(None)
    set_timeouts(sock, timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class RawClient:
    """Connections to a rawpeer; not thread-safe (striped gets use one thread each)."""

    def __init__(self, host: str, port: int, connections: int = 1) -> None:
        self.socks = [connect(host, port) for _ in range(connections)]

    @staticmethod
    def _get(sock: socket.socket, out: memoryview) -> None:
        sock.sendall(REQUEST.pack(b"G", len(out)))
        pos = 0
        while pos < len(out):
            got = sock.recv_into(out[pos:])
            if not got:
                raise ConnectionError("the raw peer closed the connection")
            pos += got

    def get(self, out: memoryview) -> None:
        """len(out) bytes into out: over one connection, or striped over all of them."""
        if len(self.socks) == 1:
            self._get(self.socks[0], out)
            return
        bounds = np.linspace(0, len(out), len(self.socks) + 1).astype(int).tolist()
        threads = [threading.Thread(target=self._get, args=(sock, out[a:b]))
                   for sock, a, b in zip(self.socks, bounds[:-1], bounds[1:], strict=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def put(self, data: memoryview) -> None:
        sock = self.socks[0]
        sock.sendall(REQUEST.pack(b"P", len(data)))
        for start in range(0, len(data), CHUNK):
            sock.sendall(data[start:start + CHUNK])
        if sock.recv(1) != b"k":
            raise ConnectionError("the raw peer did not acknowledge a put")

    def close(self) -> None:
        for sock in self.socks:
            sock.close()


if __name__ == "__main__":
    exit_with_parent()
    serve(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0,
          congestion=sys.argv[3] if len(sys.argv) > 3 else "")
