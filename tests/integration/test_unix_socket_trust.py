"""Another local user against the fast path's Unix socket (SECURITY.md, "The Unix socket
and the pool"): it can neither stand in for the server after a restart nor keep the
server from starting.

Before, the socket was `<pool>.sock` in the pool's folder, which anyone may write: after
a graceful stop another user bound that name and received the tenant's token from every
client that reconnected (and answered their Acquires with offsets of its choosing); and a
folder made at the name while the pool was being allocated made start-up exit 78. The
second user is made here with useradd and removed after; its processes are this test's
children that drop to it with setuid (impostor.py)."""

from __future__ import annotations

import hashlib
import os
import pwd
import re
import secrets
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from kvstore_client import KVStoreClient, KVStoreError, PageLayout, attach, dataplane
from kvstore_client.unixpeer import ServerIdentity, UntrustedSocket, check_peer
from kvstore_testing.serverproc import ServerProcess, free_port_pair
from tests.waiting import wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="needs root to create a second local user and act as it")

LAYOUT = PageLayout(model="unix-trust", num_layers=2, page_tokens=16, num_kv_heads=2,
                    head_size=64)
TOKEN = "tok-trust-5f1e"
IMPOSTOR = Path(__file__).with_name("impostor.py")


@pytest.fixture(scope="module")
def stranger():
    """(uid, gid) of a local user made for this module, removed after it."""
    if shutil.which("useradd") is None or shutil.which("userdel") is None:
        pytest.skip("needs useradd and userdel to make a second local user")
    name = f"kvst{secrets.token_hex(3)}"
    subprocess.run(["useradd", "--no-create-home", "--user-group", "--shell",
                    "/usr/sbin/nologin", name], check=True, capture_output=True)
    try:
        pw = pwd.getpwnam(name)
        yield pw.pw_uid, pw.pw_gid
    finally:
        subprocess.run(["userdel", name], check=False, capture_output=True)


@pytest.fixture
def shared_dir():
    """A folder anyone may write, sticky, as /dev/shm is: the pool's folder here."""
    path = tempfile.mkdtemp(prefix="kvstore-trust-")
    os.chmod(path, 0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def auth_file(tmp_path):
    path = tmp_path / "auth.toml"
    path.write_text(f'[tenants.a]\ntoken_sha256 = "{hashlib.sha256(TOKEN.encode()).hexdigest()}"'
                    '\nshared_memory = true\n')
    return str(path)


class Impostor:
    """A process running as another user (impostor.py, which says what each command
    does): told a path, it binds a listening Unix socket there, answers HELLO with OK, as
    a server would, and writes every byte it receives to `received`."""

    def __init__(self, uid: int, gid: int, folder: str) -> None:
        self.received = os.path.join(folder, "impostor-received")
        self._proc = subprocess.Popen([sys.executable, str(IMPOSTOR), str(uid), str(gid),
                                       self.received], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, bufsize=1)

    def _send(self, command: str) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.write(command + "\n")
        self._proc.stdin.flush()

    def bind(self, path: str) -> str:
        """'ok', or the class name of the OSError that stopped the bind."""
        self._send(f"bind {path}")
        return self.answer()

    def block(self, shm_dir: str) -> None:
        """Watch shm_dir for a server's pool file and make a folder at `<pool>.sock` the
        moment it appears (what `answer()` then returns: the name made)."""
        self._send(f"block {shm_dir}")

    def presence(self, path: str) -> str:
        """Make a file at path that looks like a live server's presence map with every
        counter 0 (every key absent), its heartbeat kept fresh: 'ok' or the error's name."""
        self._send(f"presence {path}")
        return self.answer()

    def handout(self, path: str, size: int) -> str:
        """Bind a socket at path (making the folders on the way) that hands every caller
        a pool of this user's own, as a --shm-group server hands out its memfd: 'ok' or
        the error's name. Each caller is noted in `received`."""
        self._send(f"handout {size} {path}")
        return self.answer()

    def answer(self) -> str:
        assert self._proc.stdout is not None
        return self._proc.stdout.readline().strip()

    def got(self) -> bytes:
        try:
            with open(self.received, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return b""

    def close(self) -> None:
        self._proc.kill()
        self._proc.communicate()


@pytest.fixture
def impostor(stranger, shared_dir):
    imp = Impostor(*stranger, shared_dir)
    yield imp
    imp.close()


def unix_socket(srv: ServerProcess) -> str:
    wait_for(lambda: re.search(r"unix socket (\S+)", srv.log()), "the fast path's unix socket",
             timeout=30)
    return re.search(r"unix socket (\S+)", srv.log()).group(1)


def pages(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, LAYOUT.page_bytes), np.uint8)


def test_after_a_restart_no_token_goes_to_another_users_socket(impostor, shared_dir,
                                                               auth_file, monkeypatch):
    """The server stops; another user binds a socket at the name the client last used
    (before: `<pool>.sock`; now: the socket in the server's folder, which that user makes
    again once the server removed it). The client must send it nothing, not even a HELLO,
    and once a server is back it must use that server, with the right pages."""
    monkeypatch.setattr(dataplane, "RETRY_S", 0.2)      # back to the fast path sooner
    port = free_port_pair()
    keys = [f"trust-{i}".encode().ljust(16, b".") for i in range(16)]
    first = ServerProcess(dram="64MiB", port=port, shm_dir=shared_dir,
                          auth_file=auth_file).start()
    try:
        with KVStoreClient(first.address, token=TOKEN, shared_memory=True, retries=1,
                           timeout=3) as c:
            ns = c.register_layout(LAYOUT)
            old = pages(16, seed=1)
            c.put(ns, keys, old)
            assert np.array_equal(c.get(ns, keys), old)
            old_socket = c.fast_path().address
            assert old_socket == unix_socket(first)
            # While the server runs, its socket's folder is closed to the other user.
            if os.path.dirname(old_socket) != shared_dir:
                assert impostor.bind(os.path.join(os.path.dirname(old_socket),
                                                  "x.sock")) == "PermissionError"

            assert first.stop() == 0                    # graceful: the socket is removed
            assert not os.path.exists(old_socket)
            assert impostor.bind(old_socket) == "ok"
            for _ in range(3):                          # the server is down: errors, no hits
                with pytest.raises(KVStoreError):
                    c.get(ns, keys)
                time.sleep(0.3)
            assert impostor.got() == b"", "the client sent the impostor its HELLO (token)"

            with ServerProcess(dram="64MiB", port=port, shm_dir=shared_dir,
                               auth_file=auth_file) as second:
                new = pages(16, seed=2)

                def put() -> bool:        # gRPC's channel may still be in its backoff
                    try:
                        c.put(ns, keys, new)
                    except KVStoreError:
                        return False
                    return True
                wait_for(put, "a put to the restarted server", timeout=20, interval=0.2)
                assert np.array_equal(c.get(ns, keys), new)
                wait_for(lambda: c.fast_path() is not None, "the fast path again", timeout=10)
                assert c.fast_path().address == unix_socket(second)
                assert np.array_equal(c.get(ns, keys), new)
                assert c.lookup(ns, keys) == 16
            assert impostor.got() == b"", "the client sent the impostor its HELLO (token)"
            assert TOKEN.encode() not in impostor.got()
    finally:
        first.stop()


def test_after_a_restart_no_presence_map_is_read_from_another_users_file(
        impostor, shared_dir, monkeypatch):
    """The presence map answers misses without a call, so a map another user forged
    (every key absent, heartbeat fresh) at the old pool's name would make every lookup a
    miss. The client opens a map only at the path a fresh Attach names, and only a file
    of the server's uid: after the restart it counts the restarted server's pages."""
    monkeypatch.setattr(dataplane, "RETRY_S", 0.2)
    port = free_port_pair()
    keys = [f"presence-{i}".encode().ljust(16, b".") for i in range(8)]
    data = pages(8, seed=4)
    first = ServerProcess(dram="64MiB", port=port, shm_dir=shared_dir).start()
    try:
        with KVStoreClient(first.address, shared_memory=True, retries=1, timeout=3) as c:
            ns = c.register_layout(LAYOUT)
            c.put(ns, keys, data)                       # the pool mapped, no lookup yet
            old_pool = c.region().path
            assert first.stop() == 0
            assert impostor.presence(old_pool) == "ok"
            with ServerProcess(dram="64MiB", port=port, shm_dir=shared_dir) as second:
                with KVStoreClient(second.address, shared_memory=False) as other:
                    other.put(other.register_layout(LAYOUT), keys, data)

                def counted() -> bool:
                    try:
                        return c.lookup(ns, keys) == 8 and c.fast_path() is not None
                    except KVStoreError:
                        return False
                wait_for(counted, "lookups over the fast path again", timeout=20,
                         interval=0.2)
                for _ in range(20):                     # and they stay right
                    assert c.lookup(ns, keys) == 8
                assert c.presence_misses == 0
    finally:
        first.stop()


def test_the_kernel_says_who_listens(impostor, shared_dir):
    """SO_PEERCRED: a socket bound by another user is refused even where its name and
    folder would pass (the check that cannot be faked)."""
    path = os.path.join(shared_dir, "own", "s.sock")
    assert impostor.bind(path) == "ok"
    me = ServerIdentity(path, os.geteuid(), os.getegid(), os.getpid())
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        with pytest.raises(UntrustedSocket, match="runs as uid"):
            check_peer(s, path, me)
    assert impostor.got() == b""


def test_another_user_cannot_keep_the_server_from_starting(impostor, shared_dir):
    """The other user makes a folder at `<pool>.sock` the moment the pool's file appears
    (before, the socket's name: start-up exited 78, which systemd does not restart). The
    server starts and serves the fast path on its own socket."""
    impostor.block(shared_dir)
    srv = ServerProcess(dram="256MiB", shm_dir=shared_dir)
    try:
        srv.start(wait=60)                  # raises, with the log, if the server exited
        made = impostor.answer()
        assert made.endswith(".sock"), made
        assert os.path.isdir(os.path.join(shared_dir, made))
        path = unix_socket(srv)
        assert os.path.dirname(path) != shared_dir
        with KVStoreClient(srv.address, data_plane=True) as c:
            assert c.fast_path().address == path
            ns = c.register_layout(LAYOUT)
            data = pages(4, seed=3)
            keys = [f"start-{i}".encode().ljust(16, b".") for i in range(4)]
            c.put(ns, keys, data)
            assert np.array_equal(c.get(ns, keys), data)
    finally:
        code = srv.stop()
    assert code == 0


def test_no_pool_is_taken_from_another_users_hand_out_socket(impostor, shared_dir,
                                                             monkeypatch):
    """With --shm-group the pool is a memfd handed out by a Unix socket at the path Attach
    names. The server stops between the client's Attach and its connect (held open here
    by stopping it inside the client's own Attach step), and another user binds a socket
    at that path that hands out a pool of its own. Before, the socket lay in the pool's
    folder, which anyone may write, and the client mapped the other user's pool without
    asking who handed it over (its puts would have written the tenant's pages there). Now
    it lies in the server's private folder, and the client checks folder, socket and
    listener against Attach's uid and gid: it maps nothing and never connects."""
    srv = ServerProcess(dram="64MiB", shm_dir=shared_dir, shm_group="nogroup").start()
    real = attach.RegionAttachment._attach
    bound: list[str] = []

    def attach_then_stand_in(self):
        resp = real(self)
        if not bound:
            assert srv.stop() == 0                      # graceful: the socket is removed
            assert not os.path.exists(resp.path)
            bound.append(impostor.handout(resp.path, resp.size))
        return resp
    monkeypatch.setattr(attach.RegionAttachment, "_attach", attach_then_stand_in)
    try:
        with KVStoreClient(srv.address, shared_memory=True, data_plane=False, retries=1,
                           timeout=3) as c:
            with pytest.raises(KVStoreError, match="cannot be mapped") as err:
                c.region()
        assert bound == ["ok"]
        assert "uid" in str(err.value)
        assert impostor.got() == b"", "the client took a pool from another user's socket"
    finally:
        srv.stop()


def test_the_pool_is_handed_out_from_the_servers_own_folder(impostor, shared_dir):
    """Where the hand-out socket lives: in the server's folder (0750, the pool's group),
    where another user can make no name, and nothing of the pool's is left in the
    folder anyone may write; a client of the server maps the pool through it."""
    with ServerProcess(dram="64MiB", shm_dir=shared_dir, shm_group="nogroup") as srv:
        with KVStoreClient(srv.address, shared_memory=True) as c:
            path = c.region().path
            ns = c.register_layout(LAYOUT)
            keys = [f"handout-{i}".encode().ljust(16, b".") for i in range(4)]
            data = pages(4, seed=5)
            c.put(ns, keys, data)
            assert np.array_equal(c.get(ns, keys), data)
        folder = os.path.dirname(path)
        assert folder != shared_dir and os.path.dirname(folder) == shared_dir
        st = os.lstat(folder)
        assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o750
        assert impostor.bind(os.path.join(folder, "x.sock")) == "PermissionError"
        assert not [n for n in os.listdir(shared_dir) if not n.endswith(".d")]
    assert not os.path.exists(folder)
