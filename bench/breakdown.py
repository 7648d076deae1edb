"""Where a request's time goes: host time spent inside each of a connector's calls.

``CallTimer`` wraps the vLLM-named methods of one connector instance (the reference engine's
``StoreConnector``) with ``perf_counter`` and sums each over a window, so a benchmark can
split a hit's time to first token into the connector's parts and what is left (compute,
launches, waiting for the device). Each call's start is kept, so the sums can stop at the
first token (`until`): work a connector defers to later steps (an asynchronous save's
Commit) is not part of the time to first token. The wrappers add little to a call;
nothing else changes.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable

__all__ = ["CALLS", "CallTimer"]

# vLLM's connector calls, in the order a step makes them, and what each stands for here.
CALLS: dict[str, str] = {
    "get_num_new_matched_tokens": "lookup",
    "update_state_after_alloc": "alloc",
    "build_connector_meta": "step meta",
    "bind_connector_metadata": "bind",       # hands the step's Reserve to its thread
    "start_load_kv": "acquire + launch load",
    "wait_for_layer_load": "layer waits",
    "save_kv_layer": "save layers",
    "wait_for_save": "save wait",
    "get_finished": "finished + release",
    "get_block_ids_with_load_errors": "load errors",
    "update_connector_output": "connector output",
    "request_finished": "request finished",
}


class CallTimer:
    """Sums the host seconds spent in ``names`` of ``obj`` until ``restore()``."""

    def __init__(self, obj: object, names: Iterable[str] = CALLS) -> None:
        self._obj = obj
        self._names = [n for n in names if hasattr(obj, n)]
        self.seconds = dict.fromkeys(self._names, 0.0)
        self.calls = dict.fromkeys(self._names, 0)
        self._spans: list[tuple[str, float, float]] = []   # (name, start, seconds)
        for name in self._names:
            setattr(obj, name, self._wrap(name, getattr(obj, name)))

    def _wrap(self, name: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                self.seconds[name] += dt
                self.calls[name] += 1
                self._spans.append((name, t0, dt))
        return timed

    def reset(self) -> None:
        for name in self._names:
            self.seconds[name], self.calls[name] = 0.0, 0
        self._spans.clear()

    def until(self, when: float) -> dict[str, float]:
        """Seconds in each call that started before `when` (a perf_counter reading)."""
        out = dict.fromkeys(self._names, 0.0)
        for name, start, dt in self._spans:
            if start < when:
                out[name] += dt
        return out

    def total(self) -> float:
        return sum(self.seconds.values())

    def restore(self) -> None:
        """Put the original methods back (the instance attributes shadowed the class's)."""
        for name in self._names:
            delattr(self._obj, name)

    def __enter__(self) -> CallTimer:
        return self

    def __exit__(self, *exc) -> None:
        self.restore()
