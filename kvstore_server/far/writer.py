"""Write-behind: pages bound for the far tier wait in a bounded queue for one thread, and
deletes the cluster did not confirm wait beside them, retried until done.

A put must never wait on the network, and a cluster that is slow must never make this
host's memory grow: `offer()` copies the page into the queue and returns at once, and
when the queue already holds `max_bytes` the page is dropped and counted (the far tier is
a cache: a dropped page is a later miss, nothing worse). The thread takes what is queued,
up to `batch_bytes` at a time, and writes it as one pipelined batch per layout, so a
burst of evictions costs a few round trips, not one per page. A batch that fails is not
retried: retrying would hold memory for a cluster that is not answering, and the
breakers already stop the calls.

Deletes are another matter: a page deleted must not come back. Two ways it did:
- its SET was still queued (or being written) when the UNLINK went out, and landed after
  it: 3-12 of 20 pages deleted right after a large put were served again. So `forget()`
  drops the queued pages of the keys a delete names, and a key of the batch being
  written keeps a tombstone that is sent again once that batch has landed;
- the UNLINK did not reach the page's master (it hung, its breaker was open, the slot
  moved): the page stayed, on the replica promoted meanwhile. So every key deleted gets
  a tombstone, settled when the cluster confirms its UNLINK; the thread sends the
  unsettled ones again every RETRY_INTERVAL (through the breakers: a master that is
  still out costs nothing until its probe is due) until the cluster confirms them.
An admin clear that did not finish (clear_later) is retried the same way. A page put
again after its delete (offer) cancels its tombstone: the new page is the right one.

Tombstones are bounded (TOMBSTONES keys, ~40 MiB at most): past that a delete is not
retried, and is counted (kvstore_far_deletes_dropped) and logged, never silent.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence

from .metrics import FarCounters

__all__ = ["RETRY_BATCH", "RETRY_INTERVAL", "TOMBSTONES", "WriteBehind"]

log = logging.getLogger("kvstore.far")

# (layout_id, [(key, payload)]) -> pages stored; FarClient.put fits.
PutFn = Callable[[bytes, Sequence[tuple[bytes, bytes]]], int]
# (layout_id, keys) -> the keys whose removal the cluster did not confirm.
UnlinkFn = Callable[[bytes, Sequence[bytes]], list[bytes]]
# (layout_id or None for the whole namespace) -> finished.
ClearFn = Callable[[bytes | None], bool]

TOMBSTONES = 1 << 17        # deleted keys waiting for a confirmed UNLINK, at most
RETRY_INTERVAL = 0.5        # seconds between two rounds of retried deletes
RETRY_BATCH = 4096          # keys one round sends again

_Page = tuple[bytes, bytes, bytes]      # (layout_id, key, payload)


def _no_unlink(layout_id: bytes, keys: Sequence[bytes]) -> list[bytes]:
    return list(keys)


def _no_clear(layout_id: bytes | None) -> bool:
    return False


class WriteBehind:
    """offer() pages; a daemon thread writes them and retries deletes; close() stops it."""

    def __init__(self, put: PutFn, max_bytes: int, counters: FarCounters | None = None,
                 batch_bytes: int = 16 << 20, unlink: UnlinkFn = _no_unlink,
                 clear: ClearFn = _no_clear, tombstones: int = TOMBSTONES) -> None:
        self._put = put
        self._unlink = unlink
        self._clear = clear
        self.max_bytes = max_bytes
        self.batch_bytes = batch_bytes
        self.max_tombstones = tombstones
        self.counters = counters or FarCounters()
        self._cond = threading.Condition()      # guards the fields below
        self._queue: collections.deque[_Page] = collections.deque()
        self._bytes = 0                         # payload bytes in _queue
        self._closed = False
        self._busy = False                      # the thread is writing a batch
        self._writing: set[tuple[bytes, bytes]] = set()     # (layout, key) of that batch
        # (layout, key) -> (generation of the delete that made it, monotonic time from
        # which it is retried). Settled only by the same generation, so a delete settling
        # late never erases a newer one's; retried only once its own delete has had its
        # try (a retry racing it would take its answer: "held 0")
        self._tombstones: dict[tuple[bytes, bytes], tuple[int, float]] = {}
        self._generation = 0
        self._clears: dict[bytes | None, None] = {}         # clears to finish, in order
        self._retry_at = 0.0                    # monotonic time of the next retry round
        self._thread = threading.Thread(target=self._run, name="kvstore-far-writer",
                                        daemon=True)
        self._thread.start()

    # -- pages ---------------------------------------------------------------------
    def offer(self, layout_id: bytes, key: bytes, payload) -> bool:
        """Queue a copy of one page; False (dropped, counted) when the queue is full."""
        size = memoryview(payload).nbytes
        with self._cond:
            if self._closed or self._bytes + size > self.max_bytes:
                self.counters.add(drops=1)
                return False
            if self._tombstones and self._tombstones.pop((layout_id, key), None) is not None:
                self._gauge()
            self._queue.append((layout_id, key, bytes(payload)))
            self._bytes += size
            self._cond.notify()
        return True

    def unwritten(self) -> set[tuple[bytes, bytes]]:
        """(layout, key) of the pages queued or being written: not in the cluster yet,
        not gone from it either (watch.py). At most the queue's pages."""
        with self._cond:
            return {(lid, key) for lid, key, _ in self._queue} | self._writing

    def depth(self) -> tuple[int, int]:
        """(pages, bytes) waiting."""
        with self._cond:
            return len(self._queue), self._bytes

    # -- deletes -------------------------------------------------------------------
    def forget(self, layout_id: bytes, keys: Sequence[bytes]) -> tuple[int, set[bytes]]:
        """A delete of these keys begins: their queued pages are dropped and each key
        gets a tombstone. Returns the tombstones' generation (for settle) and the keys
        in the batch being written now (not to settle before it lands)."""
        wanted = set(keys)
        with self._cond:
            self._drop_queued(lambda lid, key: lid == layout_id and key in wanted)
            self._generation += 1
            self._add_tombstones(((layout_id, k) for k in keys), self._generation)
            writing = {k for lid, k in self._writing if lid == layout_id and k in wanted}
            return self._generation, writing

    def forget_all(self, layout_id: bytes | None) -> None:
        """A clear of a layout (None: of everything) begins: drop its queued pages; the
        pages of the batch being written get tombstones, sent once it has landed."""
        def match(lid: bytes, key: bytes) -> bool:
            return layout_id is None or lid == layout_id

        with self._cond:
            self._drop_queued(match)
            self._generation += 1
            self._add_tombstones([p for p in self._writing if match(*p)], self._generation)

    def settle(self, layout_id: bytes, keys: Sequence[bytes], generation: int) -> None:
        """The cluster confirmed these keys' UNLINK: their tombstones go."""
        with self._cond:
            for key in keys:
                entry = self._tombstones.get((layout_id, key))
                if entry is not None and entry[0] == generation:
                    del self._tombstones[(layout_id, key)]
            self._gauge()

    def clear_later(self, layout_id: bytes | None) -> None:
        """A clear that did not finish: retried until it does."""
        with self._cond:
            if None not in self._clears:
                if layout_id is None:
                    self._clears.clear()
                self._clears[layout_id] = None
            self._gauge()
            self._cond.notify()

    def pending(self) -> int:
        """Deleted keys and unfinished clears not yet confirmed by the cluster."""
        with self._cond:
            return len(self._tombstones) + len(self._clears)

    def _drop_queued(self, match: Callable[[bytes, bytes], bool]) -> None:
        if not self._queue:
            return
        kept = collections.deque(p for p in self._queue if not match(p[0], p[1]))
        self._bytes -= sum(len(p[2]) for p in self._queue) - sum(len(p[2]) for p in kept)
        self._queue = kept

    def _add_tombstones(self, names, generation: int) -> None:
        dropped = 0
        entry = (generation, time.monotonic() + RETRY_INTERVAL)
        for name in names:
            if name in self._tombstones or len(self._tombstones) < self.max_tombstones:
                self._tombstones[name] = entry
            else:
                dropped += 1
        if dropped:
            self.counters.add(deletes_dropped=dropped)
            log.warning("far tier: %d deleted keys will not be retried: %d deletes already "
                        "wait for the cluster", dropped, len(self._tombstones))
        self._gauge()
        self._cond.notify()

    def _gauge(self) -> None:
        self.counters.deletes_pending = len(self._tombstones) + len(self._clears)

    # -- the thread ----------------------------------------------------------------
    def _take(self) -> list[_Page] | None:
        """The next batch; [] when only retries are due; None once closed and empty."""
        with self._cond:
            while not self._queue and not self._closed:
                if self._tombstones or self._clears:
                    wait = self._retry_at - time.monotonic()
                    if wait <= 0:
                        self._busy = True
                        return []
                    self._cond.wait(wait)
                else:
                    self._cond.wait()
            if not self._queue:
                return None
            batch: list[_Page] = []
            size = 0
            while self._queue and (not batch or size + len(self._queue[0][2])
                                   <= self.batch_bytes):
                item = self._queue.popleft()
                batch.append(item)
                size += len(item[2])
            self._bytes -= size
            self._busy = True
            self._writing = {(lid, key) for lid, key, _ in batch}
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
                self._writing = set()
            self._retry()
            with self._cond:
                self._busy = False
                self._cond.notify_all()
        self._retry(force=True)      # once more at close: what is left is logged by close

    def _retry(self, force: bool = False) -> None:
        """One round of deletes and clears not yet confirmed, at most every
        RETRY_INTERVAL (and never behind a batch of pages for longer)."""
        now = time.monotonic()
        with self._cond:
            if not (self._tombstones or self._clears) or (now < self._retry_at and not force):
                return
            self._retry_at = now + RETRY_INTERVAL
            clears = list(self._clears)
            names = [(name, generation) for name, (generation, due)
                     in self._tombstones.items() if due <= now or force][:RETRY_BATCH]
        for layout_id in clears:
            try:
                finished = self._clear(layout_id)
            except Exception:  # noqa: BLE001 - retried next round
                finished = False
            if finished:
                with self._cond:
                    self._clears.pop(layout_id, None)
                    self._gauge()
        by_layout: dict[bytes, list[tuple[bytes, int]]] = {}
        for (layout_id, key), generation in names:
            by_layout.setdefault(layout_id, []).append((key, generation))
        for layout_id, entries in by_layout.items():
            keys = [k for k, _ in entries]
            try:
                unconfirmed = set(self._unlink(layout_id, keys))
            except Exception:  # noqa: BLE001 - retried next round
                unconfirmed = set(keys)
            self.counters.add(deletes_retried=len(keys))
            with self._cond:
                for key, generation in entries:
                    entry = self._tombstones.get((layout_id, key))
                    if key not in unconfirmed and entry is not None and entry[0] == generation:
                        del self._tombstones[(layout_id, key)]
                self._gauge()

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
