"""`kvstore-bench fastpath --floor --quick`: our client and our server each against a stand-in
of the same protocol (bench/floorpeer.py, a lean client), against the real server, raw peer
and floor peer it starts. No figure is asserted (the machine is shared); the report's
shape is, that every side made its calls (the bench checks each side's answers before it
times them: counts and page bytes), and the floor peer's answers are checked here too."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest

from kvstore_bench import fastpath_bench
from kvstore_bench.fastpath_floor import PAGE, SIDES, _floor_peer, _Lean
from kvstore_protocol import fastwire as fw

pytestmark = pytest.mark.slow

CALLS = ("lookup of 16 keys", "get 1 x 64 KiB", "get 8 x 64 KiB")


def test_quick_floor_prints_each_side_and_what_each_end_adds():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = fastpath_bench.main(["--floor", "--quick"])
    assert rc == 0
    text = out.getvalue()
    rows = [line.strip("|").split("|") for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| call")]
    sides = {r[0].strip(): [float(x) for x in r[1:]] for r in rows if len(r) == 1 + len(SIDES)}
    parts = {r[0].strip(): r[1:] for r in rows if len(r) == 6}
    assert set(sides) == set(CALLS) and set(parts) == set(CALLS), text
    for figures in sides.values():
        assert all(x > 0 for x in figures), text


def test_the_floor_peer_answers_the_protocol():
    """A lookup counts every key; a get sends the aligned header and the pages asked for,
    ones, from its own buffer; a frame it does not answer closes the connection."""
    peer = _floor_peer(PAGE)
    try:
        lean = _Lean(peer.port)
        assert lean.lookup(bytes(16), b"k" * 16 * 5)() == 5
        out = np.zeros(3 * PAGE, dtype=np.uint8)
        lean.get(bytes(16), b"k" * 16 * 3, memoryview(out))()
        assert (out == 1).all()
        assert lean.lookup(bytes(16), b"k" * 16 * 16)() == 16      # still in step
        lean.sock.sendall(fw.encode_header(fw.Op.DELETE, 0))
        assert lean.sock.recv(1) == b""
        lean.close()
    finally:
        peer.close()
