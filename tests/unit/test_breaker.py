"""connector.breaker: stop asking a store that does not answer, probe it back."""

from connector.breaker import Breaker


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_closed_until_a_failure_then_one_probe_per_interval():
    clock = Clock()
    b = Breaker(2.0, clock)
    assert b.allow() and b.allow() and not b.open
    assert b.failed() is True and b.open
    assert not b.allow()                       # open: no calls
    clock.now += 1.9
    assert not b.allow()
    clock.now += 0.1
    assert b.allow()                           # the probe
    assert not b.allow()                       # one per interval
    assert b.failed() is False                 # already open: not "opened" again
    clock.now += 2.0
    assert b.allow()
    b.succeeded()
    assert not b.open and b.allow() and b.allow()
