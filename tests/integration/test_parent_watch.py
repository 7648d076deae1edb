"""A test server ends with the process that started it, even one killed before it could
stop the server (kvstore_server.parentwatch, set by testing.serverproc)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from tests.waiting import wait_for

# A process that starts a server the way the tests do (KVSTORE_STARTER_ENV, if set, is
# what it asks of the server instead), says where it is, then waits to be killed.
STARTER = textwrap.dedent("""
    import os, time
    from kvstore_testing.serverproc import ServerProcess
    ask = os.environ.get("KVSTORE_STARTER_ENV")      # unset: ServerProcess's default
    srv = ServerProcess(dram="64MiB",
                        env=None if ask is None else {"KVSTORE_EXIT_WITH_PARENT": ask}).start()
    print(srv.proc.pid, srv.port, flush=True)
    time.sleep(600)
""")


def running(pid: int) -> bool:
    """The process exists and has not ended (a zombie has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def start_and_kill(env: dict[str, str] | None = None) -> tuple[int, int]:
    """Start a server from a starter process, SIGKILL the starter: (server pid, port)."""
    starter = subprocess.Popen([sys.executable, "-c", STARTER], stdout=subprocess.PIPE,
                               text=True, env={**os.environ, **(env or {})})
    try:
        pid, port = map(int, starter.stdout.readline().split())
    finally:
        starter.kill()
        starter.wait()
    return pid, port


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_a_server_ends_with_its_killed_starter_and_frees_its_port():
    pid, port = start_and_kill()
    try:
        wait_for(lambda: not running(pid), timeout=20, what="the orphaned server to end")
        assert not listening(port)
    finally:
        if running(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_without_the_ask_a_server_outlives_its_starter():
    """A server started without KVSTORE_EXIT_WITH_PARENT=1 (a daemon) is not stopped."""
    pid, port = start_and_kill({"KVSTORE_STARTER_ENV": "0"})
    try:
        time.sleep(2.0)            # four of the watch's looks at its parent
        assert running(pid) and listening(port)
    finally:
        os.kill(pid, signal.SIGTERM)
