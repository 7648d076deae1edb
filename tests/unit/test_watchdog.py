"""The stream watchdog with a clock the test advances and a stand-in for a call context."""

import logging

import grpc
import pytest

from kvstore_server.rpc.lookup_streams import IDLE_SECONDS, LookupStreams
from kvstore_server.rpc.watchdog import StreamWatchdog, watched_requests, watched_stream


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class Context:
    def __init__(self):
        self.cancelled = False

    def cancel(self):
        self.cancelled = True

    def peer(self):
        return "ipv4:127.0.0.1:1234"


def test_idle_streams_are_cancelled_moving_ones_are_not(caplog):
    clock = Clock()
    dog = StreamWatchdog(2.0, clock)
    idle, moving = Context(), Context()
    with dog.watch(idle, "Get of 8 keys"), dog.watch(moving, "Get of 9 keys") as w:
        for _ in range(5):                     # 5 s in all, progress every second
            clock.now += 1.0
            w.progress()
            dog.check()
        assert idle.cancelled and not moving.cancelled
        assert dog.cancelled == 1 and dog.open_streams() == 1
    assert dog.open_streams() == 0
    assert "Get of 8 keys from ipv4:127.0.0.1:1234" in caplog.text


def test_cancel_all_and_a_quieter_log(caplog):
    clock = Clock()
    dog = StreamWatchdog(300.0, clock, level=logging.INFO, reason="closed an idle stream")
    a, b = Context(), Context()
    with caplog.at_level(logging.INFO), dog.watch(a, "LookupStream"), \
            dog.watch(b, "LookupStream"):
        clock.now += 301
        assert dog.check() == 2
    assert "closed an idle stream: LookupStream from ipv4" in caplog.text
    assert all(r.levelno == logging.INFO for r in caplog.records)
    c = Context()
    with dog.watch(c, "LookupStream"):
        assert dog.cancel_all() == 1 and c.cancelled and dog.open_streams() == 0


class Aborted(Exception):
    pass


class AbortingContext(Context):
    def abort(self, code, message):
        self.code, self.message = code, message
        raise Aborted(message)


def test_lookup_streams_are_admitted_up_to_the_limit_and_closed_when_idle():
    clock = Clock()
    streams = LookupStreams(1, lambda request, context: request * 2, clock=clock)
    first, second = AbortingContext(), AbortingContext()
    answers = streams.handle(iter([1, 2, 3]), first)
    assert next(answers) == 2 and streams.open_streams() == 1
    with pytest.raises(Aborted, match="1 lookup streams are open"):
        next(streams.handle(iter([5]), second))
    assert second.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert list(answers) == [4, 6] and streams.open_streams() == 0
    idle = AbortingContext()
    answers = streams.handle(iter([7, 8]), idle)       # admitted again
    assert next(answers) == 14
    clock.now += IDLE_SECONDS + 1
    assert streams.watchdog.check() == 1 and idle.cancelled
    answers.close()
    stopped = AbortingContext()
    answers = streams.handle(iter([9]), stopped)
    assert next(answers) == 18
    streams.stop()                                     # a graceful stop cancels them all
    assert stopped.cancelled
    with pytest.raises(Aborted):
        next(LookupStreams(0, lambda r, c: r).handle(iter([1]), AbortingContext()))


def test_zero_timeout_watches_nothing():
    clock = Clock()
    dog = StreamWatchdog(0, clock)
    ctx = Context()
    with dog.watch(ctx, "Get"):
        clock.now += 1e6
        assert dog.check() == 0 and dog.open_streams() == 0
    assert not ctx.cancelled
    with pytest.raises(ValueError):
        StreamWatchdog(-1)


def test_wrapped_handlers_count_messages_as_progress_and_close_the_stream():
    clock = Clock()
    dog = StreamWatchdog(1.0, clock)
    closed = []

    def get(request, context):
        try:
            yield from range(3)
        finally:
            closed.append(request)

    ctx = Context()
    stream = watched_stream(dog, get, lambda req: f"Get {req}")("r1", ctx)
    assert next(stream) == 0
    clock.now += 0.9
    assert next(stream) == 1                   # progress: the deadline moved on
    clock.now += 0.9
    assert dog.check() == 0
    stream.close()                             # what gRPC does when the call ends early
    assert closed == ["r1"] and dog.open_streams() == 0

    def put(requests, context):
        return sum(requests)

    ctx = Context()
    assert watched_requests(dog, put, "Put")(iter([1, 2, 3]), ctx) == 6
    assert dog.open_streams() == 0 and not ctx.cancelled
