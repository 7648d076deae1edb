"""When the engine's scheduler is between steps: the time the connector's own threads call in.

An engine's loop alternates a scheduling step (vLLM's schedule(): the asks of new
requests, then the step's plan) and the work it plans (the forward pass, where the
scheduler's thread waits for the accelerator). The connector's background calls to the
store (session retention, the KV-event feed's polls) are off the loop's thread, but not
off its process or its store: run during a step they take the interpreter's lock and the
store's time from the step's lookups. So they wait, before each call, for the step under
way to end (its build), and run beside the work it planned:

    loop:    hit hit hit ... build ──────── forward ──────── hit hit ... build ───
    threads:                      RetainMany, Removals+Exists

With prefetched lookups, a step lasts until a build finds none pending: the lookup
worker's calls are the step's too. The wait is bounded (MAX_WAIT_S): a step that does not end soon (a long burst of
synchronous lookups, an engine that stopped asking) delays a call by at most that. The
loop's side is an attribute write per ask and, at a step's end, a notify only while a
thread is waiting.
"""

from __future__ import annotations

import threading

__all__ = ["MAX_WAIT_S", "StepGate"]

# How long a background call waits at most for a step to end: a vLLM step's scheduling
# takes a few ms; a burst of 64 synchronous lookups about 30.
MAX_WAIT_S = 0.05


class StepGate:
    """Whether the scheduler is inside a step; background threads wait for its end."""

    def __init__(self) -> None:
        self._stepping = False
        self._waiting = 0                   # threads in wait(), guarded by _cv
        self._cv = threading.Condition(threading.Lock())

    def begin(self) -> None:
        """The scheduler asks about a request: a step is under way (the loop's thread)."""
        self._stepping = True

    def end(self) -> None:
        """The step's plan is built: the engine runs it (the loop's thread)."""
        self._stepping = False
        # Read after the write above: a thread that counted itself in later sees the
        # step ended before it waits (under the GIL, in this order).
        if self._waiting:
            with self._cv:
                self._cv.notify_all()

    def wait(self, timeout: float = MAX_WAIT_S) -> bool:
        """Wait for the step under way to end, at most timeout s; True if none is."""
        if not self._stepping:
            return True
        with self._cv:
            self._waiting += 1
            try:
                return self._cv.wait_for(lambda: not self._stepping, timeout)
            finally:
                self._waiting -= 1
