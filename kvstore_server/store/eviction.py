"""Which pages to evict: the policy interface, and pure victim selection over it.

No lock, no I/O: the store (and the disk tier) call these under their own lock and apply
the result. A policy orders slot ids (LRU today, lru.py); the functions here decide how
many of its victims are enough, among which slots, for the three reasons to evict:

- allocation: a reserve needs slots of a size class (evict.Eviction.alloc);
- watermarks: the pool is past its high watermark, so the evictor thread evicts down to
  the low one, a batch a lock hold;
- a tenant's quota: quota_victims below;
- an admin: so many bytes, a layout's pages, or all.

A second policy is one new module that defines POLICY (a class whose instances have
EvictionPolicy's three methods), chosen by the server's eviction_policy setting: a name
is a module of this package ("lru"), a dotted name any importable module. Two faster
forms of touch are optional, used where a policy has them (StoreState.touch_few):
touch_few(ids: list[int]), and touch_span(first, n), the ids first + n - 1 down to first.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import numpy as np

__all__ = ["DEFAULT_POLICY", "EvictionPolicy", "PolicyFactory", "Sizes", "enough", "load_policy",
           "make_policy", "quota_victims"]

DEFAULT_POLICY = "lru"


@runtime_checkable
class EvictionPolicy(Protocol):
    """An order over small non-negative integer ids (slot ids). Pure data, not
    thread-safe; ids never touched may be removed, and may lie past what it has seen."""

    def touch(self, ids: np.ndarray) -> None:
        """Ids used now, in order (ids[-1] the most recent); adds ids not tracked yet."""
    def remove(self, ids: np.ndarray) -> None:
        """Stop tracking ids (freed or deleted)."""
    def victims(self, n: int, eligible: np.ndarray | None = None) -> np.ndarray:
        """Up to n tracked ids, first to evict first, among those where eligible[id] is
        True (a bool mask over ids; None = every tracked id)."""


PolicyFactory = Callable[[], EvictionPolicy]
Sizes = Callable[[np.ndarray], np.ndarray]      # bytes each of these ids frees


def load_policy(name: str) -> PolicyFactory:
    """The policy class a setting names; ValueError saying why if it names none."""
    # A module's dotted name and nothing else: a path (../x) made import_module raise
    # TypeError, which stopped the server's start with a traceback.
    if not name or not all(part.isidentifier() for part in name.split(".")):
        raise ValueError(f"eviction policy {name!r} is not a module name (lru, or a "
                         "dotted module path such as mypkg.policy)")
    module_name = name if "." in name else f"{__package__}.{name}"
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"no eviction policy {name!r}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the module's own code failed: say so
        raise ValueError(f"eviction policy {name!r}: importing {module_name} failed: "
                         f"{type(exc).__name__}: {exc}") from None
    factory = getattr(module, "POLICY", None)
    if not callable(factory):
        raise ValueError(f"eviction policy {name!r}: module {module_name} defines no POLICY "
                         "with touch, remove and victims")
    try:
        made = factory()
    except Exception as exc:  # noqa: BLE001 - as above
        raise ValueError(f"eviction policy {name!r}: {module_name}.POLICY() failed: "
                         f"{type(exc).__name__}: {exc}") from None
    if not isinstance(made, EvictionPolicy):
        raise ValueError(f"eviction policy {name!r}: module {module_name} defines no POLICY "
                         "with touch, remove and victims")
    return factory


def make_policy(policy: PolicyFactory | str | None = None) -> EvictionPolicy:
    """A new policy: from a factory, a setting's name, or None for DEFAULT_POLICY (read
    at call time, so a test suite may point every tier at another policy)."""
    if policy is None or isinstance(policy, str):
        policy = load_policy(policy or DEFAULT_POLICY)
    return policy()


def enough(sizes: np.ndarray, nbytes: int) -> int:
    """How many of the victims, whose sizes are given in eviction order, free at least
    nbytes (all of them if they cannot; 0 for nbytes <= 0)."""
    if nbytes <= 0:
        return 0
    return int(np.searchsorted(np.cumsum(sizes), nbytes)) + 1


def quota_victims(policy: EvictionPolicy, eligible: np.ndarray, sizes: Sizes,
                  smallest: int, over: int, target: int) -> np.ndarray | None:
    """Victims among eligible that free at least `over` bytes, and then whole pages up
    to `target`; None if all of them cannot free `over`. smallest: the smallest size."""
    # Enough victims even if every one is of the smallest page size.
    victims = policy.victims(-(-target // smallest), eligible)
    freed = np.cumsum(sizes(victims))
    if not freed.size or freed[-1] < over:
        return None
    # What it needs, then the whole pages that fit in the batch.
    count = max(int(np.searchsorted(freed, over)) + 1,
                int(np.searchsorted(freed, target, side="right")))
    return victims[:count]
