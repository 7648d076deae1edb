"""Write-behind: pages bound for the far tier wait in a bounded queue for one thread.

A put must never wait on the network, and a cluster that is slow must never make this
host's memory grow: `offer()` copies the page into the queue and returns at once, and
when the queue already holds `max_bytes` the page is dropped and counted (the far tier is
a cache: a dropped page is a later miss, nothing worse). The thread takes what is queued,
up to `batch_bytes` at a time, and writes it as one pipelined batch per layout, so a
burst of evictions costs a few round trips, not one per page. A batch that fails is not
retried: retrying would hold memory for a cluster that is not answering, and the breaker
already stops the calls.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence

from .metrics import FarCounters

__all__ = ["WriteBehind"]

# (layout_id, [(key, payload)]) -> pages stored; FarClient.put fits.
PutFn = Callable[[bytes, Sequence[tuple[bytes, bytes]]], int]


class WriteBehind:
    """offer() pages; a daemon thread writes them; close() stops it."""

    def __init__(self, put: PutFn, max_bytes: int, counters: FarCounters | None = None,
                 batch_bytes: int = 16 << 20) -> None:
        self._put = put
        self.max_bytes = max_bytes
        self.batch_bytes = batch_bytes
        self.counters = counters or FarCounters()
        self._cond = threading.Condition()      # guards the three fields below
        self._queue: collections.deque[tuple[bytes, bytes, bytes]] = collections.deque()
        self._bytes = 0                         # payload bytes in _queue
        self._closed = False
        self._busy = False                      # the thread is writing a batch
        self._thread = threading.Thread(target=self._run, name="kvstore-far-writer",
                                        daemon=True)
        self._thread.start()

    def offer(self, layout_id: bytes, key: bytes, payload) -> bool:
        """Queue a copy of one page; False (dropped, counted) when the queue is full."""
        size = memoryview(payload).nbytes
        with self._cond:
            if self._closed or self._bytes + size > self.max_bytes:
                self.counters.add(drops=1)
                return False
            self._queue.append((layout_id, key, bytes(payload)))
            self._bytes += size
            self._cond.notify()
        return True

    def depth(self) -> tuple[int, int]:
        """(pages, bytes) waiting."""
        with self._cond:
            return len(self._queue), self._bytes

    def _take(self) -> list[tuple[bytes, bytes, bytes]] | None:
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if not self._queue:
                return None
            batch: list = []
            size = 0
            while self._queue and (not batch or size + len(self._queue[0][2])
                                   <= self.batch_bytes):
                item = self._queue.popleft()
                batch.append(item)
                size += len(item[2])
            self._bytes -= size
            self._busy = True
            return batch

    def _run(self) -> None:
        while (batch := self._take()) is not None:
            by_layout: dict[bytes, list[tuple[bytes, bytes]]] = {}
            for layout_id, key, payload in batch:
                by_layout.setdefault(layout_id, []).append((key, payload))
            for layout_id, items in by_layout.items():
                try:
                    self._put(layout_id, items)
                except Exception:  # noqa: BLE001 - the writer must outlive any one bad batch
                    self.counters.add(errors=1)
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait until everything queued so far is written; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Stop taking pages; write what is queued for up to `timeout`, then stop."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
