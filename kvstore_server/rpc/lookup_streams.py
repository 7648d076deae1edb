"""LookupStream: lookups over one long-lived call, admitted up to a limit, closed when idle.

Why it exists. A unary call in Python gRPC costs its set-up and tear-down on both ends,
more than a message on an open bidirectional stream, in wall time and in the server's
CPU; a Lookup of 4,096 keys with 1M pages stored is faster on a stream
(docs/perf/store-0e63aae249.json has both, side by side). The scheduler asks for every request it
sees, so the connector's client keeps one stream open (kvstore_client.lookup_stream).

What it costs, and the limits. The sync server runs a stream on one handler thread for
as long as it is open, so:
- streams get threads of their own: the server's pool is `workers + limit`, and at most
  `limit` streams are open at once (past it, RESOURCE_EXHAUSTED; the client then uses
  unary Lookup), so streams never take the threads that other calls need;
- a stream with no request for IDLE_SECONDS is cancelled (the client opens another when
  it next looks something up), so a forgotten client does not hold its thread for ever;
- a graceful stop cancels every stream first: an idle stream would otherwise hold the
  stop for its whole grace period.

Each request is answered exactly as Lookup answers it (the same handler, metrics under
"Lookup"); one that Lookup would refuse ends the stream with Lookup's status.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from .watchdog import StreamWatchdog

__all__ = ["IDLE_SECONDS", "LookupStreams"]

IDLE_SECONDS = 300.0


class LookupStreams:
    """The LookupStream handler. lookup: (request, context) -> response, raising or
    aborting the call as unary Lookup does. limit: open streams at once (0 = none)."""

    def __init__(self, limit: int, lookup: Callable, idle: float = IDLE_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self._lookup = lookup
        self._slots = threading.BoundedSemaphore(limit) if limit else None
        # Cancels idle streams, and all of them at stop; an idle stream is normal, so
        # its cancellation is logged at INFO, not as a stall.
        self.watchdog = StreamWatchdog(idle, clock, level=logging.INFO,
                                       reason="closed an idle lookup stream")

    def open_streams(self) -> int:
        return self.watchdog.open_streams()

    def handle(self, request_iterator, context) -> Iterator:
        if self._slots is None or not self._slots.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{self.limit} lookup streams are open, the most this server "
                          "takes (--lookup-streams); use Lookup")
        try:
            with self.watchdog.watch(context, "LookupStream") as w:
                for request in request_iterator:
                    w.progress()
                    yield self._lookup(request, context)
        finally:
            if self._slots is not None:
                self._slots.release()

    def start(self) -> None:
        self.watchdog.start()

    def stop(self) -> None:
        """Cancel every open stream (their clients fall back to Lookup) and stop watching."""
        self.watchdog.cancel_all()
        self.watchdog.stop()
