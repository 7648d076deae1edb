"""A circuit breaker for a store that does not answer: stop asking it, probe it back.

A lookup that times out costs the scheduler's step its whole timeout (0.5 s by default),
and a hung store (stopped, swapping, partitioned) times out every lookup: with ten waiting
requests every step would cost five seconds, and requests with nothing stored would wait
behind requests whose pages cannot be read. So the first failure opens the breaker: while
open, the store is not asked at all (the connector answers "no hit" at once); every
`probe_interval` seconds one call is let through as a probe, which closes the breaker
when it succeeds. The cost of a hung store is therefore at most one timeout when it hangs,
then at most one timeout per probe interval until it answers again.

    CLOSED --failure--> OPEN --probe_interval--> (one probe) --success--> CLOSED
                          ^                            |
                          +--------failure-------------+

A pure state machine over a clock (a seam for tests); not thread-safe.
"""

from __future__ import annotations

import time
from typing import Callable

__all__ = ["Breaker"]


class Breaker:
    """Whether to call the store now; `failed()`/`succeeded()` report each call's outcome."""

    def __init__(self, probe_interval: float, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.probe_interval = probe_interval
        self._clock = clock
        self._opened_at: float | None = None    # None: closed
        self._last_probe = 0.0                  # when the last probe was let through

    @property
    def open(self) -> bool:
        return self._opened_at is not None

    def allow(self) -> bool:
        """True: make the call (closed, or open and a probe is due)."""
        if self._opened_at is None:
            return True
        now = self._clock()
        if now - self._last_probe >= self.probe_interval:
            self._last_probe = now
            return True
        return False

    def failed(self) -> bool:
        """The call failed (timed out, unreachable); returns True when this opened it."""
        if self._opened_at is not None:
            return False
        self._opened_at = self._last_probe = self._clock()
        return True

    def succeeded(self) -> None:
        self._opened_at = None
