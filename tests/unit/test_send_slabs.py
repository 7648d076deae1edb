"""send_slabs: a layer-major answer's bytes, in order, whatever the socket takes a call."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from kvstore_server.fastpath.io import SEND_BYTES, send_slabs, set_timeouts


def _expected(mem: np.ndarray, offsets: list[int], layers: int, size: int) -> bytes:
    return b"".join(mem[o + layer * size:o + (layer + 1) * size].tobytes()
                    for layer in range(layers) for o in offsets)


def _received(offsets: list[int], layers: int, size: int, mem: np.ndarray,
              slow: bool = False) -> bytes:
    with socket.create_server(("127.0.0.1", 0)) as listener:   # TCP, as the server's
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    if slow:
        # As the server's sockets: a send gives up after its timeout (SO_SNDTIMEO) and
        # reports what it sent, which a reader slower than that makes part of a call.
        set_timeouts(a, 0.3)
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 10)
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)
    want = len(offsets) * layers * size
    got = bytearray()

    def read() -> None:
        while len(got) < want:
            chunk = b.recv(min(want - len(got), 7919))    # odd-sized reads
            if not chunk:
                return
            got.extend(chunk)
            if slow:
                time.sleep(0.002)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        send_slabs(a, memoryview(mem), np.asarray(offsets, dtype=np.int64), layers, size)
    finally:
        reader.join(10)
        a.close()
        b.close()
    return bytes(got)


@pytest.mark.parametrize(("pages", "layers", "size"), [
    (1, 1, 4096), (3, 5, 4096), (8, 32, 64 << 10), (40, 3, 64 << 10), (2, 2, SEND_BYTES)])
def test_every_slab_of_every_layer_in_order(pages, layers, size):
    rng = np.random.default_rng(pages)
    page = layers * size
    mem = rng.integers(0, 256, (pages + 2) * page, dtype=np.uint8)
    offsets = [int(i) * page for i in rng.permutation(pages + 2)[:pages]]  # scattered
    assert _received(offsets, layers, size, mem) == _expected(mem, offsets, layers, size)


def test_partial_sends_resume_where_they_stopped():
    layers, size, pages = 3, 64 << 10, 12
    mem = np.random.default_rng(1).integers(0, 256, pages * layers * size, dtype=np.uint8)
    offsets = [p * layers * size for p in reversed(range(pages))]
    assert _received(offsets, layers, size, mem, slow=True) == \
        _expected(mem, offsets, layers, size)
