"""A floor for a fast-path server in Python: the protocol answered with nothing behind it.

Run as its own process, where the server would run (`python -m kvstore_bench.floorpeer HOST
PAGE_BYTES`; it prints its port when listening). It speaks the fast path's framing
(kvstore_protocol.fastwire) for the calls `kvstore-bench fastpath --floor` makes:

    HELLO   answered at once: no token checked; QUIET and ALIGNED granted where asked
    LOOKUP  of one layout: answered "all n keys present, no lease", nothing looked up
    GET     page-major: the aligned header, then n pages of PAGE_BYTES from its buffer
            (the n-th page of a call is the n-th of the buffer, side by side, as a Put's
            pages lie in the server's pool), in one sendmsg

Each connection is served by a thread, frame after frame, with one receive buffer; no
lock, no index, no pins, no metrics. So a call against it costs what a server of this
protocol costs in the least Python it can be written in: read the frame, answer it.
bench/fastpath_floor.py says what it is measured for.
"""

from __future__ import annotations

import socket
import sys
import threading

import numpy as np

from kvstore_protocol import fastwire as fw

from .rawpeer import exit_with_parent

__all__ = ["serve"]

_HEAD = fw.HEADER.size
_PAGES = 32                  # pages in the buffer: the most a GET of the bench asks for


def _frames(conn: socket.socket, mem: memoryview, page_bytes: int) -> None:
    """Answer one connection's frames until it closes."""
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(64 << 10))
    start = end = 0                           # bytes received and not yet taken
    pad = b""
    head = bytearray(_HEAD + fw.ALIGN_PAD)
    count = fw.COUNT_LEASE
    with conn:
        while True:
            while end - start < _HEAD or end - start < _HEAD + fw.HEADER.unpack_from(
                    buf, start)[5]:
                if start:                     # room at the end: what is left goes first
                    buf[:end - start] = buf[start:end]
                    start, end = 0, end - start
                got = conn.recv_into(buf[end:])
                if not got:
                    return
                end += got
            _, _, op, _, flags, body_len, _ = fw.HEADER.unpack_from(buf, start)
            body = buf[start + _HEAD:start + _HEAD + body_len]
            start += _HEAD + body_len
            if op == fw.Op.LOOKUP:
                n = fw.ONE_LAYOUT_LOOKUP.unpack_from(body)[4]
                conn.sendall(fw.encode_header(op, count.size) + count.pack(n, 0))
            elif op == fw.Op.GET:
                n = fw.LAYOUT_KEYS_HEAD.unpack_from(body)[2]
                nbytes = n * page_bytes
                fw.HEADER.pack_into(head, 0, fw.MAGIC, fw.VERSION, op, 0, 0, len(pad), nbytes)
                conn.sendmsg([memoryview(head)[:_HEAD + len(pad)], mem[:nbytes]])
            elif op == fw.Op.HELLO:
                granted = flags & (fw.QUIET | fw.ALIGNED)
                pad = bytes(fw.ALIGN_PAD) if granted & fw.ALIGNED else b""
                conn.sendall(fw.encode_header(op, 5, flags=granted) + b"floor")
            else:
                return                        # not a call this floor answers: closed


def serve(host: str, page_bytes: int) -> None:
    """Serve until killed; prints the port once listening."""
    mem = np.ones(_PAGES * page_bytes, dtype=np.uint8).data
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((host, 0))
        srv.listen(16)
        print(srv.getsockname()[1], flush=True)
        while True:
            conn, _ = srv.accept()
            threading.Thread(target=_frames, args=(conn, mem, page_bytes),
                             daemon=True).start()


if __name__ == "__main__":
    exit_with_parent()
    serve(sys.argv[1], int(sys.argv[2]))
