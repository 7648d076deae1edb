"""A saved run as it waits for the event feed's next poll: in forms the GC does not walk.

A finished request's run waits in the feed for up to one poll interval. Held as the
engine's lists (its token ids, block hashes and page keys), every waiting run keeps a few
thousand-item containers alive, and each garbage collection on the engine's loop walks
all of them, item by item: more survivors make collections more frequent, and each one
longer. So a run is queued as bytes and numpy arrays, which the GC does not track: its
keys and block hashes of one width back to back (joined and checked in C loops: about
10 us a request of 128 pages, on the loop as the request finishes), its
token ids as the int32 array the scheduler half already holds (connector.scheduler's
`stored_tokens`). What cannot be packed (hashes that are not bytes of one width, a list
of token ids) is kept as given. The poll thread unpacks the runs it announces from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

__all__ = ["PackedRun", "token_tuple"]


@dataclasses.dataclass(frozen=True, slots=True)
class PackedRun:
    """connector.events.SavedRun, packed (see the module's docstring); one object the GC
    tracks, where the run had four."""

    keys: Any                   # bytes of key_width each, joined; or the keys as given
    key_width: int              # 0: not joined
    hashes: Any                 # the same for the block hashes
    hash_width: int
    tokens: Sequence[int] | np.ndarray
    blocks_per_page: int
    page_tokens: int
    lora_name: str | None
    extra: Callable[[int, int], Sequence[tuple[Any, ...] | None]] | None

    @classmethod
    def of(cls, run: Any) -> PackedRun:
        """Pack a SavedRun (on the engine's loop: joins in C, no Python step per item)."""
        keys, key_width = _pack(run.keys)
        hashes, hash_width = _pack(run.hashes)
        return cls(keys, key_width, hashes, hash_width, run.tokens, run.blocks_per_page,
                   run.page_tokens, run.lora_name, run.extra)

    @property
    def tag(self) -> tuple[int, Hashable]:
        """How many pages and the last page's key: a key names its whole prefix."""
        w = self.key_width
        return _count(self.keys, w), (self.keys[-w:] if w else self.keys[-1])

    def same_keys(self, other: PackedRun) -> bool:
        return self.keys is other.keys or self.keys == other.keys

    def whole(self) -> int:
        """Its leading pages it can announce: those the engine has hashed."""
        return min(_count(self.keys, self.key_width),
                   _count(self.hashes, self.hash_width) // max(1, self.blocks_per_page),
                   len(self.tokens) // max(1, self.page_tokens))

    def key_list(self) -> Sequence[bytes]:
        return _items(self.keys, self.key_width)

    def hash_list(self) -> Sequence[Hashable]:
        return _items(self.hashes, self.hash_width)


def _pack(items: Sequence[Any]) -> tuple[Any, int]:
    """Bytes all of one width, joined, and the width; anything else as given, 0.

    Only what join takes and a dict can hold joins: bytes (bytearray and memoryview are
    not hashable, so never a key or a block hash). All of one width: the longest is the
    first's and the total is n times it, so none is shorter. C loops only: the loop pays
    a few microseconds a request."""
    if not items or type(items[0]) is not bytes:
        return items, 0
    width = len(items[0])
    try:
        joined = b"".join(items)
    except TypeError:
        return items, 0
    if not width or len(joined) != width * len(items) or max(map(len, items)) != width:
        return items, 0
    return joined, width


def _count(data: Any, width: int) -> int:
    return len(data) // width if width else len(data)


def _items(data: Any, width: int) -> Sequence[Any]:
    """What _pack took: equal bytes objects again, or the sequence itself."""
    if not width:
        return data
    return [data[i:i + width] for i in range(0, len(data), width)]


def token_tuple(tokens: Sequence[int] | np.ndarray, start: int, end: int) -> tuple[int, ...]:
    """tokens[start:end] as Python ints, whatever holds them."""
    part = tokens[start:end]
    if isinstance(part, np.ndarray):
        return tuple(part.tolist())
    return tuple(part)
