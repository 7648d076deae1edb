"""Waiting in tests: poll a condition until a deadline, never sleep a fixed time and hope."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["wait_for"]


def wait_for(predicate: Callable[[], object], what: str = "condition", *,
             timeout: float = 10.0, interval: float = 0.02) -> bool:
    """Call predicate every interval seconds until it is true, and return True; past
    timeout seconds, AssertionError naming what. (True, so `assert wait_for(...)` reads.)"""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
    return True
