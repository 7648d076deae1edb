"""When to stop asking the far tier: the connector's breaker, shared by threads, logged.

There is one per master of the cluster and one for the cluster as a whole (ShardBreakers,
at the end): the client sends each master's commands apart, so a hung master stops only
its own slots being asked.

A dead or partitioned cluster costs every call its full `--far-timeout`; a lookup that
waits 50 ms for nothing on every step is worse than no far tier. So after `threshold`
calls in a row fail (a timeout, no connection, every command refused) the breaker opens:
calls answer "miss" at once without touching the network. Every `probe_interval`
seconds one call goes through as a probe (half-open); its success closes the breaker,
its failure keeps it open. One log line per change of state, nothing per call.

Calls that were in flight together count once: a failed call that started before the
streak's last counted failure ended adds nothing to it. Why: calls in flight when one
master dies can all time out whole, together (glide answers them at their deadline; the
calls after them get per-command errors for the dead shard and answers from the others).
Counted one each, three such calls opened the breaker, and every page of the live masters
missed until a probe closed it: 114 calls of one failover test run (most runs had no
whole failure, or two). A cluster that stays down fails the calls made after them too.

    CLOSED --threshold failures--> OPEN --probe_interval--> HALF_OPEN --ok--> CLOSED
                                     ^                          |
                                     +---------failure----------+

Unlike the connector's breaker (kvstore_connector.breaker), whose probe runs on a thread
of its own so that no engine step ever waits on it, the probe here is an ordinary call
let through: on the server a probe costs one call at most `--far-timeout` once per
interval, and the calls themselves show whether the cluster is back.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable

__all__ = ["BreakerState", "FarBreaker", "ShardBreakers"]

log = logging.getLogger("kvstore.far")


class BreakerState(enum.IntEnum):
    """Exported as the kvstore_far_breaker_state gauge."""

    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


class FarBreaker:
    """allow() before a call; record(ok) after it. Thread-safe."""

    def __init__(self, threshold: int = 3, probe_interval: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, name: str = "") -> None:
        self.name = name                        # in log lines: "" for the cluster, or a shard
        self.threshold = threshold
        self.probe_interval = probe_interval
        self._clock = clock
        self._lock = threading.Lock()           # guards the fields below
        self._open = False
        self._next_probe = 0.0                  # when open: clock time of the next probe
        self._failures = 0                      # calls failed in a row while closed
        self._counted_at = 0.0                  # clock time the last counted one ended
        self._probing = False                   # a probe is out (half-open)

    @property
    def state(self) -> BreakerState:
        with self._lock:
            if not self._open:
                return BreakerState.CLOSED
            return BreakerState.HALF_OPEN if self._probing else BreakerState.OPEN

    def allow(self) -> bool:
        with self._lock:
            if not self._open:
                return True
            if self._probing or self._clock() < self._next_probe:
                return False
            self._probing = True
        log.debug("far tier: breaker half-open, probing the cluster")
        return True

    def like(self, name: str) -> FarBreaker:
        """A new breaker with this one's settings and clock (one per shard)."""
        return FarBreaker(self.threshold, self.probe_interval, self._clock, name)

    def now(self) -> float:
        """The breaker's clock: what a call passes back to record() as `started`."""
        return self._clock()

    def record(self, ok: bool, why: str = "", started: float | None = None) -> None:
        """A call's outcome; `started`: now() when it began (None: counts alone)."""
        with self._lock:
            was_open, probing = self._open, self._probing
            self._probing = False
            opened = False
            if ok:
                self._failures = 0
                self._open = False
            else:
                now = self._clock()
                if not (self._failures and started is not None
                        and started < self._counted_at):
                    self._failures += 1
                    self._counted_at = now
                if was_open or self._failures >= self.threshold:
                    opened = not was_open
                    self._open = True
                    self._next_probe = now + self.probe_interval
        # Closed -> open and open -> closed are what an operator needs to see; a failed
        # probe (half-open -> open again, once per probe interval) only at DEBUG.
        where = f"far tier{' shard ' + self.name if self.name else ''}"
        if ok and was_open:
            log.warning("%s: breaker closed, the cluster answers again", where)
        elif not ok and opened:
            log.warning("%s: breaker open after %d failed calls (last: %s); misses "
                        "until a probe succeeds (every %.1fs)", where, self._failures,
                        why or "unknown", self.probe_interval)
        elif not ok and probing:
            log.debug("%s: probe failed (%s), breaker stays open", where, why or "unknown")


class ShardBreakers:
    """A breaker per master of the cluster, and one for the cluster as a whole.

    The far client sends each master's commands apart (shards.py), so a hung master must
    stop only its own slots being asked: `shard(address)` is that master's breaker. The
    cluster's own breaker (`allow`, `record`, `now`) guards what no shard answers for:
    learning the slot map, which a server started while the cluster is down cannot do.
    `state` is what the kvstore_far_breaker_state gauge and admin stats show: OPEN when
    the cluster's own is, or every master of the current map asked so far is open,
    HALF_OPEN while one such is probing, CLOSED while any is asked; `open_shards` says
    how many masters are held back."""

    def __init__(self, cluster: FarBreaker) -> None:
        self.cluster = cluster
        self._lock = threading.Lock()           # guards the two fields below
        self._shards: dict[tuple[str, int], FarBreaker] = {}
        self._current: tuple[tuple[str, int], ...] = ()     # masters of the current map

    def shard(self, address: tuple[str, int]) -> FarBreaker:
        with self._lock:
            breaker = self._shards.get(address)
            if breaker is None:
                breaker = self._shards[address] = self.cluster.like(f"{address[0]}:{address[1]}")
            return breaker

    def closed(self, address: tuple[str, int]) -> bool:
        """Whether a master is asked (one never asked is)."""
        with self._lock:
            breaker = self._shards.get(address)
        return breaker is None or breaker.state is BreakerState.CLOSED

    def masters(self, addresses) -> None:
        """The masters of the slot map now in use: the ones `state` speaks for."""
        with self._lock:
            self._current = tuple(addresses)

    def open_shards(self) -> tuple[int, int]:
        """(masters whose breaker is not closed, masters) of the current map."""
        with self._lock:
            current = [self._shards.get(a) for a in self._current]
        states = [b.state if b is not None else BreakerState.CLOSED for b in current]
        return sum(s is not BreakerState.CLOSED for s in states), len(states)

    @property
    def state(self) -> BreakerState:
        if self.cluster.state is not BreakerState.CLOSED:
            return self.cluster.state
        with self._lock:
            current = [self._shards.get(a) for a in self._current]
        states = [b.state for b in current if b is not None]     # masters asked so far
        if not states or BreakerState.CLOSED in states:
            return BreakerState.CLOSED
        return (BreakerState.HALF_OPEN if BreakerState.HALF_OPEN in states
                else BreakerState.OPEN)

    def allow(self) -> bool:
        return self.cluster.allow()

    def record(self, ok: bool, why: str = "", started: float | None = None) -> None:
        self.cluster.record(ok, why, started)

    def now(self) -> float:
        return self.cluster.now()
