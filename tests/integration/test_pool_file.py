"""Who can map the pool, and whether they can stop the server by shrinking it (SECURITY.md,
"The shared-memory pool"). Truncating a tmpfs pool file takes the pages from under the
server's mapping and kills it with SIGBUS. By default only the server's user (who could
kill it anyway) and root can open the file; with --shm-group, other users map a memfd
sealed against shrinking, handed out over a Unix socket in the server's own folder."""

from __future__ import annotations

import grp
import os
import pwd
import signal
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvstore_client import KVStoreClient, PageLayout
from kvstore_client.unixpeer import ServerIdentity
from kvstore_testing.serverproc import ServerProcess

LAYOUT = PageLayout(model="pool-file", num_layers=2, page_tokens=16, num_kv_heads=2,
                    head_size=64)

AS_USER = Path(__file__).with_name("pool_as_user.py")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")


def as_user(user: str, group: str, action: str, path: str,
            server: ServerIdentity | None = None) -> str:
    """Do action (pool_as_user.py names them) on the pool at path in a process of its own
    as user:group; the class name of the OSError it met, or 'ok'."""
    uid, gid = pwd.getpwnam(user).pw_uid, grp.getgrnam(group).gr_gid
    who = [] if server is None else [str(server.uid), str(server.gid), str(server.pid)]
    out = subprocess.run([sys.executable, str(AS_USER), str(uid), str(gid), action, path, *who],
                         capture_output=True, text=True, timeout=60)
    return out.stdout.strip()


def put_one(srv: ServerProcess) -> str:
    """Put a page; return the pool file's path."""
    with KVStoreClient(srv.address, shared_memory=True) as c:
        ns = c.register_layout(LAYOUT)
        c.put(ns, [b"k" * 16], np.ones((1, LAYOUT.page_bytes), np.uint8))
        return c.region().path


def identity(srv: ServerProcess, path: str) -> ServerIdentity:
    """Who the server is, as its Attach says, for a client's checks of the pool's path."""
    assert srv.proc is not None
    return ServerIdentity(path, os.geteuid(), os.getegid(), srv.proc.pid)


def serves(srv: ServerProcess) -> bool:
    with KVStoreClient(srv.address, shared_memory=False) as c:
        ns = c.register_layout(LAYOUT)
        return bool(c.get(ns, [b"k" * 16]).all())


def test_another_user_cannot_open_the_pool_by_default():
    with ServerProcess(dram="64MiB") as srv:
        path = put_one(srv)
        assert as_user("nobody", "nogroup", "open", path) == "PermissionError"
        assert as_user("nobody", "nogroup", "truncate", path) == "PermissionError"
        assert serves(srv) and srv.proc.poll() is None


def test_shm_group_member_maps_the_pool_but_cannot_shrink_it():
    """With --shm-group the path is a socket that hands out a sealed memfd: a member of
    the group (another user) maps and writes pages as before, but truncating the pool is
    refused and the server goes on. Before, the group could open the file itself and a
    truncation killed the server with SIGBUS."""
    with ServerProcess(dram="64MiB", shm_group="nogroup") as srv:
        path = put_one(srv)
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
        assert os.stat(path).st_gid == grp.getgrnam("nogroup").gr_gid

        server = identity(srv, path)
        # As a client maps it, then ftruncate: EPERM, the memfd is sealed.
        assert as_user("nobody", "nogroup", "shrink", path, server) == "PermissionError"
        assert as_user("nobody", "nogroup", "truncate", path) == "OSError"
        assert serves(srv) and srv.proc.poll() is None
    assert not os.path.exists(path)


def test_another_user_outside_the_group_cannot_connect():
    with ServerProcess(dram="64MiB", shm_group="nogroup") as srv:
        path = put_one(srv)
        server = identity(srv, path)
        assert as_user("nobody", "nogroup", "receive", path, server) == "ok"
        other = pwd.getpwnam("nobody")
        # The socket's folder is the pool's group's only (0750): not even its name is seen.
        assert as_user(other.pw_name, "daemon", "receive", path, server) == "PermissionError"
        assert serves(srv)


def test_socket_of_a_killed_server_is_removed_at_the_next_start(tmp_path):
    """The hand-out socket lies in the server's own folder (with the fast path's), which
    the next server removes when the one that made it was killed."""
    shm = str(tmp_path)
    srv = ServerProcess(dram="64MiB", shm_group="nogroup", shm_dir=shm).start()
    path = put_one(srv)
    folder = os.path.dirname(path)
    assert os.path.dirname(folder) == shm
    srv.stop(signal.SIGKILL)
    assert os.path.exists(path)                 # nobody left to remove it...
    with ServerProcess(dram="64MiB", shm_dir=shm) as again:
        assert not os.path.exists(folder)       # ...until the next server starts there
        assert "removed " + folder in again.log()


def test_odd_names_in_the_shm_dir_do_not_stop_a_start(tmp_path):
    """Anyone may write in /dev/shm. A FIFO under a pool's name blocked the start for
    ever in open(), a pid past any pid's range made os.kill raise OverflowError (the
    start failed: a crash loop under systemd), and a symlink must lead nowhere."""
    shm = tmp_path / "shm"
    shm.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    os.mkfifo(shm / "kvstore-4000000-deadbeef")
    (shm / "kvstore-99999999999999999999-deadbeef").write_bytes(b"")
    os.symlink(victim, shm / "kvstore-4000001-deadbeef")
    os.utime(shm / "kvstore-99999999999999999999-deadbeef", (0, 0))   # old: removable
    with ServerProcess(dram="64MiB", shm_dir=str(shm)).start(wait=30) as srv:
        put_one(srv)
        assert serves(srv)
    assert stat.S_ISFIFO(os.lstat(shm / "kvstore-4000000-deadbeef").st_mode)
    assert os.path.islink(shm / "kvstore-4000001-deadbeef")
    assert victim.read_bytes() == b"keep"
    assert not (shm / "kvstore-99999999999999999999-deadbeef").exists()


def test_shm_group_without_the_fast_paths_socket_still_hands_out_the_pool():
    """--data-socket false: the server makes its private folder for the pool's hand-out
    socket alone, and a client maps the pool through it."""
    with ServerProcess(dram="64MiB", shm_group="nogroup", data_socket="false") as srv:
        path = put_one(srv)
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]
        assert serves(srv)
    assert not os.path.exists(os.path.dirname(path))
