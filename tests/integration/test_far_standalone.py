"""The far tier on one standalone server (--far-cluster auto finds it is not a cluster),
with a password from a file; a wrong password is misses and errors, never an exception."""

from __future__ import annotations

import os
import socket
import subprocess

import pytest

from kvstore_server.far.client import FarClient
from kvstore_server.far.settings import parse_far
from kvstore_testing.clusterproc import server_binaries
from tests.waiting import wait_for


@pytest.fixture(scope="module")
def standalone(tmp_path_factory):
    found = server_binaries()
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("CI must install redis-server (see .ci/run)")
        pytest.skip("needs valkey-server or redis-server on PATH")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = tmp_path_factory.mktemp("standalone")
    proc = subprocess.Popen([found[0], "--port", str(port), "--bind", "127.0.0.1",
                             "--dir", str(d), "--save", "", "--appendonly", "no",
                             "--requirepass", "s3cret"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def listening() -> bool:
            if proc.poll() is not None:
                raise RuntimeError("standalone server did not start")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            except OSError:
                return False
            return True
        wait_for(listening, "the standalone server to listen", timeout=20, interval=0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_standalone_with_a_password_file(standalone, tmp_path, mode):
    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    c = FarClient(parse_far(f"redis://127.0.0.1:{standalone}", cluster=mode,
                            password_file=str(secret), timeout=1.0))
    try:
        layout = os.urandom(16)
        pages = {os.urandom(16): os.urandom(100_000) for _ in range(10)}
        assert c.put(layout, list(pages.items())) == 10
        assert [bytes(p) for p in c.get(layout, list(pages))] == list(pages.values())
        read: dict[int, bytes] = {}             # in glide's reply (inplace.py)
        c.read(layout, list(pages), None, lambda i, p: read.setdefault(i, bytes(p)))
        assert [read[i] for i in range(10)] == list(pages.values())
        assert c.exists(layout, list(pages)) == [True] * 10
        assert c.clear(layout).removed == 10 and c.exists(layout, list(pages)) == [False] * 10
    finally:
        c.close()


def test_a_wrong_password_is_misses_not_exceptions(standalone):
    c = FarClient(parse_far(f"redis://:wrong@127.0.0.1:{standalone}", timeout=0.5))
    try:
        assert c.exists(os.urandom(16), [b"k"]) == [False]
        assert c.get(os.urandom(16), [b"k"]) == [None]
        read: list = []
        c.read(os.urandom(16), [b"k"], None, lambda i, p: read.append(p))
        assert read == [None]
        assert c.put(os.urandom(16), [(b"k", b"v")]) == 0
        # each call failed, or was not made once the breaker opened (after three)
        assert c.counters.errors >= 3 and c.counters.errors + c.counters.skipped >= 4
    finally:
        c.close()
