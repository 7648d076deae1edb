"""Bounds on one request, checked before any work or memory proportional to it.

Why. Nothing but the 64 MiB message limit bounded a request: a Get naming one stored key
60 million times (a 57 MiB request) grew the server by gigabytes of RSS in the per-key
arrays and lists built for it, and a Lookup of 60 M keys held the store's lock for
seconds (with the limits, clients sending requests at them: the longest hold and the
server's RSS in docs/perf/limits-3f4ad95abf.json). Every per-key structure the server
builds is proportional to the keys named, so one cap on keys bounds them all, and a
smaller message limit bounds what gRPC itself buffers before a handler can look.

The limits (SECURITY.md and README's settings table state them too):
- keys per request (Lookup, Exists, Get, Put, Delete, Reserve, Acquire, and each message
  of a LookupStream): `max_keys_per_request`, 16,384 by default, a 256k-token prompt at
  16 tokens a page. Past it: INVALID_ARGUMENT, before the keys are even copied. Why not
  more: the work under the store's lock that a request's keys cost (a dict entry a key
  for a put's reserve and commit) is what bounds the lock's longest hold: at 65,536 keys
  a commit held it hundreds of milliseconds on a loaded 2-core machine, at 16,384 tens
  (kvstore-bench limits, docs/perf/limits-3f4ad95abf.json: 62.6 ms the longest hold).
- bytes of one request message: request_message_bytes(max_keys), 8 MiB by default (the
  keys at their longest, 64 bytes, fill 1 MiB); Put's data messages are 1 MiB.
  Past it gRPC answers RESOURCE_EXHAUSTED before a handler runs.
- bytes of one Get's response: at most the pool's capacity. A Get may name a key more
  than once and each is sent, but the distinct pages of one Get always fit the pool, so
  only repeats can go past it: RESOURCE_EXHAUSTED, before anything is pinned.
- layouts per Lookup: 256 (kvstore_protocol.layout.MAX_LOOKUP_LAYOUTS), and layouts x
  keys at most 4 x max_keys_per_request (65,536 by default: 8 tensor-parallel ranks of 8,192 keys),
  since each layout is one more pass over the keys, under the lock: INVALID_ARGUMENT.

With these, one request's memory on the server is its message (up to 8 MiB, held twice
while parsed) plus about 100 bytes a key (1.6 MiB at 16,384 keys): under 20 MiB, whatever
it names; bench/limits_bench.py measures it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvstore_protocol.keys import MAX_KEY_BYTES, Packed

from ..errors import Outcome, StoreError

__all__ = ["DEFAULT_MAX_KEYS", "MAX_KEYS_LIMIT", "MAX_RETAIN_SESSIONS", "RequestLimits",
           "request_message_bytes"]

DEFAULT_MAX_KEYS = 16_384
# The most max_keys may be set to: 64 times the default, a 4M-token prompt; a commit of
# that many keys would hold the store's lock for seconds.
MAX_KEYS_LIMIT = 1 << 20
LOOKUP_FACTOR = 4           # layouts x keys of one Lookup, in units of max_keys
MAX_RETAIN_SESSIONS = 1024  # sessions one RetainMany may name


def request_message_bytes(max_keys: int) -> int:
    """The largest request message the server takes: max_keys keys of the longest size,
    plus 1 MiB for the rest of the message; never under 8 MiB (Put's 1 MiB chunks)."""
    return max(8 << 20, max_keys * MAX_KEY_BYTES + (1 << 20))


@dataclasses.dataclass(frozen=True, slots=True)
class RequestLimits:
    """What one request may ask for (see the module docstring)."""

    max_keys: int = DEFAULT_MAX_KEYS

    def __post_init__(self) -> None:
        if self.max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {self.max_keys}")

    def checked_keys(self, data: bytes, key_size: int, method: str) -> Packed:
        """The request's packed keys, refused (INVALID) past max_keys before any copy."""
        n = len(data) // key_size if key_size > 0 else 0
        if n > self.max_keys:
            raise StoreError(Outcome.INVALID, (
                f"{method} names {n} keys; at most {self.max_keys} per request "
                "(--max-keys-per-request): split it"))
        return Packed(data, key_size)

    def lookup(self, n_layouts: int, n_keys: int) -> None:
        """Refuse (INVALID) a Lookup whose layouts x keys pass 4 x max_keys."""
        if n_layouts * n_keys > LOOKUP_FACTOR * self.max_keys:
            raise StoreError(Outcome.INVALID, (
                f"Lookup of {n_keys} keys in {n_layouts} layouts: layouts x keys may be at "
                f"most {LOOKUP_FACTOR * self.max_keys} (4 x --max-keys-per-request)"))

    def retain_many(self, n_keys: int, indexes: list[np.ndarray]) -> None:
        """Refuse (INVALID) a RetainMany of more than MAX_RETAIN_SESSIONS sessions, of
        more than 4 x max_keys key indexes in all, or naming a key it does not send."""
        if len(indexes) > MAX_RETAIN_SESSIONS:
            raise StoreError(Outcome.INVALID, f"RetainMany names {len(indexes)} sessions; "
                                              f"at most {MAX_RETAIN_SESSIONS}: split it")
        total = sum(len(idx) for idx in indexes)
        if total > LOOKUP_FACTOR * self.max_keys:
            raise StoreError(Outcome.INVALID, (
                f"RetainMany's sessions name {total} keys in all; at most "
                f"{LOOKUP_FACTOR * self.max_keys} (4 x --max-keys-per-request): split it"))
        if any(idx.size and int(idx.max()) >= n_keys for idx in indexes):
            raise StoreError(Outcome.INVALID, f"RetainMany: a session names a key index "
                                              f"past the {n_keys} keys sent")

    @staticmethod
    def get_bytes(n_keys: int, page_bytes: int, pool_bytes: int) -> None:
        """Refuse (EXHAUSTED) a Get whose response would be more than the pool holds."""
        if n_keys * page_bytes > pool_bytes:
            raise StoreError(Outcome.EXHAUSTED, (
                f"Get of {n_keys} pages of {page_bytes} bytes would send "
                f"{n_keys * page_bytes} bytes, more than the pool holds ({pool_bytes}); "
                "a key named more than once is sent each time: ask for fewer"))
