"""Admission of Get and Put streams, so that a flood of them leaves threads for everything else.

Why. The sync gRPC server runs a stream on one handler thread for as long as it is open,
and a stream is as slow as its client: a Get whose reader stops, a Put whose writer
pauses, holds its thread until the watchdog's --stream-timeout. Thousands of concurrent
streams took every thread: the health check timed out and a well-behaved client's unary
Lookup waited seconds in gRPC's queue.

The rule. At most `limit` Get and Put streams run at once: the handler threads
(--workers) less a reserve of a quarter of them (at least one), which only unary calls,
the health check among them, can use. With an auth file a tenant may run at most half of
`limit` (at least one), so one tenant's flood leaves the others streams too; without one
every caller is the same tenant. A stream past a limit is refused at once with
RESOURCE_EXHAUSTED (the client retries later, or uses the shared-memory path, which
holds no thread), so it costs its thread a few hundred microseconds, not its lifetime.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Iterator

import grpc

__all__ = ["StreamGate", "gated_requests", "gated_stream", "tenant_share"]


def tenant_share(limit: int, per_tenant: bool) -> int:
    """What one tenant may hold of `limit` places: half (at least one) when there is more
    than one tenant (an auth file), else all. The fast path's connections use it too."""
    return max(1, limit // 2) if per_tenant else limit


class StreamGate:
    """Counts open streams, overall and per tenant; refuses those past the limits."""

    def __init__(self, workers: int, per_tenant: bool) -> None:
        """per_tenant: hold each tenant to half the limit (there is more than one)."""
        self.limit = max(1, workers - max(1, workers // 4))
        self.tenant_limit = tenant_share(self.limit, per_tenant)
        self._lock = threading.Lock()          # guards the counts
        self._open = 0
        self._by_tenant: collections.Counter[str] = collections.Counter()

    def open_streams(self) -> int:
        return self._open

    @contextlib.contextmanager
    def admit(self, tenant: str, what: str, context) -> Iterator[None]:
        """Hold a place while the stream runs, or abort the call (RESOURCE_EXHAUSTED)."""
        with self._lock:
            full = self._open >= self.limit
            mine = self._by_tenant[tenant] >= self.tenant_limit
            if not (full or mine):
                self._open += 1
                self._by_tenant[tenant] += 1
        if full or mine:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, (
                f"{what} refused: {self.limit} Get/Put streams are open, the most this server "
                "runs at once (a quarter of --workers stays free for other calls); retry "
                "later" if full else
                f"{what} refused: tenant {tenant!r} has {self.tenant_limit} Get/Put streams "
                "open, its share of this server's; retry later"))
        try:
            yield
        finally:
            with self._lock:
                self._open -= 1
                self._by_tenant[tenant] -= 1
                if not self._by_tenant[tenant]:
                    del self._by_tenant[tenant]


def gated_stream(gate: StreamGate, tenant: Callable[[object], str], handler: Callable,
                 what: str) -> Callable:
    """A server-streaming handler (request, context) -> iterator, admitted by the gate."""

    def run(request, context):
        with gate.admit(tenant(context), what, context):
            yield from handler(request, context)

    return run


def gated_requests(gate: StreamGate, tenant: Callable[[object], str], handler: Callable,
                   what: str) -> Callable:
    """A client-streaming handler (request_iterator, context) -> response, admitted."""

    def run(request_iterator, context):
        with gate.admit(tenant(context), what, context):
            return handler(request_iterator, context)

    return run
