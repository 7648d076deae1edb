"""When a remote load is late: a deadline that follows from its bytes, the measured link
and the engine's own pace, moved on each time a layer lands.

A fixed bound (the client's timeout plus the bytes at 100 MB/s) failed loads of a few
pages in fair weather, under vLLM's AsyncScheduler on a 2-core host while the engine
computed: the receiving thread waits for the CPU and the GIL as the engine does, and
most of a second went by before a few KiB were in. A load the scheduler counted on then failed,
and under vLLM's default policy so did its request. So the rule is:

    budget(bytes) = SLACK * (timeout + bytes / rate + pace)

    rate  the slower of a prior (100 MB/s, as a gRPC Get is given) and the rate measured
          over this worker's finished loads of at least RATE_MIN_BYTES (a smaller load's
          time is latency, which `timeout` and `pace` cover), as busy as the host is
    pace  the engine's step interval measured between step boundaries (each sample at
          most PACE_CAP_S: an idle engine is not a slow one): a host that takes a second
          a step gives a receive as long

A load's deadline is its start plus budget(all its bytes), and each piece that lands moves
it to now + budget(the bytes still to come), never earlier. A piece any other load of the
worker lands counts too: loads wait for each other's slabs of the staging ring, and one
queued behind others is not stalled while they come. So a load is waited for however slow
while the worker's receives keep coming; when none has landed for a whole budget the store
has hung or the link is cut (a socket's own timeout in the client usually says so first)
and it fails.

Pure arithmetic over time.monotonic(); one Pace per worker, read by its loads' threads
(a float read or written whole is safe across threads).
"""

from __future__ import annotations

import time

__all__ = ["PACE_CAP_S", "PRIOR_BYTES_PER_S", "RATE_MIN_BYTES", "SLACK", "Pace"]

PRIOR_BYTES_PER_S = 100e6     # the slowest rate a budget assumes before (and above) a measure
RATE_MIN_BYTES = 4 << 20      # loads smaller than this measure latency, not the link
PACE_CAP_S = 5.0              # one step interval counts at most this much
SLACK = 4.0                   # a budget is this many times the expected time
_EWMA = 0.3                   # weight of a new sample


class Pace:
    """The measured link rate and engine step interval of one worker, and the budget
    they give a load's remaining bytes."""

    def __init__(self, timeout: float, prior: float = PRIOR_BYTES_PER_S) -> None:
        self.timeout = timeout
        self.rate = prior                  # bytes/s: min(prior, measured)
        self._prior = prior
        self._measured: float | None = None
        self.step_s = 0.0                  # the engine's step interval (EWMA)
        self._last_step: float | None = None
        self.progressed = float("-inf")    # when a load of the worker last landed a piece

    def step(self, now: float | None = None) -> None:
        """A step boundary of the engine (the worker's bind)."""
        now = time.monotonic() if now is None else now
        if self._last_step is not None:
            sample = min(PACE_CAP_S, max(0.0, now - self._last_step))
            self.step_s += _EWMA * (sample - self.step_s)
        self._last_step = now

    def finished(self, nbytes: int, seconds: float) -> None:
        """A load of nbytes received whole in seconds."""
        if nbytes < RATE_MIN_BYTES or seconds <= 0:
            return
        sample = nbytes / seconds
        self._measured = (sample if self._measured is None
                          else self._measured + _EWMA * (sample - self._measured))
        self.rate = min(self._prior, self._measured)

    def landed(self, now: float) -> None:
        """A load of the worker landed a piece at `now`."""
        self.progressed = max(self.progressed, now)

    def due(self, deadline: float, nbytes: int) -> float:
        """A load's deadline, nbytes still to come: its own, or later while the worker's
        other loads come."""
        return max(deadline, self.progressed + self.budget(nbytes))

    def budget(self, nbytes: int) -> float:
        """Seconds a load may go without landing its next layer, nbytes still to come."""
        return SLACK * (self.timeout + nbytes / self.rate + self.step_s)
