"""Stop the server once the process that started it is gone, when that process asks.

A test run killed part-way (SIGKILL, a CI job's time limit) cannot stop the servers it
started: they keep their ports, their memory and their pool files until someone finds
them. A process that starts a server and wants it gone with itself sets
KVSTORE_EXIT_WITH_PARENT=1 in the server's environment (testing.serverproc does). The
server then looks at its parent every half second; once it has been handed to another
(its parent ended), it sends itself SIGTERM, so it stops the way an operator's SIGTERM
stops it: the pool file removed, the lasting tiers closed. Without the variable nothing
is watched: a daemon under systemd or a container runtime outlives whatever started it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

__all__ = ["ENV", "watch_parent"]

ENV = "KVSTORE_EXIT_WITH_PARENT"
_POLL_S = 0.5

log = logging.getLogger(__name__)


def watch_parent() -> None:
    """Start the watch if the environment asks for it (see the module docstring)."""
    if os.environ.get(ENV) != "1":
        return
    parent = os.getppid()

    def run() -> None:
        while os.getppid() == parent:
            time.sleep(_POLL_S)
        log.warning("the process that started this server (pid %d) has ended, and asked "
                    "for the server to end with it (%s=1): stopping", parent, ENV)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=run, name="parent-watch", daemon=True).start()
