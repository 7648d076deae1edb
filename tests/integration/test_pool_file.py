"""Who can open the pool file, and so stop the server by truncating it (SECURITY.md, "The
shared-memory pool"). Truncating takes the pages from under the server's mapping and kills
it with SIGBUS; a tmpfs file cannot be sealed against that. What holds is the default:
only the server's user (who could kill it anyway) and root can open the file."""

from __future__ import annotations

import grp
import os
import pwd
import signal
import time

import numpy as np
import pytest

from kvstore_bench.serverproc import ServerProcess
from kvstore_client import KVStoreClient, PageLayout

LAYOUT = PageLayout(model="pool-file", num_layers=2, page_tokens=16, num_kv_heads=2,
                    head_size=64)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")


def as_user(user: str, group: str, action) -> str:
    """Run action() in a child process as user:group; what it raised (class name) or 'ok'."""
    uid, gid = pwd.getpwnam(user).pw_uid, grp.getgrnam(group).gr_gid
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                    # the child: never returns
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            try:
                action()
                result = "ok"
            except OSError as exc:
                result = type(exc).__name__
            os.write(w, result.encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        result = f.read()
    os.waitpid(pid, 0)
    return result


def put_one(srv: ServerProcess) -> str:
    """Put a page; return the pool file's path."""
    with KVStoreClient(srv.address, shared_memory=True) as c:
        ns = c.register_layout(LAYOUT)
        c.put(ns, [b"k" * 16], np.ones((1, LAYOUT.page_bytes), np.uint8))
        return c.region().path


def serves(srv: ServerProcess) -> bool:
    with KVStoreClient(srv.address, shared_memory=False) as c:
        ns = c.register_layout(LAYOUT)
        return bool(c.get(ns, [b"k" * 16]).all())


def test_another_user_cannot_open_the_pool_by_default():
    with ServerProcess(dram="64MiB") as srv:
        path = put_one(srv)
        assert as_user("nobody", "nogroup", lambda: os.open(path, os.O_RDWR)) == \
            "PermissionError"
        assert as_user("nobody", "nogroup", lambda: os.truncate(path, 0)) == \
            "PermissionError"
        assert serves(srv) and srv.proc.poll() is None


def test_shm_group_members_can_stop_the_server():
    """The documented gap: a member of --shm-group truncates the file, the server dies."""
    with ServerProcess(dram="64MiB", shm_group="nogroup") as srv:
        path = put_one(srv)
        assert as_user("nobody", "nogroup", lambda: os.truncate(path, 0)) == "ok"
        with pytest.raises(Exception):
            serves(srv)
        deadline = time.monotonic() + 10
        while srv.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.proc.returncode == -signal.SIGBUS
        os.unlink(path)                             # what the next server would remove
