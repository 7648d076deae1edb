"""A circuit breaker for a store that does not answer: stop asking it, probe it back off the step.

A lookup that times out costs the scheduler's step its whole timeout (0.5 s by default),
and a hung store (stopped, swapping, partitioned) times out every call: with ten waiting
requests every step would cost five seconds, and requests with nothing stored would wait
behind requests whose pages cannot be read. So the first call that finds the store not
answering opens the breaker; while it is open the store is not asked at all (the
connector answers "no hit", skips saves, fails loads at once so the engine recomputes).

The probe that closes it again never runs on the caller's thread: an engine's scheduler
step or forward must not wait for it. A background thread calls `probe()` every
`probe_interval` seconds while the breaker is open (a call like any other, with the
client's own timeout) and closes the breaker when one answers. So a hung store costs the
step that meets it at most one call's timeout, and every later step nothing (no call is
made) until a probe finds the store answering again.

    CLOSED --failed()--> OPEN --every probe_interval, on the probe thread: probe()
                           ^                                  |
                           +--------- no answer --------------+--- answered --> CLOSED

What "not answering" means is written once, below (`not_answering`), for every caller
of the store in the connector: the scheduler half's lookups, the worker half and SGLang's
backend. Each opens its breaker on such an error, and each probe keeps it open while the
probe's own call ends with one.

Thread-safe: the probe thread and the callers share the state under one lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc

from kvstore_client import KVStoreError

__all__ = ["NOT_ANSWERING", "Breaker", "not_answering"]

log = logging.getLogger(__name__)

# The codes after which the store counts as not answering: the caller opens its breaker
# (no hit, saves skipped, loads failed at once: the engine recomputes; one warning, never
# a failed request) and makes no call until a probe's call ends with none of them.
#   DEADLINE_EXCEEDED  no answer within the call's timeout: hung, swapping, partitioned.
#   UNAVAILABLE        no connection: stopped or restarting (the client has retried once).
#   UNKNOWN, INTERNAL  the call broke in the store or on the way (the server answers
#                      INTERNAL for its own unexpected errors; gRPC reports a stream cut
#                      mid-call as either). Nothing a caller can do about it, and the
#                      scheduler half must not raise it into the engine's step.
#   UNAUTHENTICATED,   the store serves none of this connector's calls until an operator
#   PERMISSION_DENIED  changes its token or the auth file (the server rereads it on
#                      SIGHUP; the probe then finds it answering).
# Any other code is the store answering this one call (NOT_FOUND: a page is gone;
# RESOURCE_EXHAUSTED: no room or quota now; FAILED_PRECONDITION, INVALID_ARGUMENT: this
# call's own lease, token or input): the caller treats it as that call's refusal, and the
# next call is made as usual.
NOT_ANSWERING = frozenset({
    grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
})


def not_answering(exc: BaseException) -> bool:
    """Whether a call's error means the store is not answering (NOT_ANSWERING)."""
    return isinstance(exc, KVStoreError) and exc.code in NOT_ANSWERING


class Breaker:
    """Whether to call the store now; `failed()`/`succeeded()` report each call's outcome.

    probe: a call to the store that returns True when the store answered (any answer,
    even an error status, means it is up); it runs only on the breaker's own thread.
    """

    def __init__(self, probe_interval: float, probe: Callable[[], bool]) -> None:
        self.probe_interval = probe_interval
        self._probe = probe
        self._lock = threading.Lock()      # guards _open and _thread
        self._open = False
        self._opened_at = float("-inf")    # monotonic time the breaker last opened
        self._thread: threading.Thread | None = None   # the probe thread while open
        self._closed = threading.Event()   # close(): the probe thread ends
        self.probes = 0                    # probes made so far (for tests and stats)

    @property
    def open(self) -> bool:
        return self._open

    def allow(self) -> bool:
        """True: make the call (the breaker is closed). Never probes on this thread."""
        return not self._open

    def failed(self) -> bool:
        """The call failed (timed out, unreachable); returns True when this opened it."""
        with self._lock:
            if self._open or self._closed.is_set():
                return False
            self._open = True
            self._opened_at = time.monotonic()
            if self._thread is None:
                self._thread = threading.Thread(target=self._probe_until_answered,
                                                name="kvstore-probe", daemon=True)
                self._thread.start()
            return True

    def succeeded(self, began: float | None = None) -> None:
        """The call answered. `began`: when it started (time.monotonic()). A call that
        started before the breaker last opened says nothing about the store now (it may
        have been answered just before the store stopped), so it does not close it: with
        several threads calling, such a late success reopened the way to a hung store
        and the next request's lookup waited a whole timeout again."""
        if began is not None and began < self._opened_at:
            return
        self._open = False

    def _probe_until_answered(self) -> None:
        while not self._closed.wait(self.probe_interval):
            with self._lock:
                if not self._open:         # a caller's own call succeeded meanwhile
                    self._thread = None
                    return
            self.probes += 1
            try:
                answered = self._probe()
            except Exception as exc:  # noqa: BLE001 - a probe that fails is "not yet"
                log.debug("kvstore probe failed: %s", exc)
                answered = False
            if answered:
                with self._lock:
                    self._open = False
                    self._thread = None    # under the lock: failed() starts a new one
                return
        with self._lock:
            self._thread = None

    def close(self) -> None:
        """Stop probing (the connector shuts down); the probe thread ends within one
        probe's timeout."""
        self._closed.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=0.1)
