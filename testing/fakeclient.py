"""A client with no server: the calls of KVStoreClient that the connector's scheduler half
makes (register, lookup, leased lookup, release, exists, retain) and those its worker half
makes through shared memory (region, reserve and commit or abort, acquire and release,
delete, put), answered by a real Store in this process over a real pool file.

For unit tests of the halves' logic (prefetched lookups, leases dropped on every path,
hit accounting; a worker's saves and loads): no process, no socket, nothing to wait for but
the logic itself. The worker's pages go through the pool as they do with a server on its
host: the store's region file mapped a second time (kvstore_client.shm.SharedRegion). Loads
from another host (get_layers) are not here: tests/integration/test_remote_load.py. The
pages, leases and counts are the store's own, so what a test reads back (leases held,
pages stored) is what a server would report. A store that hangs or fails is a switch
(`hung`, `fail`), not a SIGSTOP. The transports, and the scheduler against a real server,
stay in tests/integration.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence

import grpc
import numpy as np

from kvstore_client.client import Retention
from kvstore_client.errors import KVStoreError
from kvstore_client.results import LayoutHandle, Lease, PutResult
from kvstore_client.shm import Acquired, Reservation, SharedRegion
from kvstore_protocol.keys import Packed
from kvstore_protocol.layout import PageLayout
from kvstore_server.errors import StoreError
from kvstore_server.region import TOKEN_OFFSET, Region
from kvstore_server.rpc.status import CODES
from kvstore_server.store import Store
from kvstore_server.tenants import DEFAULT_TENANT

__all__ = ["FakeClient"]

MiB = 1 << 20


class FakeClient:
    """KVStoreClient's scheduler-side calls over an in-process Store (see the module).

    calls counts each call by name, answered or not. While `hung` is set, a call waits
    for it to clear, as a stopped server keeps its caller waiting, and past `timeout`
    seconds raises DEADLINE_EXCEEDED, as KVStoreClient does. `fail`, when set, is raised
    by every call instead (a KVStoreError such as UNAVAILABLE)."""

    def __init__(self, dram: int = 32 * MiB, lease_ttl: float = 30.0, timeout: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = Region(dram)                  # the server's side of the pool
        self.store = Store(self.pool, lease_ttl=lease_ttl, clock=clock)
        self.timeout = timeout
        self.calls: collections.Counter[str] = collections.Counter()
        self.hung = _Switch()
        self.fail: KVStoreError | None = None
        self.closed = False
        self._shared: SharedRegion | None = None      # the pool as a client maps it

    # -- what the scheduler half calls ------------------------------------------------
    def register_layout(self, layout: PageLayout) -> LayoutHandle:
        info = self._call("RegisterLayout", self.store.register_layout, layout)
        return LayoutHandle(layout, info.layout_id, info.page_bytes, info.layer_bytes)

    def lookup(self, ns: LayoutHandle | Sequence[LayoutHandle],
               keys: Sequence[bytes] | Packed) -> int:
        return self._call("Lookup", self.store.lookup, _ids(ns), keys)[0]

    def lookup_lease(self, ns: LayoutHandle | Sequence[LayoutHandle],
                     keys: Sequence[bytes] | Packed, lease_ms: int,
                     pins: bool = False) -> Lease:
        if lease_ms <= 0:
            raise ValueError("lease_ms must be positive")
        count, lease_id = self._call("Lookup", self.store.lookup, _ids(ns), keys,
                                     lease_ms / 1000)
        return Lease(lease_id, count, None)          # pins: only over the fast path

    def release_lease(self, lease: Lease | int, pages_read: int = 0) -> bool:
        lease_id = lease.lease_id if isinstance(lease, Lease) else lease
        if not lease_id:
            return False
        return self._call("ReleaseLease", self.store.release, lease_id, None, pages_read)

    def release_lease_later(self, lease: Lease | int, pages_read: int = 0) -> None:
        self.release_lease(lease, pages_read)

    def exists(self, ns: LayoutHandle, keys: Sequence[bytes]) -> list[bool]:
        return self._call("Exists", self.store.exists, ns.layout_id, keys).tolist()

    def retain(self, ns: LayoutHandle, keys: Sequence[bytes], session: str,
               ttl: float) -> Retention:
        got = self._call("Retain", self.store.retain, ns.layout_id, Packed.of(keys), session,
                         ttl)
        return Retention(got.pages, got.refused)

    def release_retention(self, session: str) -> int:
        return self._call("ReleaseRetention", self.store.release_retention, session,
                          DEFAULT_TENANT)

    # -- what the worker half calls ----------------------------------------------------
    def region(self) -> SharedRegion | None:
        """The store's pool mapped as a client on its host maps it."""
        if self._shared is None:
            self._shared = SharedRegion(self.pool.path, self.pool.size, TOKEN_OFFSET)
        return self._shared

    def reserve(self, ns: LayoutHandle, keys: Sequence[bytes], lease_ms: int = 0) -> Reservation:
        res = self._call("Reserve", self.store.reserve, ns.layout_id, keys, self._ttl(lease_ms))
        skipped = int((res.slots < 0).sum()) - res.in_flight
        return Reservation(ns, res.lease_id, res.offsets, skipped, self._need(), self._commit,
                           self._abort, res.in_flight)

    def acquire(self, ns: LayoutHandle, keys: Sequence[bytes], lease_ms: int = 0) -> Acquired:
        pinned = self._call("Acquire", self.store.acquire, ns.layout_id, keys,
                            self._ttl(lease_ms))
        return Acquired(ns, pinned.lease_id, pinned.offsets, self._need(), self.release_lease)

    def delete(self, ns: LayoutHandle, keys: Sequence[bytes]) -> int:
        return self._call("Delete", self.store.delete, ns.layout_id, keys)

    def close(self) -> None:
        self.closed = True

    # -- for the test -----------------------------------------------------------------
    def put(self, ns: LayoutHandle, keys: Sequence[bytes], pages) -> PutResult:
        """Store pages (N, page_bytes) under keys, as KVStoreClient.put does."""
        flat = np.ascontiguousarray(pages, dtype=np.uint8).reshape(len(keys), ns.page_bytes)
        res = self._call("Put", self.store.reserve, ns.layout_id, keys)
        for page, offset in zip(flat, res.offsets.tolist(), strict=True):
            if offset >= 0:
                self.pool.mem[offset:offset + ns.page_bytes] = page
        stored = self.store.commit(res.lease_id)
        return PutResult(stored, int((res.slots < 0).sum()) - res.in_flight, res.in_flight)

    @property
    def leases(self) -> int:
        """Live leases in the store, as Stats reports them."""
        return self.store.stats().leases

    def __enter__(self) -> FakeClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        if self._shared is not None:
            self._shared.close()
        self.pool.close()

    def _need(self) -> SharedRegion:
        region = self.region()
        assert region is not None
        return region

    def _ttl(self, lease_ms: int) -> float:
        """lease_ms as the server caps it (rpc/calls.py): 0 = the store's ttl."""
        ttl = self.store.lease_ttl
        return min(lease_ms / 1000.0, ttl) if lease_ms else ttl

    def _commit(self, lease_id: int) -> int:
        return self._call("Commit", self.store.commit, lease_id)

    def _abort(self, lease_id: int) -> bool:
        return self._call("Abort", self.store.abort, lease_id)

    def _call(self, name: str, fn, *args):
        """fn(*args) as the call `name`: counted, held while hung, and a StoreError as the
        KVStoreError a client would raise (the server's status for its outcome)."""
        self.calls[name] += 1
        if not self.hung.wait_clear(self.timeout):
            raise KVStoreError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", name)
        if self.fail is not None:
            raise self.fail
        try:
            return fn(*args)
        except StoreError as exc:
            raise KVStoreError(CODES.get(exc.outcome, grpc.StatusCode.INTERNAL), str(exc),
                               name) from None


class _Switch:
    """An event a waiter waits to see cleared (threading.Event waits to see it set)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._on = False

    def set(self) -> None:
        with self._cond:
            self._on = True

    def clear(self) -> None:
        with self._cond:
            self._on = False
            self._cond.notify_all()

    def is_set(self) -> bool:
        return self._on

    def wait_clear(self, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not self._on, timeout)


def _ids(ns: LayoutHandle | Sequence[LayoutHandle]) -> list[bytes]:
    return [ns.layout_id] if isinstance(ns, LayoutHandle) else [h.layout_id for h in ns]
