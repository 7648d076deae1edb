"""The scheduler half's calls to the store: lookups that lease, lease releases, the breaker.

A store that does not answer costs the step that meets it at most one lookup_timeout;
then the breaker is open (connector.breaker) and nothing is asked of the store (no hit,
no wait, lease releases kept) until its background probe finds the store answering.
An error that means the store is not answering (connector.breaker.not_answering) gives
no hit, one warning a minute, never a failure of the request. Any other error is a
refusal the caller sees.

With tensor parallelism every rank has its own layout; a lookup asks over all of them in
one call, which answers the minimum, so ranks never disagree about what to load.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

import grpc

from kvstore_client import KVStoreClient, KVStoreError, LayoutHandle, PageLayout
from kvstore_client.results import Pins
from kvstore_protocol.keys import Packed

from ..breaker import Breaker, not_answering
from ..config import ConnectorConfig
from .prefetch import DOWN

__all__ = ["Counted", "StoreLookups"]

log = logging.getLogger(__name__)

_RELEASES_KEPT = 100_000      # lease releases waiting for a store that does not answer

@dataclasses.dataclass(frozen=True, slots=True)
class Counted:
    """A lookup's outcome."""

    count: int                  # leading pages present on every rank; DOWN: not answered
    lease_id: int = 0           # pins the counted pages; 0 = none
    timed_out: bool = False     # DOWN because the call ran out of time (maybe a stall)
    pins: Pins | None = None    # where the leased pages lie in the shared pool
    use_by: float = 0.0         # time.time() until which the pins may be used (meta.PagePins)


class StoreLookups:
    """Lookups and lease releases for the scheduler half, behind one breaker.

    Called from the scheduler's loop and the lookup worker (connector.scheduler.prefetch), at times
    both at once: the client's lease lane takes one call at a time. The breaker's probe,
    on its own thread, only registers the layouts again.
    """

    def __init__(self, config: ConnectorConfig, layouts: Sequence[PageLayout],
                 client: KVStoreClient) -> None:
        self.config = config
        self.layouts = list(layouts)
        self.client = client
        self._handles: list[LayoutHandle] | None = None   # registered on first use
        self._down_since = 0.0        # when the store was last found unreachable
        self.breaker = Breaker(config.probe_interval, self._probe)
        # lease id -> pages the workers read under it from the pool (no Acquire), said
        # at its release so the store counts them as served (connector.scheduler.unconfirmed)
        self._reads: dict[int, int] = {}

    def note_reads(self, reads: dict[int, int]) -> None:
        """Pages read under these leases, to say when each is released."""
        self._reads.update(reads)

    def handles(self) -> list[LayoutHandle]:
        if self._handles is None:
            self._handles = [self.client.register_layout(layout) for layout in self.layouts]
        return self._handles

    def lookup(self, keys: Packed) -> Counted:
        """Leading pages present (leased when lease_ms is set); DOWN, without a call,
        while the breaker is open. Raises KVStoreError for a refusal."""
        if not self.breaker.allow():
            return Counted(DOWN)
        began = time.monotonic()
        sent = time.time()
        try:
            if self.config.lease_ms:
                # Pins, for workers that map the pool: not with shared memory turned off.
                lease = self.client.lookup_lease(self.handles(), keys, self.config.lease_ms,
                                                 pins=self.config.shared_memory is not False)
                pins = lease.pins
                counted = Counted(lease.count, lease.lease_id, pins=pins,
                                  use_by=sent + pins.ttl_s / 2 if pins else 0.0)
            else:
                counted = Counted(self.client.lookup(self.handles(), keys))
        except KVStoreError as exc:
            if not not_answering(exc):
                raise
            self.down(exc)
            return Counted(DOWN, timed_out=exc.code == grpc.StatusCode.DEADLINE_EXCEEDED)
        # Lookups run on the loop's thread and on the prefetch thread: one answered just
        # before the store stopped must not close what the other's timeout opened.
        self.breaker.succeeded(began)
        return counted

    def release(self, lease_ids: list[int], *, wait: bool = False) -> list[int]:
        """Release leases; returns those kept for later (the store is not answering).
        wait: wait for each answer (the lookup worker's releases, see SchedulerHalf).

        Releases go only to a store that answers: one that hangs would cost every
        release its timeout. They wait while the breaker is open (its probe closes it);
        one never sent only costs its pages their pin until lease_ms runs out."""
        for dropped in lease_ids[:-_RELEASES_KEPT]:
            self._reads.pop(dropped, None)
        del lease_ids[:-_RELEASES_KEPT]
        # Nothing here acts on a release's answer (it only tells whether the lease was
        # still there), and on the loop waiting for it cost a round trip per lease: sent
        # without waiting (the fast path's quiet RELEASE where the server grants it). One
        # lost on the way only pins its pages until the server reaps the lease at
        # lease_ms. A lease's reads are forgotten once its release is sent, so a release
        # kept for later still says them.
        send = self.client.release_lease if wait else self.client.release_lease_later
        while lease_ids and self.breaker.allow():
            lease_id = lease_ids[-1]
            began = time.monotonic()
            try:
                send(lease_id, self._reads.get(lease_id, 0))
                if wait:
                    self.breaker.succeeded(began)
            except KVStoreError as exc:
                if not_answering(exc):
                    self.down(exc)
                    return lease_ids      # kept, for when the store answers again
                log.debug("releasing lease %d failed: %s", lease_id, exc)
            self._reads.pop(lease_id, None)
            lease_ids.pop()
        return lease_ids

    def down(self, exc: Exception) -> None:
        """The store did not answer a call: open the breaker (warn once a minute)."""
        now = time.monotonic()
        if self.breaker.failed() and now - self._down_since > 60:
            log.warning("kvstore at %s not answering (%s): serving without it, probing "
                        "every %.1f s", self.config.server, exc, self.config.probe_interval)
        self._down_since = now

    def _probe(self) -> bool:
        """The breaker's probe (on its own thread): does the store answer? Registering
        the layouts is idempotent, and after a restart it is what the store needs first."""
        try:
            self._handles = [self.client.register_layout(layout) for layout in self.layouts]
        except KVStoreError as exc:
            return not not_answering(exc)
        return True

    def close(self) -> None:
        self.breaker.close()
        self.client.close()
