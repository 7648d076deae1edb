"""Lookups on a background thread, so that a burst of new requests costs the scheduler loop little.

vLLM asks the connector request by request inside one `schedule()` how much of each
prompt the store holds. Asked there, every answer is a hash of the prompt's pages and a
Lookup round trip, while the GPU waits for the step (`kvstore-bench admit` measures a
burst of 64 requests sharing a prompt both ways: docs/connector.md renders its records). Here the scheduler half hands each new request to one
worker thread and answers "ask again" (None) at once; the worker hashes and looks the
requests up one after another (the lease taken with each lookup, as on the loop) and the
next `schedule()` reads finished answers. The loop's own part is a slice of the token
list and a queue append.

One request's life here, as the scheduler half (connector.scheduler) drives it:

    submit(job)        -> Pending; the worker fills pending.answer and sets pending.done
    pending.done       -> the scheduler half takes the answer (and its lease)
    abandon(pending)   -> the answer is not wanted (request finished, its tokens changed,
                          no answer in time): its lease is released, now or when it comes
    release(lease_ids) -> the worker sends the releases, ahead of its next lookups

The worker never blocks the loop: releases and lookups that meet a store that does not
answer cost the worker its call's timeout (the caller's breaker then stops both), and a
request whose answer has not come by its deadline is answered "no hit" by the scheduler
half. Every lease an answer carries is either taken by the scheduler half or released:
abandon() and the worker's hand-over of an answer are one critical section.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from kvstore_client.results import Pins

__all__ = ["DOWN", "Answer", "Job", "LookupWorker", "Pending"]

log = logging.getLogger(__name__)

DOWN = -1          # Answer.count: the store did not answer (timed out or unreachable)


@dataclasses.dataclass(frozen=True, slots=True)
class Job:
    """What the worker needs to look one request up, copied on the loop's thread."""

    req_id: str
    tokens: Sequence[int]          # the request's token ids when asked (a snapshot)
    pages: int                     # leading full pages to look up
    keys: tuple[bytes, ...]        # keys already hashed for this request (a prefix)
    packed: bytes                  # the same keys back to back


@dataclasses.dataclass(frozen=True, slots=True)
class Answer:
    """The worker's answer: the hashing it did (kept by the request) and the store's."""

    tokens: np.ndarray             # Job.tokens as int32
    keys: tuple[bytes, ...]        # keys of at least Job.pages pages
    packed: bytes
    count: int                     # leading pages present; DOWN: store not answering
    lease_id: int = 0              # pins the counted pages; 0 = none
    error: Exception | None = None  # a refusal the caller must see (raised on its thread)
    pins: Pins | None = None       # lookups.Counted.pins and .use_by, as counted
    use_by: float = 0.0


@dataclasses.dataclass(slots=True, eq=False)
class Pending:
    """One submitted job. `answer` and `abandoned` change only under the worker's lock."""

    job: Job
    submitted: float               # monotonic seconds
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    answer: Answer | None = None
    abandoned: bool = False


class LookupWorker:
    """One thread that answers Jobs with `lookup` and sends lease releases with `release`.

    lookup(job) -> Answer runs on the worker thread; an exception it raises becomes
    Answer.error. release(lease_ids) -> the ids it could not send (the store is down),
    kept and tried again with the next batch of work.
    """

    def __init__(self, lookup: Callable[[Job], Answer],
                 release: Callable[[list[int]], list[int]], *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._lookup = lookup
        self._release = release
        self.clock = clock
        self._lock = threading.Condition()     # guards everything below and Pending fields
        self._jobs: collections.deque[Pending] = collections.deque()
        self._releases: list[int] = []         # lease ids to send
        self._closed = False
        self._thread: threading.Thread | None = None   # started by the first submit
        # When the lookup in flight began (None: none is): a call in flight for longer
        # than a healthy one takes means the store may hang. Written by the worker only.
        self._calling_since: float | None = None
        # Work taken off the queues and not finished yet (releases or lookups): a release
        # to a hung store holds the client's lease lane for its timeout, so the thread is
        # not idle then either.
        self._busy = False
        self.looked_up = 0                     # lookups made (for tests and benchmarks)

    def submit(self, job: Job) -> Pending:
        pending = Pending(job, self.clock())
        with self._lock:
            if self._closed:
                raise RuntimeError("the lookup worker is closed")
            self._jobs.append(pending)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvstore-lookups",
                                                daemon=True)
                self._thread.start()
            self._lock.notify()
        return pending

    def idle(self) -> bool:
        """Whether the thread has nothing queued and no call in flight: a lookup made on
        the caller's thread now would wait behind nothing of ours."""
        with self._lock:
            return not self._jobs and not self._releases and not self._busy

    def stalled(self, seconds: float) -> bool:
        """Whether the lookup in flight has taken longer than `seconds` so far."""
        since = self._calling_since
        return since is not None and self.clock() - since > seconds

    def abandon(self, pending: Pending) -> None:
        """The answer is not wanted: its lease goes, whenever the answer comes."""
        with self._lock:
            if pending.abandoned:
                return
            pending.abandoned = True
            if pending.answer is not None and pending.answer.lease_id:
                self._releases.append(pending.answer.lease_id)
                self._lock.notify()

    def release(self, lease_ids: Sequence[int]) -> None:
        if not lease_ids:
            return
        with self._lock:
            self._releases.extend(lease_ids)
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="kvstore-lookups",
                                                daemon=True)
                self._thread.start()
            self._lock.notify()

    def _run(self) -> None:
        while True:
            with self._lock:
                self._busy = False
                while not self._jobs and not self._releases and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                jobs = list(self._jobs)
                self._jobs.clear()
                releases, self._releases = self._releases, []
                self._busy = True
            if releases:
                # Releases first: they unpin pages the lookups after them may count.
                kept = self._release(releases)
                if kept:
                    with self._lock:
                        self._releases[:0] = kept
                        if not jobs and not self._jobs and not self._closed:
                            # The store is down: wait for new work (or close) rather
                            # than spin; the kept releases go with the next batch. Work
                            # submitted during the release was notified to nobody: it
                            # is looked up now, not a second later (a hung store once
                            # cost a scheduler step the release's timeout and then
                            # this wait).
                            self._lock.wait(1.0)
            for pending in jobs:
                if pending.abandoned:
                    pending.done.set()
                    continue
                self._calling_since = self.clock()
                try:
                    answer = self._lookup(pending.job)
                except Exception as exc:  # noqa: BLE001 - handed to the caller's thread
                    answer = Answer(np.zeros(0, np.int32), (), b"", 0, 0, exc)
                finally:
                    self._calling_since = None
                self.looked_up += 1
                with self._lock:
                    if pending.abandoned:
                        if answer.lease_id:
                            self._releases.append(answer.lease_id)
                    else:
                        pending.answer = answer
                pending.done.set()

    def close(self, timeout: float) -> list[int]:
        """Stop the thread (after the call it is in, at most `timeout` seconds); returns
        the lease ids still to release: queued ones and those of answers not taken."""
        with self._lock:
            self._closed = True
            self._lock.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        with self._lock:
            left = self._releases
            self._releases = []
            for pending in self._jobs:
                pending.abandoned = True
                pending.done.set()
            self._jobs.clear()
        return left
