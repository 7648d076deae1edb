"""One long-lived LookupStream call that a client sends its lookups over.

Why: a unary call's set-up and tear-down cost more than a 4,096-key lookup itself in
Python gRPC, so a lookup on an open stream is faster (kvstore_server/rpc/lookup_streams.py;
the README renders the store record's figures).

The stream is an optimisation, never a second set of semantics: `ask` returns None
whenever the stream cannot answer (another thread is using it, the server refuses or
lacks streams, the stream broke, the server ended it with an error), and the caller then
makes the unary Lookup, whose retries, re-registration and errors apply as always. The
one error `ask` raises itself is its deadline (DEADLINE_EXCEEDED, as a unary call's).

Deadlines: a message on a stream has none of its own, so a watcher thread, alive while
the stream is open, wakes every quarter of the timeout and cancels the stream when the
lookup in flight is past its deadline: a lookup fails at most timeout * 1.25 after it
started. The stream is then gone; the next lookup opens another.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import grpc

__all__ = ["LookupStream"]

_END = object()                 # ends the request iterator, so the call finishes
_REFUSED_SECONDS = 30.0         # after RESOURCE_EXHAUSTED, use unary calls this long


class DeadlineExceeded(grpc.RpcError):
    """A lookup on the stream outlived its timeout (the stream was cancelled)."""

    def __init__(self, timeout: float) -> None:
        super().__init__(f"lookup took longer than {timeout:.3g}s")
        self._timeout = timeout

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return f"lookup took longer than {self._timeout:.3g}s"


class _Call:
    """One open stream: its request queue, the call, and the watcher of its deadlines."""

    def __init__(self, open_call: Callable) -> None:
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.responses = open_call(iter(self.requests.get, _END))
        self.lock = threading.Condition()   # guards the fields below; wakes the watcher
        self.inflight: tuple[int, float] | None = None   # (lookup number, deadline)
        self.expired = -1                # the lookup number the watcher cancelled
        self.period = 1.0                # the watcher's wake-up: a quarter of the timeout
        self.closed = False
        threading.Thread(target=self._watch, name="kvstore-lookup-deadline",
                         daemon=True).start()

    def send(self, number: int, request, timeout: float) -> None:
        with self.lock:
            self.inflight = (number, time.monotonic() + timeout)
            if timeout / 4 < self.period:    # a shorter timeout than before: wake now
                self.period = max(timeout / 4, 0.001)
                self.lock.notify()
        self.requests.put(request)

    def answered(self) -> None:
        with self.lock:
            self.inflight = None

    def _watch(self) -> None:
        with self.lock:
            while not self.closed:
                self.lock.wait(self.period)
                if self.inflight is not None and time.monotonic() > self.inflight[1]:
                    self.expired = self.inflight[0]
                    self.responses.cancel()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.lock.notify()
        self.requests.put(_END)          # lets gRPC's request-reading thread finish
        self.responses.cancel()


class LookupStream:
    """Lookups over one stream; thread-safe (one lookup at a time uses the stream)."""

    def __init__(self, open_call: Callable) -> None:
        self._open_call = open_call      # request iterator -> response iterator
        self._lock = threading.Lock()    # held by the lookup using the stream
        self._call: _Call | None = None
        self._count = 0                  # lookups sent, to tell the watcher's target
        self._unary_until = 0.0          # monotonic time; before it, do not open one
        self.opened = 0                  # streams opened (for tests and debugging)

    def ask(self, request, timeout: float):
        """The response to request, or None: make the unary call instead."""
        if not self._lock.acquire(blocking=False):
            return None                  # in use by another thread: never wait for it
        try:
            if self._call is None:
                if time.monotonic() < self._unary_until:
                    return None
                self._call = _Call(self._open_call)
                self.opened += 1
            call = self._call
            self._count += 1
            number = self._count
            call.send(number, request, timeout)
            try:
                response = next(call.responses)
            except (grpc.RpcError, StopIteration) as exc:
                self._drop()
                if call.expired == number:
                    raise DeadlineExceeded(timeout) from None
                code = exc.code() if isinstance(exc, grpc.RpcError) else None
                if code == grpc.StatusCode.UNIMPLEMENTED:      # an older server
                    self._unary_until = float("inf")
                elif code == grpc.StatusCode.RESOURCE_EXHAUSTED:   # its stream limit
                    self._unary_until = time.monotonic() + _REFUSED_SECONDS
                return None
            call.answered()
            return response
        finally:
            self._lock.release()

    def _drop(self) -> None:
        if self._call is not None:
            self._call.close()
            self._call = None

    def close(self) -> None:
        with self._lock:
            self._drop()
