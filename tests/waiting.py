"""Waiting in tests: poll a condition until a deadline, never sleep a fixed time and hope."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["wait_for", "wait_value"]

T = TypeVar("T")


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


def wait_value(fetch: Callable[[], T], until: Callable[[T], object], what: str = "a value", *,
               timeout: float = 10.0, interval: float = 0.02) -> T:
    """Call fetch every interval seconds until until(its value) is true, and return that
    value; past timeout seconds, AssertionError naming what and the last value seen."""
    deadline = time.monotonic() + timeout
    while not until(value := fetch()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what} "
                                 f"(last: {value!r})")
        time.sleep(interval)
    return value
