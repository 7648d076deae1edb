"""The stream watchdog: cancels a Get or Put stream that has made no progress for too long.

Why it exists. The sync gRPC server runs every call on a thread of one fixed pool (config
`workers`, 16). A Get whose reader stops reading blocks its thread inside the send once
HTTP/2 flow control is full, and keeps its pages pinned (a Get's lease lasts as long as
the stream); a Put whose writer stops sending blocks the same way on a receive and keeps
its slots reserved. Before this module existed, a reader that took one message of a Get
and stopped, with no deadline of its own, held its thread and its pages for as long as it
lived; with as many such readers as threads every other call, health checks included,
waited for a free thread (a Lookup with a deadline failed with DEADLINE_EXCEEDED). A client deadline does not help against a client
that sets none.

What it does. Each stream is watched from its first message to its end; each message
that moves (a Get chunk handed to the transport, a Put message received) pushes its
deadline `timeout` seconds ahead. One thread wakes every `timeout / 4` and cancels the
calls past their deadline (`context.cancel()`: the peer sees CANCELLED), logging a
warning with the peer and what the stream carried. The cancelled stream's generator then
ends and its `finally` gives the lease or the reservation back. Progress, not total time,
is what counts: a 40 GB Get to a slow remote reader is not cut off while it moves.

    watchdog = StreamWatchdog(30.0); watchdog.start()
    handler = watched_stream(watchdog, get_handler, describe)     # server-streaming
    handler = watched_requests(watchdog, put_handler, "Put")      # client-streaming
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

__all__ = ["StreamWatchdog", "Watch", "watched_requests", "watched_stream"]

log = logging.getLogger(__name__)


class Watch:
    """One stream under watch; `progress()` after every message it moves."""

    __slots__ = ("_clock", "_timeout", "context", "deadline", "what")

    def __init__(self, context, what: str, clock: Callable[[], float], timeout: float) -> None:
        self.context = context          # the call's grpc.ServicerContext: cancel(), peer()
        self.what = what                # for the log: "Get of 128 keys"
        self._clock = clock
        self._timeout = timeout
        self.deadline = clock() + timeout

    def progress(self) -> None:
        self.deadline = self._clock() + self._timeout


class StreamWatchdog:
    """Cancels watched streams idle for `timeout` seconds (0 = never: watch does nothing).

    clock: a seam for tests; `check()` runs one round without the thread. level, reason:
    how a cancellation is logged (a stall is a warning; an idle lookup stream is not)."""

    def __init__(self, timeout: float, clock: Callable[[], float] = time.monotonic,
                 level: int = logging.WARNING,
                 reason: str = "cancelled a stalled stream") -> None:
        if timeout < 0:
            raise ValueError(f"stream timeout must be >= 0, got {timeout}")
        self.timeout = timeout
        self.clock = clock
        self._level = level
        self._reason = reason
        self.cancelled = 0                      # streams cancelled since start
        self._lock = threading.Lock()           # guards _watches
        self._watches: set[Watch] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def watch(self, context, what: str) -> Iterator[Watch]:
        w = Watch(context, what, self.clock, self.timeout)
        if not self.timeout:
            yield w
            return
        with self._lock:
            self._watches.add(w)
        try:
            yield w
        finally:
            with self._lock:
                self._watches.discard(w)

    def check(self) -> int:
        """Cancel every watched stream past its deadline; returns how many."""
        now = self.clock()
        with self._lock:
            late = [w for w in self._watches if w.deadline <= now]
            self._watches.difference_update(late)
        for w in late:                  # outside the lock: cancel calls into gRPC
            log.log(self._level, "%s: %s from %s moved nothing for %.3gs", self._reason,
                    w.what, _peer(w.context), self.timeout)
            w.context.cancel()
        self.cancelled += len(late)
        return len(late)

    def cancel_all(self) -> int:
        """Cancel every watched stream now (a stop); returns how many."""
        with self._lock:
            watched = list(self._watches)
            self._watches.clear()
        for w in watched:
            w.context.cancel()
        return len(watched)

    def open_streams(self) -> int:
        with self._lock:
            return len(self._watches)

    def start(self) -> None:
        if not self.timeout or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="stream-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def _run(self) -> None:
        period = min(1.0, self.timeout / 4)
        while not self._stop.wait(period):
            try:
                self.check()
            except Exception:                   # the watchdog must outlive any one call
                log.exception("stream watchdog round failed")


def _peer(context) -> str:
    try:
        return context.peer()
    except Exception:  # noqa: BLE001 - only for the log line
        return "?"


def watched_stream(watchdog: StreamWatchdog, handler: Callable,
                   describe: Callable[[object], str]) -> Callable:
    """A server-streaming handler (request, context) -> iterator, watched: each response
    message handed to gRPC counts as progress."""

    def run(request, context):
        messages = handler(request, context)
        with watchdog.watch(context, describe(request)) as w:
            try:
                for message in messages:
                    yield message
                    w.progress()
            finally:
                messages.close()        # now, not at garbage collection: frees the lease

    return run


def watched_requests(watchdog: StreamWatchdog, handler: Callable, what: str) -> Callable:
    """A client-streaming handler (request_iterator, context) -> response, watched: each
    request message received counts as progress."""

    def run(request_iterator, context):
        with watchdog.watch(context, what) as w:
            def progressing():
                for message in request_iterator:
                    w.progress()
                    yield message
            return handler(progressing(), context)

    return run
