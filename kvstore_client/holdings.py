"""Which fast-path connection holds each lease, so that none is closed under another thread.

The server ends the leases a fast-path connection took when that connection closes
(docs/fastpath.md), and a client's lease lanes carry the leases of all its threads. A
lane whose call timed out is out of step and is not used again, and a fast path that
failed is dropped; closing their connections then ended every other thread's leases at
once, inside their ttl: a reader's acquired pages were reused under it (it read another
page's bytes, and nothing said so), and a writer's reserved slots went to another key,
whose committed page it then overwrote. So a connection that still holds leases is not
closed but retired: no call uses it again, and it is closed when its last lease ends
(ended on any connection of the client: the server ends a lease by its id) or when the
client closes; at most MAX_RETIRED are kept. A connection that broke has lost its leases
on the server already.

    took(conn, id) ─► held ─► ended(id) ─► (conn retired and holds none) ─► closed
                              let_go(conn): closed if it holds none, else retired
                              lost(conn): broke, its leases are gone: forgotten, closed

Thread-safe: one lock guards the table; one Holdings serves every FastPath a client
opens, so a lease taken before a fast path was dropped is ended through the next one.
"""

from __future__ import annotations

import contextlib
import logging
import threading

from .fastconn import Conn

__all__ = ["MAX_RETIRED", "Holdings"]

log = logging.getLogger(__name__)

# Retired connections kept at once. Each holds a thread of the server's (its connection
# limit is shared by every client), and a client that lets its leases run out instead of
# ending them would keep them all until it closes: past this many, the oldest is closed.
MAX_RETIRED = 8


class Holdings:
    """Lease id -> the connection that took it, and connections kept for their leases."""

    def __init__(self) -> None:
        self._lock = threading.Lock()        # guards everything below
        self._holder: dict[int, Conn] = {}   # lease id -> the connection that took it
        self._held: dict[Conn, set[int]] = {}  # connection -> the lease ids it holds
        # out of use, open while they hold leases; oldest first (a dict: insertion order)
        self._retired: dict[Conn, None] = {}

    def took(self, conn: Conn, lease_id: int) -> None:
        """conn's call took the lease: the server ends it when conn closes."""
        if lease_id:
            with self._lock:
                self._holder[lease_id] = conn
                self._held.setdefault(conn, set()).add(lease_id)

    def ended(self, lease_id: int) -> None:
        """The lease was ended (or an end was sent); a retired connection left holding
        nothing is closed."""
        with self._lock:
            conn = self._holder.pop(lease_id, None)
            if conn is None:
                return
            held = self._held.get(conn)
            if held is not None:
                held.discard(lease_id)
                if held:
                    return
                del self._held[conn]
            if conn not in self._retired:
                return
            del self._retired[conn]
        conn.close()

    def let_go(self, conn: Conn) -> None:
        """conn is not to be used again (out of step): closed, or kept while it holds
        leases. What it holds to send (a release, Conn.hold) is sent first."""
        with contextlib.suppress(OSError, ConnectionError):
            conn.send_held()
        oldest = None
        with self._lock:
            if self._held.get(conn):
                self._retired[conn] = None
                if len(self._retired) <= MAX_RETIRED:
                    return
                conn = oldest = next(iter(self._retired))
                del self._retired[conn]
                for lease_id in self._held.pop(conn, ()):
                    self._holder.pop(lease_id, None)
            else:
                self._held.pop(conn, None)
        if oldest is not None:
            log.warning("fast path: %d connections kept open for their leases; closing the "
                        "oldest, which ends the leases it still holds", MAX_RETIRED + 1)
        conn.close()

    def lost(self, conn: Conn) -> None:
        """conn broke: the server has ended its leases; forget them and close it."""
        with self._lock:
            for lease_id in self._held.pop(conn, ()):
                self._holder.pop(lease_id, None)
            self._retired.pop(conn, None)
        conn.close()

    def holds(self, conn: Conn) -> bool:
        with self._lock:
            return bool(self._held.get(conn))

    def close(self) -> None:
        """The client closes: every retired connection goes (their leases with them)."""
        with self._lock:
            retired, self._retired = list(self._retired), {}
            for conn in retired:
                for lease_id in self._held.pop(conn, ()):
                    self._holder.pop(lease_id, None)
        for conn in retired:
            conn.close()
