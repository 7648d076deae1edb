"""The far tier's breaker: opens after `threshold` failed calls in a row, lets one probe
through per interval, closes on its success; one log line per change."""

from __future__ import annotations

import logging

from kvstore_server.far.breaker import BreakerState, FarBreaker, ShardBreakers


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_open_probe_close(caplog):
    clock = Clock()
    b = FarBreaker(threshold=3, probe_interval=1.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="kvstore.far"):
        for _ in range(2):
            assert b.allow()
            b.record(False, "TimeoutError")
        assert b.state is BreakerState.CLOSED
        b.record(False, "TimeoutError")
        assert b.state is BreakerState.OPEN and not b.allow()
        for _ in range(5):                         # more failures: no more log lines
            b.record(False, "TimeoutError")
        clock.now += 1.0
        assert b.allow() and b.state is BreakerState.HALF_OPEN
        assert not b.allow()                       # one probe at a time
        b.record(False, "TimeoutError")            # failed probe: open again, quietly
        assert b.state is BreakerState.OPEN and not b.allow()
        clock.now += 1.0
        assert b.allow()
        b.record(True)
        assert b.state is BreakerState.CLOSED and b.allow()
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert len(lines) == 2, lines
    assert "breaker open" in lines[0] and "TimeoutError" in lines[0]
    assert "breaker closed" in lines[1]


def test_a_success_resets_the_count():
    b = FarBreaker(threshold=2, clock=Clock())
    b.record(False)
    b.record(True)
    b.record(False)
    assert b.state is BreakerState.CLOSED


def test_calls_in_flight_together_count_once():
    """Calls in flight when one master dies time out together: those that started before
    the streak's last counted failure ended add nothing, so they do not open the breaker;
    calls made after a failure (a cluster that stays down) do."""
    clock = Clock()
    b = FarBreaker(threshold=3, clock=clock)
    started = [b.now() for _ in range(5)]      # five calls out at once
    clock.now += 0.5                           # their deadline
    for t in started:
        b.record(False, "TimeoutError", t)
        clock.now += 0.001
    assert b.state is BreakerState.CLOSED and b.allow()
    b.record(True, "", b.now())                # the next call: the other shards answer
    for _ in range(2):                         # a cluster that stays down: one after another
        t = b.now()
        clock.now += 0.5
        b.record(False, "TimeoutError", t)
    assert b.state is BreakerState.CLOSED
    t = b.now()
    clock.now += 0.5
    b.record(False, "TimeoutError", t)         # the third in a row: open
    assert b.state is BreakerState.OPEN and not b.allow()


def test_a_master_s_breaker_holds_back_its_slots_only(caplog):
    clock = Clock()
    breakers = ShardBreakers(FarBreaker(threshold=2, probe_interval=1.0, clock=clock))
    a, b, c = ("10.0.0.1", 7000), ("10.0.0.2", 7000), ("10.0.0.3", 7000)
    breakers.masters([a, b, c])
    for address in (a, b, c):
        breakers.shard(address).record(True)
    with caplog.at_level(logging.INFO, logger="kvstore.far"):
        for _ in range(2):
            breakers.shard(a).record(False, "TimeoutError")
    assert not breakers.shard(a).allow() and breakers.shard(b).allow()
    assert breakers.open_shards() == (1, 3) and breakers.state is BreakerState.CLOSED
    assert "far tier shard 10.0.0.1:7000: breaker open" in caplog.text
    for address in (b, c):
        for _ in range(2):
            breakers.shard(address).record(False, "TimeoutError")
    assert breakers.state is BreakerState.OPEN and breakers.open_shards() == (3, 3)
    breakers.masters([a, b, ("10.0.0.4", 7000)])      # a replica took c's slots over
    assert breakers.open_shards() == (2, 3) and breakers.state is BreakerState.OPEN
    clock.now += 1.0
    assert breakers.shard(a).allow()                  # a's probe
    breakers.shard(a).record(True)
    assert breakers.state is BreakerState.CLOSED and breakers.open_shards() == (1, 3)
