"""KVStoreClient: register layouts, put, look up, get and delete KV pages.

On the same host as the server, page bytes move through the server's shared-memory pool
(kvstore_client.shm) and gRPC carries only offsets and leases; elsewhere they stream over
gRPC. `put`, `get`, `get_into` and `get_layers` pick the path by themselves.

Every call has a timeout. Idempotent calls are retried with backoff when the server is
UNAVAILABLE (restarting, briefly overloaded); a server that restarted has forgotten the
layouts, so a call refused with Reason.LAYOUT_UNKNOWN registers its layout again and retries
once. Puts are idempotent too: keys already stored are skipped by the server.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from typing import Callable, Iterator, Sequence, TypeVar

import grpc
import numpy as np

from ._proto.kvstore.v1 import admin_pb2 as apb
from ._proto.kvstore.v1 import kvstore_pb2 as pb
from .buffers import LayerMajorWriter, as_uint8, page_aligned_empty
from .channel import PEM, open_channel, with_token
from .convert import layout_from_proto, layout_to_proto
from .dataplane import USE_GRPC, DataPlane, packed_keys, tls_context
from .fastpath import FastPathUnavailable
from .errors import KVStoreError, PagesMissing, Reason, from_rpc_error, reason_of
from .keys import Packed, pack_keys
from .layout import PageLayout
from .lookup_stream import LookupStream
from .shm import Acquired, Reservation, SharedRegion, copy_layer, copy_pages
from .wire import GET_DATA_TAG, PUT_DATA_TAG, frame, unframe

__all__ = ["KVStoreClient", "LayoutHandle", "PutResult", "Lease"]

log = logging.getLogger(__name__)

T = TypeVar("T")

CHUNK_BYTES = 1 << 20          # Put data messages; matches the server's Get chunks
_RETRY_CODES = (grpc.StatusCode.UNAVAILABLE,)


@dataclasses.dataclass(frozen=True, slots=True)
class LayoutHandle:
    """A registered layout: what every page call names."""

    layout: PageLayout
    layout_id: bytes
    page_bytes: int
    layer_bytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class PutResult:
    stored: int     # pages newly stored
    skipped: int    # keys that were already present
    # Keys another put was still writing: not stored by this call, and stored at all only
    # if that writer commits (look them up again later to know).
    in_flight: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Lease:
    """Pages pinned by a lookup: they cannot be evicted until released or expired."""

    lease_id: int
    count: int


def _put_serializer(message) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def _get_deserializer(message: bytes):
    payload = unframe(message, GET_DATA_TAG)
    return payload if payload is not None else memoryview(pb.GetResponse.FromString(message).data)


class KVStoreClient:
    """A connection to one kvstore-server. Thread-safe; use as a context manager.

    timeout: seconds per call (a Get or Put of many pages gets more, scaled by size);
    retries: extra attempts of idempotent calls on UNAVAILABLE (0 = none);
    shared_memory: None = use the server's shared-memory pool when it can be mapped (same
    host), else gRPC; True = require it; False = always gRPC.
    token: bearer token of a server with --auth-file (None = send none);
    tls_ca: CA certificate (path or PEM bytes) that signed the server's: use TLS;
    tls_cert, tls_key: this client's certificate and key, for a server that requires
    mutual TLS (kvstore_client.channel).
    data_plane: the fast path beside gRPC (kvstore_client.dataplane): None = use it when
    it can be reached, True = require it, False = gRPC only. data_address: its HOST:PORT
    or Unix socket path (None = the server's: the socket beside the pool on this host,
    else the gRPC port + 1); data_connections: most connections one Get is striped over.
    """

    def __init__(self, address: str, *, timeout: float = 10.0, retries: int = 3,
                 shared_memory: bool | None = None, token: str | None = None,
                 tls_ca: PEM | None = None, tls_cert: PEM | None = None,
                 tls_key: PEM | None = None, lookup_stream: bool = True,
                 channel: grpc.Channel | None = None, data_plane: bool | None = None,
                 data_address: str | None = None, data_connections: int = 4) -> None:
        self.address = address
        self.timeout = timeout
        self.retries = retries
        self.shared_memory = shared_memory
        self._region: SharedRegion | None = None
        self._region_tried = False
        self._region_lock = threading.Lock()   # guards attaching and re-attaching
        self._releases: set[grpc.Future] = set()   # lease releases still in flight
        self._channel = (with_token(channel, token) if channel is not None else
                         open_channel(address, token=token, tls_ca=tls_ca, tls_cert=tls_cert,
                                      tls_key=tls_key))
        c = self._channel
        s = "/kvstore.v1.KVStore/"
        a = "/kvstore.v1.Admin/"

        def unary(path, req, resp):
            return c.unary_unary(path, request_serializer=req.SerializeToString,
                                 response_deserializer=resp.FromString)

        self._register = unary(s + "RegisterLayout", pb.RegisterLayoutRequest,
                               pb.RegisterLayoutResponse)
        self._lookup = unary(s + "Lookup", pb.LookupRequest, pb.LookupResponse)
        # Lookups go over one open stream where they can (kvstore_client.lookup_stream).
        self._lookups = LookupStream(c.stream_stream(
            s + "LookupStream", request_serializer=pb.LookupRequest.SerializeToString,
            response_deserializer=pb.LookupResponse.FromString)) if lookup_stream else None
        if self._lookups is not None:
            # A client dropped without close() would keep its stream, and a server thread,
            # open until the server's idle timeout (5 minutes): close it with the client
            # (not at interpreter exit, where the process's end closes it anyway).
            weakref.finalize(self, self._lookups.close).atexit = False
        self._release = unary(s + "ReleaseLease", pb.ReleaseLeaseRequest, pb.ReleaseLeaseResponse)
        self._exists = unary(s + "Exists", pb.ExistsRequest, pb.ExistsResponse)
        self._delete = unary(s + "Delete", pb.DeleteRequest, pb.DeleteResponse)
        self._put = c.stream_unary(s + "Put", request_serializer=_put_serializer,
                                   response_deserializer=pb.PutResponse.FromString)
        self._get = c.unary_stream(s + "Get", request_serializer=pb.GetRequest.SerializeToString,
                                   response_deserializer=_get_deserializer)
        self._attach = unary(s + "Attach", pb.AttachRequest, pb.AttachResponse)
        self._reserve = unary(s + "Reserve", pb.ReserveRequest, pb.ReserveResponse)
        self._commit = unary(s + "Commit", pb.CommitRequest, pb.CommitResponse)
        self._abort = unary(s + "Abort", pb.AbortRequest, pb.AbortResponse)
        self._acquire = unary(s + "Acquire", pb.AcquireRequest, pb.AcquireResponse)
        self._stats = unary(a + "Stats", apb.StatsRequest, apb.StatsResponse)
        self._evict = unary(a + "Evict", apb.EvictRequest, apb.EvictResponse)
        self._clear = unary(a + "Clear", apb.ClearRequest, apb.ClearResponse)
        self._list = unary(a + "ListLayouts", apb.ListLayoutsRequest, apb.ListLayoutsResponse)
        self._inspect = unary(a + "Inspect", apb.InspectRequest, apb.InspectResponse)
        self._data = DataPlane(
            address, enabled=data_plane, data_address=data_address, token=token,
            tls=tls_context(tls_ca, tls_cert, tls_key), timeout=lambda: self.timeout,
            connections=data_connections, region=self.region,
            reregister=lambda handle: self.register_layout(handle.layout),
            reattach=lambda: self._attach_region(force=True))

    # -- plumbing -------------------------------------------------------------------
    def close(self) -> None:
        for future in list(self._releases):     # let async releases reach the server
            try:
                future.result(timeout=1.0)
            except (grpc.RpcError, grpc.FutureTimeoutError):
                pass
        if self._lookups is not None:
            self._lookups.close()
        self._data.close()
        self._channel.close()
        if self._region is not None:
            self._region.close()
            self._region = None

    def __enter__(self) -> "KVStoreClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method: str, fn: Callable[[], T], handle: LayoutHandle | None = None,
              retry: bool = True) -> T:
        attempts = 1 + (self.retries if retry else 0)
        reregistered = False
        reattached = False
        attempt = 0
        while True:
            try:
                return fn()
            except grpc.RpcError as exc:
                code = exc.code()
                reason = reason_of(exc)
                if not reattached and reason is Reason.SHM_TOKEN_STALE:
                    reattached = True             # the server restarted: map its new region
                    self._attach_region(force=True)
                    continue
                if (handle is not None and not reregistered
                        and reason is Reason.LAYOUT_UNKNOWN):
                    reregistered = True           # the server restarted: register again
                    self.register_layout(handle.layout)
                    continue
                attempt += 1
                if code in _RETRY_CODES and attempt < attempts:
                    time.sleep(min(0.05 * 2 ** attempt, 1.0))
                    continue
                raise from_rpc_error(exc, method) from None

    def _timeout_for(self, nbytes: int) -> float:
        # Bulk calls get extra time at a pessimistic 100 MB/s.
        return self.timeout + nbytes / 100e6

    @staticmethod
    def _packed(keys) -> pb.PackedKeys:
        """Keys for the wire; a Packed (kvstore_client.keys) passes through without the
        per-key checks, which cost ~0.3 ms for 4,096 keys."""
        if isinstance(keys, Packed):
            return pb.PackedKeys(data=keys.data, key_size=keys.size)
        data, size = pack_keys(keys)
        return pb.PackedKeys(data=data, key_size=size)

    # -- layouts --------------------------------------------------------------------
    def register_layout(self, layout: PageLayout) -> LayoutHandle:
        req = pb.RegisterLayoutRequest(layout=layout_to_proto(layout))
        resp = self._call("RegisterLayout", lambda: self._register(req, timeout=self.timeout))
        if resp.layout_id != layout.layout_id:
            raise KVStoreError(grpc.StatusCode.INTERNAL,
                               "server computed a different layout id: client and server "
                               "disagree on the layout encoding (version mismatch?)")
        return LayoutHandle(layout, resp.layout_id, resp.page_bytes, resp.layer_bytes)

    # -- pages ----------------------------------------------------------------------
    def put(self, ns: LayoutHandle, keys: Sequence[bytes], pages) -> PutResult:
        """Store pages (N, page_bytes) under keys; keys already present are skipped."""
        keys = list(keys)
        total = len(keys) * ns.page_bytes
        flat = as_uint8(pages, total)
        if keys and self.region() is not None:
            by_page = flat.reshape(len(keys), ns.page_bytes)
            with self.reserve(ns, keys) as res:
                copy_pages(by_page, res.region.mem, res.offsets, to_pool=True)
                stored = res.commit()
            return PutResult(stored, res.skipped, res.in_flight)
        mv = memoryview(flat)
        got = self._data.call("Put", ns, lambda f: f.put(ns.layout_id, *packed_keys(keys), mv))
        if got is not USE_GRPC:
            return PutResult(*got)
        header = pb.PutRequest(header=pb.PutHeader(layout_id=ns.layout_id,
                                                   keys=self._packed(keys)))

        def messages():
            yield header
            for start in range(0, total, CHUNK_BYTES):
                yield frame(PUT_DATA_TAG, (mv[start:start + CHUNK_BYTES],))

        def call():
            return self._put(messages(), timeout=self._timeout_for(total))

        resp = self._call("Put", call, ns)
        return PutResult(resp.stored, resp.skipped, resp.in_flight)

    def lookup(self, ns: LayoutHandle | Sequence[LayoutHandle], keys: Sequence[bytes]) -> int:
        """How many leading keys are stored (in every layout, when several are given)."""
        return self._lookup_call(ns, keys, 0).count

    def lookup_lease(self, ns: LayoutHandle | Sequence[LayoutHandle], keys: Sequence[bytes],
                     lease_ms: int) -> Lease:
        """Like lookup, and pin the counted pages for lease_ms (release_lease to end)."""
        if lease_ms <= 0:
            raise ValueError("lease_ms must be positive")
        resp = self._lookup_call(ns, keys, lease_ms)
        return Lease(resp.lease_id, resp.count)

    def _lookup_call(self, ns, keys, lease_ms: int) -> pb.LookupResponse:
        handles = [ns] if isinstance(ns, LayoutHandle) else list(ns)
        got = self._data.call("Lookup", handles[0], lambda f: f.lookup(
            [h.layout_id for h in handles], *packed_keys(keys), lease_ms))
        if got is not USE_GRPC:
            return pb.LookupResponse(count=got[0], lease_id=got[1])
        req = pb.LookupRequest(layout_ids=[h.layout_id for h in handles],
                               keys=self._packed(keys), lease_ms=lease_ms)

        def call():
            # The stream when it can answer, else the unary call (lookup_stream.py).
            response = None if self._lookups is None else self._lookups.ask(req, self.timeout)
            return response if response is not None else self._lookup(req, timeout=self.timeout)

        return self._call("Lookup", call, handles[0])

    def release_lease(self, lease: Lease | int) -> bool:
        lease_id = lease.lease_id if isinstance(lease, Lease) else lease
        if not lease_id:
            return False
        got = self._data.call("ReleaseLease", None, lambda f: f.release(lease_id))
        if got is not USE_GRPC:
            return got
        resp = self._call("ReleaseLease", lambda: self._release(
            pb.ReleaseLeaseRequest(lease_id=lease_id), timeout=self.timeout))
        return resp.released

    def exists(self, ns: LayoutHandle, keys: Sequence[bytes]) -> list[bool]:
        got = self._data.call("Exists", ns, lambda f: f.exists(ns.layout_id, *packed_keys(keys)))
        if got is not USE_GRPC:
            return got
        req = pb.ExistsRequest(layout_id=ns.layout_id, keys=self._packed(keys))
        resp = self._call("Exists", lambda: self._exists(req, timeout=self.timeout), ns)
        bits = np.unpackbits(np.frombuffer(resp.bitmap, dtype=np.uint8), bitorder="little")
        return bits[: resp.count].astype(bool).tolist()

    def delete(self, ns: LayoutHandle, keys: Sequence[bytes]) -> int:
        got = self._data.call("Delete", ns, lambda f: f.delete(ns.layout_id, *packed_keys(keys)))
        if got is not USE_GRPC:
            return got
        req = pb.DeleteRequest(layout_id=ns.layout_id, keys=self._packed(keys))
        return self._call("Delete", lambda: self._delete(req, timeout=self.timeout), ns).deleted

    def get(self, ns: LayoutHandle, keys: Sequence[bytes]) -> np.ndarray:
        """The pages of keys as a new (N, page_bytes) uint8 array; KeyError if one is missing."""
        keys = list(keys)
        # Page-aligned like the pool, so long runs copy at full speed (shm.copy_pages).
        out = page_aligned_empty((len(keys), ns.page_bytes))
        self.get_into(ns, keys, out)
        return out

    def get_into(self, ns: LayoutHandle, keys: Sequence[bytes], out) -> None:
        """Fill a caller's (N, page_bytes) buffer (numpy, torch CPU, pinned, bytearray)."""
        keys = list(keys)
        n, layers, lb = len(keys), ns.layout.num_layers, ns.layer_bytes
        flat = as_uint8(out, n * ns.page_bytes, writable=True, what="out")
        if keys and self.region() is not None:
            with self._acquire_or_keyerror(ns, keys) as acq:
                copy_pages(flat.reshape(n, ns.page_bytes), acq.region.mem, acq.offsets,
                           to_pool=False)
            return
        if keys:
            try:
                got = self._data.call("Get", ns, lambda f: f.get_into(
                    ns.layout_id, *packed_keys(keys), memoryview(flat), ns.page_bytes))
            except KVStoreError as exc:
                if exc.code == grpc.StatusCode.NOT_FOUND:
                    raise PagesMissing.of(exc) from None
                raise
            if got is not USE_GRPC:
                return
        by_layer = flat.reshape(n, layers, lb)
        self._stream(ns, keys, lambda layer: by_layer[:, layer, :])

    def get_layers(self, ns: LayoutHandle, keys: Sequence[bytes]
                   ) -> Iterator[tuple[int, np.ndarray]]:
        """Yield (layer, slab) as each layer arrives; slab is a contiguous
        (N, layer_bytes) array holding every page's bytes of that layer."""
        keys = list(keys)
        n, lb = len(keys), ns.layer_bytes
        slabs: dict[int, np.ndarray] = {}
        ready: list[int] = []

        def dest(layer: int) -> np.ndarray:
            slabs[layer] = np.empty((n, lb), dtype=np.uint8)
            return slabs[layer]

        if n == 0:
            return
        if self.region() is not None:
            with self._acquire_or_keyerror(ns, keys) as acq:
                for layer in range(ns.layout.num_layers):
                    slab = np.empty((n, lb), dtype=np.uint8)
                    copy_layer(slab, acq.region.mem, acq.offsets, layer, ns.page_bytes)
                    yield layer, slab
            return
        fast = self._data.fast()
        if fast is not None:
            try:
                yield from fast.get_layers(ns.layout_id, *packed_keys(keys),
                                           ns.layout.num_layers, lb,
                                           lambda layer: np.empty((n, lb), dtype=np.uint8))
                return
            except KVStoreError as exc:
                if exc.code == grpc.StatusCode.NOT_FOUND:
                    raise PagesMissing.of(exc) from None
                raise
            except FastPathUnavailable:     # raised before any layer: gRPC instead
                self._data.drop(fast)
        req = pb.GetRequest(layout_id=ns.layout_id, keys=self._packed(keys))
        writer = LayerMajorWriter(n, ns.layout.num_layers, lb, dest, ready.append)
        try:
            for payload in self._get(req, timeout=self._timeout_for(n * ns.page_bytes)):
                writer.write(payload)
                while ready:
                    layer = ready.pop(0)
                    yield layer, slabs.pop(layer)
        except grpc.RpcError as exc:
            self._raise_get(exc)
        if not writer.done:
            raise KVStoreError(grpc.StatusCode.DATA_LOSS,
                               f"Get ended after {writer.pos} of {writer.total} bytes", "Get")

    def _stream(self, ns: LayoutHandle, keys: list[bytes],
                dest: Callable[[int], np.ndarray]) -> None:
        n = len(keys)
        if n == 0:
            return
        req = pb.GetRequest(layout_id=ns.layout_id, keys=self._packed(keys))

        def call():
            writer = LayerMajorWriter(n, ns.layout.num_layers, ns.layer_bytes, dest)
            for payload in self._get(req, timeout=self._timeout_for(n * ns.page_bytes)):
                writer.write(payload)
            if not writer.done:
                raise KVStoreError(grpc.StatusCode.DATA_LOSS,
                                   f"Get ended after {writer.pos} of {writer.total} bytes", "Get")

        try:
            self._call("Get", call, ns)
        except KVStoreError as exc:
            if exc.code == grpc.StatusCode.NOT_FOUND:
                raise PagesMissing.of(exc) from None
            raise

    @staticmethod
    def _raise_get(exc: grpc.RpcError):
        err = from_rpc_error(exc, "Get")
        if err.code == grpc.StatusCode.NOT_FOUND:
            raise PagesMissing.of(err) from None
        raise err from None

    # -- same-host data plane ---------------------------------------------------------
    def region(self) -> SharedRegion | None:
        """The server's pool mapped here, or None when only gRPC can be used."""
        if self._region is None and not self._region_tried and self.shared_memory is not False:
            self._attach_region()
        return self._region

    def _attach_region(self, force: bool = False) -> None:
        with self._region_lock:
            if self._region_tried and not force:
                return
            self._region_tried = True
            old, self._region = self._region, None
            try:
                resp = self._call("Attach", lambda: self._attach(pb.AttachRequest(),
                                                                 timeout=self.timeout))
                self._region = SharedRegion(resp.path, resp.size, resp.token_offset)
                log.debug("mapped the server's pool %s (%d bytes)", resp.path, resp.size)
            except (OSError, KVStoreError) as exc:
                if isinstance(exc, KVStoreError) and exc.code in _RETRY_CODES:
                    self._region_tried = False    # the server is down: ask again later
                if self.shared_memory:
                    raise KVStoreError(grpc.StatusCode.FAILED_PRECONDITION,
                                       f"shared memory was required but the server's pool "
                                       f"cannot be mapped: {exc}", "Attach") from None
                log.info("server pool not mappable from here (%s); using gRPC for page bytes",
                         exc)
            finally:
                if old is not None:
                    old.close()

    def _need_region(self) -> SharedRegion:
        region = self.region()
        if region is None:
            raise KVStoreError(grpc.StatusCode.FAILED_PRECONDITION,
                               "the server's shared-memory pool is not mapped (another host, "
                               "or shared_memory=False)")
        return region

    def reserve(self, ns: LayoutHandle, keys: Sequence[bytes], lease_ms: int = 0) -> Reservation:
        """WRITING slots in the shared pool for the keys not yet stored (two-phase put).
        Write `views[i]`, then `commit()`; or `abort()`. lease_ms 0 = the server's ttl."""
        def fast(f):
            region = self._need_region()      # read per attempt: see the gRPC call below
            return region, f.reserve(ns.layout_id, *packed_keys(keys), region.token, lease_ms)

        got = self._data.call("Reserve", ns, fast)
        if got is not USE_GRPC:
            region, r = got
            return Reservation(ns, r.lease_id, r.offsets, r.skipped, region,
                               self._commit_lease, self._abort_lease, r.in_flight)
        packed = self._packed(keys)

        def call():
            # Offsets are valid only in the region whose token the server accepted, so
            # the token sent and the region returned come from one read of the mapping,
            # made again on each attempt: a retry after _call re-attached (the server
            # restarted) sends the new token and pairs the answer with the new mapping.
            region = self._need_region()
            return region, self._reserve(pb.ReserveRequest(
                layout_id=ns.layout_id, keys=packed, token=region.token, lease_ms=lease_ms),
                timeout=self.timeout)

        region, resp = self._call("Reserve", call, ns)
        offsets = np.frombuffer(resp.offsets, dtype="<i8")
        return Reservation(ns, resp.lease_id, offsets, resp.skipped, region,
                           self._commit_lease, self._abort_lease, resp.in_flight)

    def acquire(self, ns: LayoutHandle, keys: Sequence[bytes], lease_ms: int = 0) -> Acquired:
        """Pin the pages of keys in the shared pool and return read-only views of them;
        `release()` when done. NOT_FOUND (KVStoreError) if a key is missing."""
        def fast(f):
            region = self._need_region()      # read per attempt: see reserve
            return region, f.acquire(ns.layout_id, *packed_keys(keys), region.token, lease_ms)

        got = self._data.call("Acquire", ns, fast)
        if got is not USE_GRPC:
            region, r = got
            return Acquired(ns, r.lease_id, r.offsets, region, self._release_later)
        packed = self._packed(keys)

        def call():
            region = self._need_region()      # read per attempt: see reserve
            return region, self._acquire(pb.AcquireRequest(
                layout_id=ns.layout_id, keys=packed, token=region.token, lease_ms=lease_ms),
                timeout=self.timeout)

        region, resp = self._call("Acquire", call, ns)
        offsets = np.frombuffer(resp.offsets, dtype="<i8")
        return Acquired(ns, resp.lease_id, offsets, region, self._release_later)

    def _release_later(self, lease_id: int) -> None:
        """End a lease without waiting for the answer: the caller has finished reading,
        and a lost release only costs the pages their pin until the lease expires."""
        if self._data.call("ReleaseLease", None,
                           lambda f: f.release_later(lease_id)) is not USE_GRPC:
            return
        future = self._release.future(pb.ReleaseLeaseRequest(lease_id=lease_id),
                                      timeout=self.timeout)
        self._releases.add(future)
        future.add_done_callback(self._release_done)

    def _release_done(self, future: grpc.Future) -> None:
        self._releases.discard(future)
        _log_release_failure(future)

    def _acquire_or_keyerror(self, ns: LayoutHandle, keys: Sequence[bytes]) -> Acquired:
        try:
            return self.acquire(ns, keys)
        except KVStoreError as exc:
            if exc.code == grpc.StatusCode.NOT_FOUND:
                raise PagesMissing.of(exc) from None
            raise

    def _commit_lease(self, lease_id: int) -> int:
        got = self._data.call("Commit", None, lambda f: f.commit(lease_id))
        if got is not USE_GRPC:
            return got
        return self._call("Commit", lambda: self._commit(pb.CommitRequest(lease_id=lease_id),
                                                         timeout=self.timeout)).stored

    def _abort_lease(self, lease_id: int) -> bool:
        got = self._data.call("Abort", None, lambda f: f.abort(lease_id))
        if got is not USE_GRPC:
            return got
        return self._call("Abort", lambda: self._abort(pb.AbortRequest(lease_id=lease_id),
                                                       timeout=self.timeout)).aborted

    # -- admin ----------------------------------------------------------------------
    def stats(self) -> apb.StatsResponse:
        return self._call("Stats", lambda: self._stats(apb.StatsRequest(), timeout=self.timeout))

    def list_layouts(self) -> list[apb.LayoutStats]:
        return list(self._call("ListLayouts", lambda: self._list(
            apb.ListLayoutsRequest(), timeout=self.timeout)).layouts)

    def evict(self, *, layout_id: bytes | None = None, nbytes: int | None = None,
              everything: bool = False, tier: str = "dram",
              force: bool = False) -> apb.EvictResponse:
        """Evict from tier "dram" (pages move to disk, if any), "disk" or "all". force:
        first end every lease and reservation clients hold (clients that died)."""
        if sum(x is not None and x is not False for x in (layout_id, nbytes, everything)) != 1:
            raise ValueError("evict needs exactly one of layout_id, nbytes, everything")
        if layout_id is not None:
            req = apb.EvictRequest(layout_id=layout_id, tier=tier, force=force)
        elif nbytes is not None:
            req = apb.EvictRequest(bytes=nbytes, tier=tier, force=force)
        else:
            req = apb.EvictRequest(all=True, tier=tier, force=force)
        return self._call("Evict", lambda: self._evict(req, timeout=self.timeout), retry=False)

    def clear(self, force: bool = False) -> apb.ClearResponse:
        """Delete every page; force: end clients' leases and reservations first."""
        return self._call("Clear", lambda: self._clear(apb.ClearRequest(force=force),
                                                       timeout=self.timeout), retry=False)

    def inspect(self, layout_id: bytes, key: bytes) -> apb.InspectResponse:
        return self._call("Inspect", lambda: self._inspect(
            apb.InspectRequest(layout_id=layout_id, key=key), timeout=self.timeout))


def _log_release_failure(future: grpc.Future) -> None:
    if future.exception() is not None:
        log.warning("releasing a lease failed (%s); it expires by itself",
                    future.exception())


def layout_of(stats: apb.LayoutStats) -> PageLayout:
    """The PageLayout of a ListLayouts/Stats entry."""
    return layout_from_proto(stats.layout)
