"""The thread that sends a lease lane's held frames when no request comes to carry them.

A release not waited for (FastPath.release_later: a QUIET RELEASE, no answer) is held on
the lane's connection (Conn.hold) and goes in the one send of the lane's next request:
for a remote engine, a leased lookup and the release of the last one cost one system
call and one wake-up of the server between them. When no request follows, the pages
would stay pinned until one does; so the first frame held arms this thread, which sends
what is still held HOLD_S later and then sleeps until armed again. In steady use (a
release, then the next lookup within milliseconds) it wakes once per HOLD_S at most,
finds nothing held, and costs no system call per release.

    arm() (under the lane's lock) ─► wake ─► sleep HOLD_S ─► flush() ─► wait for arm()

The thread holds its owner weakly: a FastPath dropped without close() is not kept alive
by it, and the thread ends at its next look.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable

__all__ = ["HOLD_S", "Flusher"]

# Longest a held frame waits for a request to carry it. The kernel's own hold of a send
# flagged MSG_MORE, which did this before, lasted up to its probe timer (200 ms).
HOLD_S = 0.05
_IDLE_S = 5.0       # how often an unarmed thread looks whether its owner is gone


class Flusher:
    """Arms a daemon thread that calls flush HOLD_S after the first arm() since its
    last flush. flush takes the lane's lock itself and calls disarm() under it."""

    def __init__(self, flush: Callable[[], None]) -> None:
        """flush: a bound method, held weakly (its object owns this Flusher)."""
        self._flush = weakref.WeakMethod(flush)
        self._wake = threading.Event()
        self._armed = False          # guarded by the owner's lane lock
        self._thread: threading.Thread | None = None
        self._closed = False

    def arm(self) -> None:
        """A frame is held: flush within HOLD_S unless a request carries it first.
        Called under the owner's lane lock."""
        if self._armed or self._closed:
            return
        self._armed = True
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name="kvstore-fast-ahead")
            self._thread.start()
        self._wake.set()

    def disarm(self) -> None:
        """Called by flush under the lane's lock: the next held frame arms again."""
        self._armed = False

    def close(self) -> None:
        self._closed = True
        self._wake.set()

    def _run(self) -> None:
        while not self._closed:
            if not self._wake.wait(_IDLE_S):
                if self._flush() is None:
                    return                  # the owner is gone
                continue
            self._wake.clear()
            time.sleep(HOLD_S)
            flush = self._flush()
            if flush is None:
                return
            flush()
            del flush
