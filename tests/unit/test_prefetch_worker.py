"""connector.scheduler.prefetch.LookupWorker: every lease an answer carries is taken or
released once.

The worker's lookup and release calls are the seams here (the store behind them is
tests/integration/test_prefetch.py's): a lookup that hands out numbered leases and can be
held on an event, and a release that records what it was given.
"""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import pytest

from kvstore_connector.scheduler.prefetch import Answer, Job, LookupWorker
from tests.waiting import wait_for


class Store:
    """Leases 1, 2, 3 ... one per lookup; `gate` holds lookups until set."""

    def __init__(self) -> None:
        self.ids = itertools.count(1)
        self.released: list[int] = []
        self.refused: list[int] = []    # releases offered while down
        self.gate = threading.Event()
        self.gate.set()
        self.down = False           # releases are kept, as for a store not answering

    def lookup(self, job: Job) -> Answer:
        self.gate.wait(5)
        if job.req_id == "bad":
            raise ValueError("refused")
        return Answer(np.asarray(job.tokens, np.int32), (), b"", job.pages, next(self.ids))

    def release(self, lease_ids: list[int]) -> list[int]:
        if self.down:
            self.refused += lease_ids
            return list(lease_ids)
        self.released += lease_ids
        return []


def job(req_id: str = "r", pages: int = 3) -> Job:
    return Job(req_id, list(range(pages * 16 + 1)), pages, (), b"")


def wait_until(cond, timeout: float = 5.0) -> bool:
    return wait_for(cond, "the worker's thread", timeout=timeout, interval=0.001)


@pytest.fixture
def store():
    return Store()


@pytest.fixture
def worker(store):
    w = LookupWorker(store.lookup, store.release)
    yield w
    w.close(1.0)


def test_an_answer_carries_its_lease_and_the_converted_tokens(store, worker):
    pending = worker.submit(job(pages=3))
    assert pending.done.wait(5)
    assert pending.answer.count == 3 and pending.answer.lease_id == 1
    assert pending.answer.tokens.dtype == np.int32
    assert store.released == []                       # taken by the caller, not released


def test_abandoned_after_the_answer_came_releases_its_lease(store, worker):
    pending = worker.submit(job())
    assert pending.done.wait(5)
    worker.abandon(pending)
    worker.abandon(pending)                           # twice: released once
    assert wait_until(lambda: store.released == [1])


def test_abandoned_while_in_flight_releases_the_lease_when_it_comes(store, worker):
    store.gate.clear()
    pending = worker.submit(job())
    assert wait_until(lambda: worker.stalled(0.0))    # the lookup is in flight
    worker.abandon(pending)
    store.gate.set()
    assert pending.done.wait(5)
    assert pending.answer is None                     # never handed over
    assert wait_until(lambda: store.released == [1])


def test_abandoned_before_it_ran_is_never_looked_up(store, worker):
    store.gate.clear()
    first = worker.submit(job("a"))
    assert wait_until(lambda: worker.stalled(0.0))
    second = worker.submit(job("b"))
    worker.abandon(second)
    store.gate.set()
    assert first.done.wait(5) and second.done.wait(5)
    assert worker.looked_up == 1 and second.answer is None


def test_stalled_says_whether_the_call_in_flight_is_older_than_asked(store, worker):
    assert not worker.stalled(0.0)                    # nothing in flight
    store.gate.clear()
    pending = worker.submit(job())
    assert wait_until(lambda: worker.stalled(0.0))
    assert not worker.stalled(60.0)
    store.gate.set()
    assert pending.done.wait(5)
    assert wait_until(lambda: not worker.stalled(0.0))


def test_a_refusal_reaches_the_caller_as_the_answers_error(worker):
    pending = worker.submit(job("bad"))
    assert pending.done.wait(5)
    assert isinstance(pending.answer.error, ValueError)


def test_releases_a_store_did_not_take_are_kept_and_sent_later(store, worker):
    store.down = True
    worker.release([7, 8])
    assert wait_until(lambda: store.refused == [7, 8])
    assert store.released == []
    store.down = False
    worker.submit(job())                              # new work: the kept ones go first
    assert wait_until(lambda: sorted(store.released) == [7, 8])


def test_a_job_submitted_while_a_release_fails_is_looked_up_at_once():
    """A release that hangs and then fails (the store stopped) while a job arrives: the
    job is looked up when the release returns, not after the worker's idle wait."""
    in_release, finish = threading.Event(), threading.Event()
    answered = []

    def release(lease_ids):
        in_release.set()
        finish.wait(5)
        return list(lease_ids)                      # kept: the store is not answering

    def lookup(job):
        answered.append(time.monotonic())
        return Answer(np.asarray(job.tokens, np.int32), (), b"", 0, 0)

    worker = LookupWorker(lookup, release)
    try:
        worker.release([3])
        assert in_release.wait(5)
        pending = worker.submit(job())              # notified while nobody waits
        finish.set()
        returned = time.monotonic()
        assert pending.done.wait(5)
        assert answered[0] - returned < 0.5         # the idle wait is a second
    finally:
        worker.close(1.0)


def test_close_returns_every_lease_not_yet_released(store):
    worker = LookupWorker(store.lookup, store.release)
    pending = worker.submit(job())
    assert pending.done.wait(5)
    store.down = True
    worker.abandon(pending)                           # lease 1: the store keeps refusing
    worker.release([5])
    assert wait_until(lambda: {1, 5} <= set(store.refused))    # tried, and kept
    assert sorted(worker.close(1.0)) == [1, 5]
    with pytest.raises(RuntimeError):
        worker.submit(job())
