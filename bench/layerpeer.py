"""A raw TCP peer that serves pages layer-major: the same bytes a store's layer-major Get
sends, with no protocol around them (the ceiling for kvstore-bench remote-load).

Run as its own process, where the server would run (`python -m kvstore_bench.layerpeer
PAGES PAGE_BYTES LAYERS SEED`; it prints its port when listening). It holds PAGES pages of
random bytes, the same ones `pages(PAGES, PAGE_BYTES, SEED)` makes in the client, so a
client can check what it received. Each connection is served by a thread, request after
request; a request is 16 bytes, `first u64 | end u64` (little-endian): the peer sends
layer 0 of pages [first, end), then layer 1 of them, ..., one sendmsg of the layers' slabs
(each a view into its page) for about SEND_BYTES at a time, as the server sends a Get.
"""

from __future__ import annotations

import socket
import struct
import sys
import threading

import numpy as np

from .rawpeer import exit_with_parent, read_head

__all__ = ["REQUEST", "pages", "serve"]

REQUEST = struct.Struct("<QQ")
SEND_BYTES = 2 << 20
IOV_MAX = 1024


def pages(n: int, page_bytes: int, seed: int) -> np.ndarray:
    """The peer's pages: (n, page_bytes) random bytes from seed."""
    return np.random.default_rng(seed).integers(0, 256, (n, page_bytes), dtype=np.uint8)


def _send(conn: socket.socket, views: list[memoryview]) -> None:
    """sendmsg until every view is sent."""
    i = 0
    while i < len(views):
        sent = conn.sendmsg(views[i:])
        while i < len(views) and sent >= views[i].nbytes:
            sent -= views[i].nbytes
            i += 1
        if sent:
            views[i] = views[i][sent:]


def _serve_conn(conn: socket.socket, mem: memoryview, page_bytes: int, layers: int) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    layer_bytes = page_bytes // layers
    head = bytearray(REQUEST.size)
    with conn:
        while True:
            if not read_head(conn, head):
                return
            first, end = REQUEST.unpack(head)
            batch: list[memoryview] = []
            for base in range(0, page_bytes, layer_bytes):
                for page in range(first, end):
                    at = page * page_bytes + base
                    batch.append(mem[at:at + layer_bytes])
                    if len(batch) * layer_bytes >= SEND_BYTES or len(batch) == IOV_MAX:
                        _send(conn, batch)
                        batch = []
            if batch:
                _send(conn, batch)


def serve(n: int, page_bytes: int, layers: int, seed: int) -> None:
    """Serve until killed; prints the port once listening."""
    mem = memoryview(pages(n, page_bytes, seed).reshape(-1))
    with socket.socket() as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", 0))
        srv.listen(64)
        print(srv.getsockname()[1], flush=True)
        while True:
            conn, _ = srv.accept()
            threading.Thread(target=_serve_conn, args=(conn, mem, page_bytes, layers),
                             daemon=True).start()


if __name__ == "__main__":
    exit_with_parent()
    serve(*(int(a) for a in sys.argv[1:5]))
