"""Leases: which slots a client holds, until when. A pure table, not thread-safe.

A lease pins slots: the store never evicts or reuses a slot whose lease count is above
zero. Two kinds exist:
- READ leases (Lookup with a lease, Get, Acquire) pin READY pages while a client copies
  them out;
- RESERVE leases (Put, Reserve) own WRITING slots until Commit or Abort.
Every lease has an expiry, so a client that dies holding one leaks nothing: the store's
reaper asks `expired()` and undoes each one (a reservation's keys never become visible).
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
import math
import os
import struct
import time
from collections.abc import Callable

import numpy as np

__all__ = ["DEFAULT_LEASE_MEMORY", "FOREVER", "Lease", "LeaseKind", "LeaseTable", "footprint"]

Clock = Callable[[], float]  # seconds, monotonic; tests pass one they can advance

# The ttl of a lease its holder releases itself in a `finally` (a Put or Get stream in
# the server's process, a read-back): it never expires, since expiring it would let the
# slot be reused under a live copy.
FOREVER = math.inf

# Bytes of server memory the leases clients hold may take (the store's lease_memory).
# A leased Lookup of one stored key named 16,384 times (a 16 KiB request) keeps a
# 128 KiB slot array for the lease's life: one client grew a server by gigabytes in
# seconds so, with the pin counts on their way to overflowing. 256 MiB is ~30 million leased
# pages: a thousand requests in flight, each leasing 2,048 pages on 8 ranks, take 131 MiB.
DEFAULT_LEASE_MEMORY = 256 << 20


# What a live lease costs the server's memory, about (tracemalloc, CPython 3.11): 298
# bytes for the Lease with its dict and heap entries, 129 for a one-slot id array, then 8
# a slot; a reservation keeps its keys too, 58 bytes for a 16-byte key in a list, 106 at
# the longest (64 bytes).
_LEASE_BYTES = 450
_KEY_BYTES = 110


def footprint(slots: int, keys: int = 0) -> int:
    """Bytes of server memory a lease of `slots` slots and `keys` keys holds, about."""
    return _LEASE_BYTES + 8 * slots + _KEY_BYTES * keys


# Lease ids fetched from the CSPRNG at once (see LeaseTable._new_id).
_ID_BATCH = 256
_IDS = struct.Struct(f"<{_ID_BATCH}Q")


class LeaseKind(enum.Enum):
    READ = "read"
    RESERVE = "reserve"


@dataclasses.dataclass(slots=True)
class Lease:
    lease_id: int
    kind: LeaseKind
    slots: np.ndarray        # slot ids pinned by this lease
    expires_at: float
    layout: int = -1         # layout index, for RESERVE (its keys go with the slots)
    keys: list[bytes] = dataclasses.field(default_factory=list)
    # The tenant whose request took it: only the owner may commit, abort or release one
    # (lease_book.owns checks; "" in tests that do not care).
    owner: str = ""


class LeaseTable:
    """Live leases by id, with the earliest expiry found in O(log n), and the memory the
    ones clients hold take (`held`)."""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self.clock = clock
        self._leases: dict[int, Lease] = {}
        # footprint() of every lease that expires: those clients hold, which only the
        # store's lease_memory bounds (a stream's lease lives as long as its handler)
        self.held = 0
        self._expiry: list[tuple[float, int]] = []   # heap of (expires_at, lease_id)
        self._ids: list[int] = []                     # random ids not yet handed out

    def __len__(self) -> int:
        return len(self._leases)

    def grant(self, kind: LeaseKind, slots: np.ndarray, ttl: float, layout: int = -1,
              keys: list[bytes] | None = None, owner: str = "") -> Lease:
        lease = Lease(self._new_id(), kind, slots, self.clock() + ttl, layout, keys or [],
                      owner)
        self._leases[lease.lease_id] = lease
        self.held += self._held(lease)
        # A lease that never expires (a Put or Get stream's, released in a `finally`) has
        # no heap entry: one (inf, id) pushed per stream was never popped, 100 bytes a
        # stream for ever. Entries of leases released early wait for their expiry; when
        # they outnumber the live ones, the heap is rebuilt.
        if lease.expires_at != math.inf:
            heapq.heappush(self._expiry, (lease.expires_at, lease.lease_id))
            if len(self._expiry) > 2 * len(self._leases) + 1024:
                self._expiry = [(x.expires_at, x.lease_id) for x in self._leases.values()
                                if x.expires_at != math.inf]
                heapq.heapify(self._expiry)
        return lease

    # A lease's id is all that proves its holder: without an auth file every client is
    # one tenant. Ids were counted, and a client that took one lease could name its
    # neighbours: it aborted another client's reservation mid-write, so that the freed
    # slot went to a third client's page and the writer's bytes landed in it
    # (tests/integration/test_lease_ids.py). Random 63-bit ids cannot be guessed, and a
    # stale id of an earlier server process names nothing here. They come from the
    # system's CSPRNG _ID_BATCH at a time (os.urandom): one getrandom call a lease was a
    # system call on every Get, Put and leased Lookup, and a batch held in this process
    # is as unguessable as one fetched per id (nothing outside the server reads it).
    def _new_id(self) -> int:
        while True:
            if not self._ids:
                self._ids = list(_IDS.unpack(os.urandom(_IDS.size)))
            lease_id = self._ids.pop() >> 1
            if lease_id and lease_id not in self._leases:
                return lease_id

    def get(self, lease_id: int) -> Lease | None:
        return self._leases.get(lease_id)

    def pop(self, lease_id: int) -> Lease | None:
        """Remove and return the lease (None if unknown or already gone)."""
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            self.held -= self._held(lease)
        return lease

    @staticmethod
    def _held(lease: Lease) -> int:
        """What the lease counts in `held`: 0 for one that never expires."""
        if lease.expires_at == math.inf:
            return 0
        return footprint(len(lease.slots), len(lease.keys))

    def expired(self) -> list[Lease]:
        """Remove and return every lease whose expiry has passed."""
        now = self.clock()
        out = []
        while self._expiry and self._expiry[0][0] <= now:
            _, lease_id = heapq.heappop(self._expiry)
            lease = self._leases.get(lease_id)
            if lease is not None and lease.expires_at <= now:
                self.pop(lease_id)
                out.append(lease)
        return out

    def take_breakable(self) -> list[Lease]:
        """Remove and return every lease a client holds: all but those that never expire,
        which a Put or Get in this process holds and ends itself (ending one early would
        let its slots be reused under the copy still running)."""
        out = [lease for lease in self._leases.values() if lease.expires_at != math.inf]
        for lease in out:
            self.pop(lease.lease_id)
        return out

