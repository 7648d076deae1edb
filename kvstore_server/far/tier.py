"""FarTier: the far tier in the shape of the storage engine's tier interface.

The engine sees every level below DRAM through one interface (offer a page, say which
keys are held, read pages into the caller's buffers, delete, evict, flush, close), so
DRAM -> disk -> far is a chain of one interface. This adapter maps it onto the far
tier's parts:

    offer(layout, key, page)     -> WriteBehind.offer: a copy queued, never waits;
                                    refused while the breaker is open (no copy made)
    contains(layout, keys)       -> FarClient.exists: one round trip per shard
    read_into(layout, keys, outs)-> FarClient.get in batches of at most READ_BATCH bytes,
                                    each verified page copied into its out buffer
    delete(layout, keys)         -> FarClient.delete (UNLINK)
    evict(layout / everything)   -> FarClient.clear: this namespace's keys only; a byte
                                    amount is the cluster's own eviction's business
    flush(timeout) / close()     -> the write-behind queue's

Every method answers; none raises on the cluster's behalf (misses, False, 0).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from .breaker import BreakerState
from .client import FarClient
from .codec import Reason
from .writer import WriteBehind

__all__ = ["READ_BATCH", "FarTier"]

# Bytes one get asks for at once: what one call may hold in memory twice over (the
# reply, then the verified copy into the caller's buffer), whatever the request's size.
READ_BATCH = 64 << 20


class FarTier:
    """A Valkey/Redis Cluster below the disk tier; a cache that may forget any page."""

    holds_pages = True

    def __init__(self, client: FarClient, writer: WriteBehind | None = None) -> None:
        self.client = client
        self.writer = writer or WriteBehind(client.put, client.settings.queue_bytes,
                                            client.counters)

    def offer(self, layout_id: bytes, key: bytes, page) -> bool:
        if self.client.breaker.state is BreakerState.OPEN:
            return False
        return self.writer.offer(layout_id, key, page)

    def contains(self, layout_id: bytes, keys: Sequence[bytes]) -> np.ndarray:
        return np.array(self.client.exists(layout_id, keys), dtype=bool)

    def read_into(self, layout_id: bytes, keys: Sequence[bytes],
                  outs: Sequence) -> list[bool]:
        got = [False] * len(keys)
        start = 0
        while start < len(keys):
            end, size = start, 0
            while end < len(keys) and (end == start or size + _nbytes(outs[end]) <= READ_BATCH):
                size += _nbytes(outs[end])
                end += 1
            # Larger batches get a deadline that grows with their bytes: the far timeout
            # bounds a lookup's wait, not a transfer's (1 GB/s is a slow cluster here).
            timeout = self.client.settings.timeout + size / 1e9
            pages = self.client.get(layout_id, keys[start:end], timeout=timeout)
            for i, page in enumerate(pages, start):
                if page is None:
                    continue
                out = memoryview(outs[i]).cast("B")
                if page.nbytes != out.nbytes:     # same layout, other size: not this page
                    self.client.counters.reject(Reason.TRUNCATED)
                    continue
                out[:] = page
                got[i] = True
            start = end
        return got

    def delete(self, layout_id: bytes, keys: Sequence[bytes]) -> int:
        return self.client.delete(layout_id, keys)

    def evict(self, *, nbytes: int | None = None, layout_id: bytes | None = None,
              everything: bool = False) -> tuple[int, int]:
        """A layout's pages, or all of this namespace's: (pages, 0) — the cluster does not
        say how many bytes UNLINK freed. A byte amount alone evicts nothing: the
        cluster's maxmemory policy decides that."""
        if layout_id is None and not everything:
            return 0, 0
        return self.client.clear(layout_id if not everything else None), 0

    def flush(self, timeout: float) -> int:
        self.writer.flush(timeout)
        return self.writer.depth()[0]

    def close(self) -> None:
        deadline = time.monotonic() + 5.0
        self.writer.close(max(0.0, deadline - time.monotonic()))
        self.client.close()


def _nbytes(buf) -> int:
    return memoryview(buf).nbytes
