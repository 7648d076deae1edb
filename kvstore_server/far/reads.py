"""Far reads in parallel parts: a request's pages fetched as several batches in flight,
each part verified and copied into its buffers, by the thread that fetched it, as soon
as it lands.

Why parts, and why several at once. One glide batch of every MGET of a request waits
for the last byte of the last shard before Python sees anything, and the decode, the
checksum and the copy into the pool then run after it, on the request's path. Cut into
parts of about PART_BYTES, with up to PARALLEL of them in flight on a small thread pool
(glide's FFI call releases the GIL while its Rust core waits on the sockets), the
cluster sends part k+1 while this process verifies and copies part k, and the shards'
replies overlap more. PART_BYTES and PARALLEL are the fastest of the sizes and counts
tried against glide's own single pipelined MGET batch (which neither verifies nor
copies), on a loopback cluster in interleaved rounds; docs/perf/far-4e023a4575.json
records parts in parallel against that MGET (docs/far.md renders it).

Why the fetching thread lands its part, not the request's thread. The fetch hands each
page over as a view into glide's reply (client.py's read, inplace.py), valid only until
the reply is freed, so the copy into the pool has to happen in the fetch, before that;
and a part done is then copied at once, while its bytes are still in cache, with no hop
to the request's thread and no wait behind an earlier part still in flight. Since the
copies run in pool threads, read() returns only once no part is running: a reservation
aborted after a failed read never has a page land in a slot handed to another page.

Bounds. A request holds at most PARALLEL parts in flight, fetched or being copied (each
at most PART_BYTES, or one page if a page is larger): PARALLEL * PART_BYTES = 16 MiB at most,
whatever the request's size. The pool has WORKERS threads, shared by every request of
the server, so the cluster is asked for at most WORKERS parts at once in all; parts
beyond wait in the pool's queue (key lists only, no bytes).

Deadline. A part's deadline is the far timeout plus its share of the bytes in flight at
1 GB/s (a slow cluster here): the far timeout bounds a lookup's wait, not a transfer.
A part that fails or runs out of time answers its pages as misses, like any far call.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Protocol

__all__ = ["PARALLEL", "PART_BYTES", "WORKERS", "ParallelReader", "split"]

PART_BYTES = 1 << 20        # bytes one part asks for (one page at least)
PARALLEL = 16               # parts of one request in flight: 16 MiB at most
WORKERS = 16                # threads the server's far reads share

Land = Callable[[int, object], None]


class Fetch(Protocol):
    """FarClient.read's shape: max_page bounds what the cluster may send for a key."""

    def __call__(self, layout_id: bytes, keys: list[bytes], timeout: float, land: Land, *,
                 max_page: int) -> None: ...


def split(sizes: Sequence[int], part_bytes: int) -> list[tuple[int, int]]:
    """[start, end) ranges of consecutive items, each at most part_bytes (one item at
    least, however large)."""
    parts = []
    start = 0
    while start < len(sizes):
        end, size = start, 0
        while end < len(sizes) and (end == start or size + sizes[end] <= part_bytes):
            size += sizes[end]
            end += 1
        parts.append((start, end))
        start = end
    return parts


class ParallelReader:
    """Runs `fetch` over parts of a request on a shared pool; `land` copies each page."""

    def __init__(self, fetch: Fetch, timeout: float, workers: int = WORKERS) -> None:
        self._fetch = fetch
        self._timeout = timeout
        self._workers = workers
        self._lock = threading.Lock()       # guards _pool: made on the first read
        self._pool: ThreadPoolExecutor | None = None

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="far-read")
            return self._pool

    def read(self, layout_id: bytes, keys: Sequence[bytes], sizes: Sequence[int],
             land: Land) -> None:
        """Fetch every key, at most PARALLEL parts in flight; land(i, page) for each key
        (page: a verified bytes-like view, or None for a miss), in the thread that
        fetched its part: calls for different keys may run at once. When this returns
        or raises, no part is running, so no land() comes after it."""
        parts = split(sizes, PART_BYTES)
        if len(parts) == 1:             # nothing to overlap: no thread hop
            self._part(layout_id, keys, sizes, parts[0], 1, land)
            return
        pool = self._executor()
        window = min(PARALLEL, len(parts))
        todo = deque(parts)
        flying: set[Future] = set()
        try:
            while todo or flying:
                while todo and len(flying) < window:
                    flying.add(pool.submit(self._part, layout_id, keys, sizes, todo.popleft(),
                                           window, land))
                done, flying = wait(flying, return_when=FIRST_COMPLETED)
                for future in done:
                    future.result()         # land raised: stop, after the rest (finally)
        finally:
            # A part still running writes into buffers the caller gives up once this
            # returns (a reservation's slots, aborted and handed to other pages): cancel
            # the parts not started and wait for the rest, within their deadlines.
            for future in flying:
                future.cancel()
            wait(flying)

    def _part(self, layout_id: bytes, keys: Sequence[bytes], sizes: Sequence[int],
              part: tuple[int, int], window: int, land: Land) -> None:
        start, end = part
        in_flight = sum(sizes[start:end]) * window
        # Of a value longer than the part's largest page at most one byte more is
        # fetched (client.py, GETRANGE), so a planted oversized value cannot break the
        # bound above.
        self._fetch(layout_id, list(keys[start:end]), self._timeout + in_flight / 1e9,
                    lambda i, page: land(start + i, page), max_page=max(sizes[start:end]))

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
