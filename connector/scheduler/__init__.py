"""The scheduler half: which pages each step loads and saves, from metadata alone.

It runs beside the engine's scheduler and never touches a tensor; its plan for a step
(meta.StepMeta) is what crosses to the workers. Its parts, one idea each:

    half          SchedulerHalf: the engine's scheduler calls, request by request, and
                  the step's plan
    requests      what is kept of one request: tokens, page keys, blocks and hit
    hashing       page keys: chained digests of a prompt's tokens, one per full page
    lookups       the calls to the store (lookups that lease, releases) behind the breaker
    prefetch      lookups on a background thread, so a burst costs the loop little
    unconfirmed   loads whose outcome is not known yet, and the leases they hold
    mamba         Mamba / linear-attention state as store pages
    retention     session retention a request asks for, on a thread of its own
    quiet         whether a step is under way: those threads call the store between steps
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["SchedulerHalf"]

if TYPE_CHECKING:
    from .half import SchedulerHalf


def __getattr__(name: str) -> Any:
    # Imported when first asked for, not with the package: a part (hashing, prefetch,
    # ...) is imported without what the half needs (torch, through mamba).
    if name == "SchedulerHalf":
        from .half import SchedulerHalf
        return SchedulerHalf
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
