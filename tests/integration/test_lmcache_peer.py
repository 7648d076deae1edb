"""bench/lmcache_peer.py: our client of LMCache's wire format, against LMCache's own server
where a Python with the lmcache package is at hand, and against a scripted peer always."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import socket
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from kvstore_bench import cli
from kvstore_bench.lmcache_peer import (
    REPLY,
    REQUEST,
    LMCacheClient,
    LMCacheServer,
    cache_key,
)

# A Python where lmcache is installed: KVSTORE_LMCACHE_PYTHON, else the venv that
# scripts/venv-lmcache.sh builds, else this one if it has it. The package wants torch, so
# it is rarely installed with the tests; scripts/test-lmcache (CI too) builds the venv.
_VENV = Path(__file__).resolve().parents[2] / ".venv-lmcache" / "bin" / "python"
LMCACHE_PYTHON = os.environ.get("KVSTORE_LMCACHE_PYTHON") or (
    str(_VENV) if _VENV.exists() else
    sys.executable if importlib.util.find_spec("lmcache") is not None else None)
needs_lmcache = pytest.mark.skipif(
    LMCACHE_PYTHON is None,
    reason="needs a Python with the lmcache package: scripts/test-lmcache builds one "
           "(.venv-lmcache), or set KVSTORE_LMCACHE_PYTHON to one")

SIZES = (64 << 10, 1 << 20, 4 << 20)


@pytest.fixture(scope="module")
def lmcache_port():
    assert LMCACHE_PYTHON is not None
    server = LMCacheServer(LMCACHE_PYTHON)
    try:
        yield server.port
    finally:
        server.close()


@needs_lmcache
@pytest.mark.slow
def test_a_get_returns_the_bytes_put(lmcache_port):
    rng = np.random.default_rng(3)
    c = LMCacheClient(lmcache_port)
    try:
        c.health()
        values = {size: rng.integers(0, 256, size, dtype=np.uint8) for size in SIZES}
        for i, size in enumerate(SIZES):
            c.put(cache_key(i, "test"), values[size].data)
        out = np.empty(max(SIZES), dtype=np.uint8)
        for i, size in enumerate(SIZES):
            assert c.exists(cache_key(i, "test"))
            out[:] = 0xAA
            get = c.getter(cache_key(i, "test"), size)
            get(out[:size].data)
            assert np.array_equal(out[:size], values[size]), f"{size} bytes came back different"
            assert (out[size:] == 0xAA).all(), "a GET wrote past the value"
            get(out[:size].data)                # again, on the same connection
            assert np.array_equal(out[:size], values[size])
        # A PUT of a key again replaces its value.
        again = rng.integers(0, 256, SIZES[0], dtype=np.uint8)
        c.put(cache_key(0, "test"), again.data)
        c.getter(cache_key(0, "test"), SIZES[0])(out[:SIZES[0]].data)
        assert np.array_equal(out[:SIZES[0]], again)
        # A key never put is not found, and a GET of it says so.
        assert not c.exists(cache_key(99, "test"))
        with pytest.raises(RuntimeError, match="answered code 400"):
            c.getter(cache_key(99, "test"), 16)(memoryview(bytearray(16)))
        c.health()                              # the connection is still in step
    finally:
        c.close()


@needs_lmcache
@pytest.mark.slow
def test_quick_peers_has_an_lmcache_row():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["peers", "--quick", "--lmcache-python", str(LMCACHE_PYTHON)]) == 0
    text = out.getvalue()
    assert sum(line.startswith("| lmcache |") for line in text.splitlines()) == 2, text
    assert "lmcache: " not in text, text         # nothing said to be skipped


def _scripted_peer(reply: bytes) -> tuple[int, threading.Thread, list[bytes]]:
    """A one-connection peer that reads one request and answers it with reply."""
    listener = socket.create_server(("127.0.0.1", 0))
    got: list[bytes] = []

    def serve() -> None:
        with listener, listener.accept()[0] as conn:
            request = b""
            while len(request) < REQUEST.size:
                request += conn.recv(REQUEST.size - len(request))
            got.append(request)
            # In pieces, as a busy server's reply may come.
            for i in range(0, len(reply), 7000):
                conn.sendall(reply[i:i + 7000])
            conn.recv(1)                        # until the client closes

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return listener.getsockname()[1], t, got


def _head(code: int, length: int) -> bytes:
    return REPLY.pack(code, length, 4, 6, length, 0, 0, 0, 0)


def test_a_get_reads_a_reply_that_comes_in_pieces_into_the_buffer():
    value = bytes(np.random.default_rng(5).integers(0, 256, 50_000, dtype=np.uint8))
    port, t, got = _scripted_peer(_head(200, len(value)) + value)
    c = LMCacheClient(port, timeout=10)
    out = bytearray(len(value))
    c.getter(cache_key(7), len(value))(memoryview(out))
    c.close()
    t.join(10)
    assert out == value
    command, *_, key = REQUEST.unpack(got[0])
    assert command == 2 and key == cache_key(7).encode().ljust(150)


@pytest.mark.parametrize(("code", "length"), [(200, 100), (400, 0)])
def test_a_get_answered_otherwise_than_the_size_asked_is_an_error(code, length):
    port, t, _ = _scripted_peer(_head(code, length) + b"x" * length)
    c = LMCacheClient(port, timeout=10)
    with pytest.raises(RuntimeError, match=f"answered code {code} with {length} bytes"):
        c.getter(cache_key(1), 4096)(memoryview(bytearray(4096)))
    c.close()
    t.join(10)
