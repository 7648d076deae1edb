"""Admission of fast-path connections: a small budget before HELLO, a tenant's share after.

Why. Every connection holds a thread of the server's for as long as it is open. When
connections not yet authenticated shared `--data-connections` with everyone, 24 that
trickled their HELLO one byte a second made every new connection BUSY, a tenant with a
valid token among them; and when any tenant could hold every place, one tenant's 24 idle
connections did the same to another tenant's HELLO.

The rule.
- A connection not yet authenticated (TLS handshake and HELLO) holds a place of the
  hello budget, `--data-hello-connections` (64 by default), and never one of
  `--data-connections`. Past it, BUSY at once. Such a place is held for at most the
  HELLO deadline (connection.py), so an attacker who fills the budget must keep
  opening connections, and whoever gets a place authenticates within that deadline.
- A connection that authenticated moves to `--data-connections`, of which one tenant may
  hold the share gRPC gives a tenant of its streams (stream_gate.tenant_share: half, at
  least one, with an auth file; all without one, where every caller is one tenant).
  Past either limit, its HELLO is answered BUSY and the connection closed.
"""

from __future__ import annotations

import collections
import threading

from ..rpc.stream_gate import tenant_share

__all__ = ["Admission", "Ticket"]


class Ticket:
    """One connection's place: in the hello budget while `tenant` is None, else the
    tenant's."""

    __slots__ = ("tenant",)

    def __init__(self) -> None:
        self.tenant: str | None = None


class Admission:
    """Counts connections before and after HELLO, overall and per tenant."""

    def __init__(self, limit: int, hello_limit: int, per_tenant: bool) -> None:
        """limit: authenticated connections (--data-connections); hello_limit: connections
        not yet authenticated (--data-hello-connections); per_tenant: hold each tenant to
        its share of limit (there is more than one tenant)."""
        self.limit = limit
        self.hello_limit = hello_limit
        self.tenant_limit = tenant_share(limit, per_tenant)
        self._lock = threading.Lock()          # guards the counts below
        self._hello = 0                        # connections before or inside HELLO
        self._open = 0                         # authenticated connections
        self._by_tenant: collections.Counter[str] = collections.Counter()

    def counts(self) -> tuple[int, int]:
        """(connections not yet authenticated, authenticated connections)."""
        with self._lock:
            return self._hello, self._open

    def arrive(self) -> Ticket | None:
        """A place in the hello budget for a new connection; None when it is full."""
        with self._lock:
            if self._hello >= self.hello_limit:
                return None
            self._hello += 1
        return Ticket()

    def authenticate(self, ticket: Ticket, tenant: str) -> str | None:
        """Move the connection to its tenant's places; None when done, else why not (its
        hello place is kept until `leave`)."""
        with self._lock:
            if self._open >= self.limit:
                return (f"the server has {self.limit} fast-path connections open, its limit "
                        "(--data-connections): use gRPC or try again")
            if self._by_tenant[tenant] >= self.tenant_limit:
                return (f"tenant {tenant!r} has {self.tenant_limit} fast-path connections "
                        "open, its share of --data-connections: close one, use gRPC or "
                        "try again")
            self._hello -= 1
            self._open += 1
            self._by_tenant[tenant] += 1
            ticket.tenant = tenant
        return None

    def leave(self, ticket: Ticket) -> None:
        """The connection ended: its place is free."""
        with self._lock:
            tenant = ticket.tenant
            if tenant is None:
                self._hello -= 1
                return
            self._open -= 1
            self._by_tenant[tenant] -= 1
            if not self._by_tenant[tenant]:
                del self._by_tenant[tenant]
