"""KVStoreClient: register layouts, put, look up, get and delete KV pages.

On the same host as the server, page bytes move through the server's shared-memory pool
(kvstore_client.shm) and gRPC carries only offsets and leases; elsewhere they stream over
gRPC. `put`, `get`, `get_into` and `get_layers` pick the path by themselves.

KVStoreClient is the facade that picks the path; the parts are modules of their own:
the gRPC stubs, retries and restart recoveries (rpc.py), the mapped region (attach.py),
the fast path beside gRPC (dataplane.py), and the Admin service as dataclasses (admin.py,
also `client.admin`). Every call has a timeout; puts are idempotent (keys already stored
are skipped by the server).
Over 400 lines because each page call keeps its three paths (shared memory, fast path,
gRPC) side by side, so that a reader sees in one place which one runs and why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import weakref
from collections.abc import Callable, Generator, Sequence

import grpc
import numpy as np

from kvstore_protocol._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore_protocol.convert import layout_to_proto
from kvstore_protocol.grpc_frames import PUT_DATA_TAG, frame
from kvstore_protocol.keys import Packed
from kvstore_protocol.layout import PageLayout

from .admin import AdminClient, ClearResult, EvictResult, LayoutStats, PageInfo, Stats
from .attach import RegionAttachment
from .buffers import LayerMajorWriter, as_uint8, page_aligned_empty
from .channel import PEM, open_channel, with_token
from .dataplane import USE_GRPC, DataPlane, packed_keys, tls_context
from .errors import KVStoreError, PagesMissing, from_rpc_error
from .fastpath import FastPathUnavailable
from .handles import LayoutHandle, Lease, Pins, PutResult
from .layerget import Dest, LayerGet
from .rpc import Rpc, packed
from .shm import Acquired, Reservation, SharedRegion, copy_layer, copy_pages

__all__ = ["KVStoreClient", "LayoutHandle", "Lease", "PutResult", "Removal", "Removals",
           "Retention"]

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20          # Put data messages; matches the server's Get chunks


@dataclasses.dataclass(frozen=True, slots=True)
class Retention:
    """What KVStoreClient.retain did: the prefix's leading pages in DRAM (kept, unless
    refused) and, where the server refused (quota, session cap, retention off), why."""

    pages: int
    refused: str = ""           # "" = retained

    @property
    def retained(self) -> bool:
        return not self.refused


@dataclasses.dataclass(frozen=True, slots=True)
class Removal:
    """A page that left the server: key b"" means every page of the layout."""

    seq: int
    layout_id: bytes            # the client's id, as registered
    key: bytes
    cause: int                  # 1 evicted, 2 deleted, 3 invalidated (kvstore_server.removals)


@dataclasses.dataclass(frozen=True, slots=True)
class Removals:
    """One read of the server's removal ring (KVStoreClient.removals)."""

    epoch: int
    next_seq: int               # pass back as after_seq, with epoch
    gap: bool                   # entries were lost: assume every page of the layouts gone
    more: bool                  # stopped at the limit: read again at once
    entries: tuple[Removal, ...]


# What one RetainMany may carry: the server's default bounds (--max-keys-per-request).
_RETAIN_SESSIONS = 1024
_RETAIN_KEYS = 16384


def _retain_parts(asks: Sequence[tuple[str, float, Sequence[bytes]]]
                  ) -> list[list[tuple[str, float, Sequence[bytes]]]]:
    """The asks in calls the server takes: at most _RETAIN_SESSIONS sessions, and keys
    (counted per session, a bound on the distinct ones too) at most _RETAIN_KEYS."""
    parts: list[list[tuple[str, float, Sequence[bytes]]]] = [[]]
    named = 0
    for ask in asks:
        n = len(ask[2])
        if parts[-1] and (len(parts[-1]) >= _RETAIN_SESSIONS or named + n > _RETAIN_KEYS):
            parts.append([])
            named = 0
        parts[-1].append(ask)
        named += n
    return [p for p in parts if p]


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
    or Unix socket path (None = the server's: the Unix socket Attach names on this host,
    else the gRPC port + 1); data_connections: most connections one Get is striped over.
    local_socket: with shared_memory=False, still reach the fast path over the server's
    Unix socket when this host has it (a client that only asks and leases).
    """

    def __init__(self, address: str, *, timeout: float = 10.0, retries: int = 3,
                 shared_memory: bool | None = None, token: str | None = None,
                 tls_ca: PEM | None = None, tls_cert: PEM | None = None,
                 tls_key: PEM | None = None, lookup_stream: bool = True,
                 channel: grpc.Channel | None = None, data_plane: bool | None = None,
                 data_address: str | None = None, data_connections: int = 4,
                 local_socket: bool = False) -> None:
        self.address = address
        self._releases: set[grpc.Future] = set()   # lease releases still in flight
        self._channel = (with_token(channel, token) if channel is not None else
                         open_channel(address, token=token, tls_ca=tls_ca, tls_cert=tls_cert,
                                      tls_key=tls_key))
        self._rpc = Rpc(self._channel, timeout=timeout, retries=retries,
                        lookup_stream=lookup_stream,
                        reattach=lambda: self._shm.attach(force=True),
                        reregister=lambda handle: self.register_layout(handle.layout))
        self._lookups = self._rpc.lookups
        if self._lookups is not None:
            # A client dropped without close() would keep its stream, and a server thread,
            # open until the server's idle timeout (5 minutes): close it with the client
            # (not at interpreter exit, where the process's end closes it anyway).
            weakref.finalize(self, self._lookups.close).atexit = False
        self._shm = RegionAttachment(self._rpc, shared_memory)
        # Lookups may be answered from the server's presence map when this client may be
        # on its host (kvstore_client.presence); how many were.
        self._presence_ok = shared_memory is not False or local_socket
        self.presence_misses = 0
        self.admin = AdminClient(self._rpc)
        self._data = DataPlane(
            address, enabled=data_plane, data_address=data_address, token=token,
            tls=tls_context(tls_ca, tls_cert, tls_key), timeout=lambda: self.timeout,
            connections=data_connections, region=self.region,
            reregister=lambda handle: self.register_layout(handle.layout),
            reattach=lambda keep: self._shm.attach(force=True, keep=keep),
            identity=self._shm.identity,
            locate=(self._shm.local_socket
                    if local_socket or (data_address and "/" in data_address) else None))

    # Settings that may be changed at any time, kept where they are used.
    @property
    def timeout(self) -> float:
        return self._rpc.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._rpc.timeout = seconds

    @property
    def retries(self) -> int:
        return self._rpc.retries

    @retries.setter
    def retries(self, n: int) -> None:
        self._rpc.retries = n

    @property
    def shared_memory(self) -> bool | None:
        return self._shm.shared_memory

    # -- plumbing -------------------------------------------------------------------
    def close(self) -> None:
        for future in list(self._releases):     # let async releases reach the server
            with contextlib.suppress(grpc.RpcError, grpc.FutureTimeoutError):
                future.result(timeout=1.0)
        self._data.close()
        self._rpc.close()
        self._shm.close()

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- layouts --------------------------------------------------------------------
    def register_layout(self, layout: PageLayout) -> LayoutHandle:
        req = pb.RegisterLayoutRequest(layout=layout_to_proto(layout))
        resp = self._rpc.call("RegisterLayout", lambda: self._rpc.register(req, timeout=self.timeout))
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
        mv = flat.data
        got = self._data.call("Put", ns, lambda f: f.put(ns.layout_id, *packed_keys(keys), mv))
        if got is not USE_GRPC:
            return PutResult(*got)
        header = pb.PutRequest(header=pb.PutHeader(layout_id=ns.layout_id,
                                                   keys=packed(keys)))

        def messages():
            yield header
            for start in range(0, total, CHUNK_BYTES):
                yield frame(PUT_DATA_TAG, (mv[start:start + CHUNK_BYTES],))

        def call():
            return self._rpc.put(messages(), timeout=self._rpc.timeout_for(total))

        resp = self._rpc.call("Put", call, ns)
        return PutResult(resp.stored, resp.skipped, resp.in_flight)

    def lookup(self, ns: LayoutHandle | Sequence[LayoutHandle],
               keys: Sequence[bytes] | Packed) -> int:
        """How many leading keys are stored (in every layout, when several are given)."""
        return self._lookup_call(ns, keys, 0)[0].count

    def lookup_lease(self, ns: LayoutHandle | Sequence[LayoutHandle],
                     keys: Sequence[bytes] | Packed,
                     lease_ms: int, pins: bool = False) -> Lease:
        """Like lookup, and pin the counted pages for lease_ms (release_lease to end).

        pins: also ask where the pages lie in the server's shared pool (Lease.pins), for
        a process on the server's host to read them under this lease. Answered over the
        fast path to a tenant that may map the pool, else None. A lease with pins is not
        ended by the connection closing: release it, or it lasts its ttl."""
        if lease_ms <= 0:
            raise ValueError("lease_ms must be positive")
        resp, got_pins = self._lookup_call(ns, keys, lease_ms, pins)
        return Lease(resp.lease_id, resp.count, got_pins)

    def _lookup_call(self, ns, keys, lease_ms: int, pins: bool = False
                     ) -> tuple[pb.LookupResponse, Pins | None]:
        handles = [ns] if isinstance(ns, LayoutHandle) else list(ns)
        ids = [h.layout_id for h in handles]
        key_size, data = packed_keys(keys)
        if self._presence_ok and data and self._missed_here(ids, key_size, data):
            return pb.LookupResponse(count=0, lease_id=0), None
        got = self._data.call("Lookup", handles[0], lambda f: f.lookup(
            ids, key_size, data, lease_ms, pins))
        if got is not USE_GRPC:
            return pb.LookupResponse(count=got[0], lease_id=got[1]), got[2]
        req = pb.LookupRequest(layout_ids=[h.layout_id for h in handles],
                               keys=packed(keys), lease_ms=lease_ms)

        def call():
            # The stream when it can answer, else the unary call (lookup_stream.py).
            response = None if self._lookups is None else self._lookups.ask(req, self.timeout)
            return response if response is not None else self._rpc.lookup(req, timeout=self.timeout)

        return self._rpc.call("Lookup", call, handles[0]), None

    def _missed_here(self, layout_ids: list[bytes], key_size: int, data: bytes) -> bool:
        """Whether the server's presence map (kvstore_client.presence) proves the first key
        absent, so the lookup counts 0 with no round trip; the server is still sent the
        lookup, unanswered, for its hit and miss counts (FastPath.lookup_later)."""
        fast = self._data.fast()
        if fast is None:
            return False                  # nothing to tell the server's counts by
        presence = self._shm.presence()
        if presence is None or not presence.absent(layout_ids, data[:key_size]):
            return False
        if not fast.lookup_later(layout_ids, key_size, data):
            return False
        self.presence_misses += 1
        return True

    def release_lease(self, lease: Lease | int, pages_read: int = 0) -> bool:
        """End a lease. pages_read: of a leased lookup's pages, those read from the shared
        pool with no Acquire (in each layout), for the server's served count."""
        lease_id = lease.lease_id if isinstance(lease, Lease) else lease
        if not lease_id:
            return False
        got = self._data.call("ReleaseLease", None, lambda f: f.release(lease_id, pages_read))
        if got is not USE_GRPC:
            return got
        resp = self._rpc.call("ReleaseLease", lambda: self._rpc.release(
            pb.ReleaseLeaseRequest(lease_id=lease_id, pages_read=pages_read),
            timeout=self.timeout))
        return resp.released

    def exists(self, ns: LayoutHandle, keys: Sequence[bytes]) -> list[bool]:
        got = self._data.call("Exists", ns, lambda f: f.exists(ns.layout_id, *packed_keys(keys)))
        if got is not USE_GRPC:
            return got
        req = pb.ExistsRequest(layout_id=ns.layout_id, keys=packed(keys))
        resp = self._rpc.call("Exists", lambda: self._rpc.exists(req, timeout=self.timeout), ns)
        bits = np.unpackbits(np.frombuffer(resp.bitmap, dtype=np.uint8), bitorder="little")
        return bits[: resp.count].astype(bool).tolist()

    def delete(self, ns: LayoutHandle, keys: Sequence[bytes]) -> int:
        got = self._data.call("Delete", ns, lambda f: f.delete(ns.layout_id, *packed_keys(keys)))
        if got is not USE_GRPC:
            return got
        req = pb.DeleteRequest(layout_id=ns.layout_id, keys=packed(keys))
        return self._rpc.call("Delete", lambda: self._rpc.delete(req, timeout=self.timeout), ns).deleted

    # -- session retention (gRPC only: one call a turn, off the hot path) ---------------
    def retain(self, ns: LayoutHandle, keys: Sequence[bytes], session: str,
               ttl: float) -> Retention:
        """Ask the server to keep the prefix `keys` (its leading run in DRAM) from
        eviction for `session` during ttl seconds (more than 0, at most a day). Again
        under the same session: adds pages, and the ttl starts anew. A refusal (the
        tenant's retention quota or session cap) is an answer, not an error."""
        req = pb.RetainRequest(layout_id=ns.layout_id, keys=packed(keys), session=session,
                               ttl_ms=max(1, round(ttl * 1000)) if ttl > 0 else 0)
        resp = self._rpc.call("Retain", lambda: self._rpc.retain(req, timeout=self.timeout), ns)
        return Retention(resp.pages, resp.refused)

    # -- removals (gRPC only: a poll every fraction of a second, off the hot path) --------
    def removals(self, handles: Sequence[LayoutHandle], after_seq: int = 0, epoch: int = 0,
                 limit: int = 0) -> Removals:
        """Pages of these layouts that left the server after the cursor (after_seq of
        epoch); epoch 0 starts a cursor at the newest removal and returns none. limit: at
        most this many (0 = the server's cap, 16384)."""
        ids = [h.layout_id for h in handles]
        req = pb.RemovalsRequest(layout_ids=ids, after_seq=after_seq, epoch=epoch,
                                 limit=limit)
        resp = self._rpc.call("Removals", lambda: self._rpc.removals(req, timeout=self.timeout),
                              handles[0] if len(handles) == 1 else None)
        entries, at = [], 0
        for seq, index, cause, size in zip(resp.seqs, resp.layout_index, resp.causes,
                                           resp.key_sizes, strict=True):
            entries.append(Removal(seq, ids[index], resp.keys[at:at + size], cause))
            at += size
        return Removals(resp.epoch, resp.next_seq, resp.gap, resp.more, tuple(entries))

    def retain_many(self, ns: LayoutHandle,
                    asks: Sequence[tuple[str, float, Sequence[bytes]]]) -> list[Retention]:
        """Several retains at once, (session, ttl, keys) each, answered in order as
        retain answers each: one call (a few when past the server's bounds) instead of one
        a session; a prefix the sessions share is sent once."""
        out: list[Retention] = []
        for part in _retain_parts(asks):
            table: dict[bytes, int] = {}
            sessions = []
            for session, ttl, keys in part:
                idx = np.array([table.setdefault(k, len(table)) for k in keys], dtype="<u4")
                sessions.append(pb.RetainSession(
                    session=session, ttl_ms=max(1, round(ttl * 1000)) if ttl > 0 else 0,
                    key_index=idx.tobytes()))
            req = pb.RetainManyRequest(layout_id=ns.layout_id, keys=packed(list(table)),
                                       sessions=sessions)
            out += self._retain_part(ns, req)
        return out

    def _retain_part(self, ns: LayoutHandle, req: pb.RetainManyRequest) -> list[Retention]:
        resp = self._rpc.call("RetainMany", lambda: self._rpc.retain_many(
            req, timeout=self.timeout), ns)
        return [Retention(r.pages, r.refused) for r in resp.results]

    def release_retention(self, session: str) -> int:
        """End a session's retention now: the pages it kept (0: no such session)."""
        req = pb.ReleaseRetentionRequest(session=session)
        return self._rpc.call("ReleaseRetention", lambda: self._rpc.release_retention(
            req, timeout=self.timeout)).pages

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
                    ns.layout_id, *packed_keys(keys), flat.data, ns.page_bytes))
            except KVStoreError as exc:
                raise PagesMissing.of(exc) from None
            if got is not USE_GRPC:
                return
        by_layer = flat.reshape(n, layers, lb)
        self._stream(ns, keys, lambda layer: by_layer[:, layer, :])

    def get_layers(self, ns: LayoutHandle, keys: Sequence[bytes], dest: Dest | None = None,
                   stop: threading.Event | None = None
                   ) -> Generator[tuple[int, np.ndarray], None, None]:
        """Yield (layer, slab) as each layer arrives; slab is a contiguous (N, layer_bytes)
        array holding every page's bytes of that layer: a new one, or dest(layer), the
        caller's (pinned memory, say; called once per layer, it may block until one is
        free). Over the fast path a large get is striped over the pooled connections
        (kvstore_client.layerget); setting `stop` from another thread ends it (the
        iteration raises), and a failing get sets it, so a dest that waits can give up."""
        keys = list(keys)
        n, lb = len(keys), ns.layer_bytes
        if n == 0:
            return
        dest = dest or (lambda layer: np.empty((n, lb), dtype=np.uint8))
        if self.region() is not None:
            with self._acquire_or_keyerror(ns, keys) as acq:
                for layer in range(ns.layout.num_layers):
                    slab = dest(layer)
                    copy_layer(slab, acq.region.mem, acq.offsets, layer, ns.page_bytes)
                    yield layer, slab
            return
        fast = self._data.fast()
        if fast is not None:
            try:
                yield from LayerGet(fast, ns.layout_id, *packed_keys(keys), ns.layout.num_layers,
                                    lb, dest, stop, lambda: self.register_layout(ns.layout))
                return
            except KVStoreError as exc:
                raise PagesMissing.of(exc) from None
            except FastPathUnavailable:     # raised before any layer: gRPC instead
                self._data.drop(fast)
        req = pb.GetRequest(layout_id=ns.layout_id, keys=packed(keys))
        slabs: dict[int, np.ndarray] = {}      # what dest gave, until yielded
        ready: list[int] = []
        writer = LayerMajorWriter(n, ns.layout.num_layers, lb,
                                  lambda layer: slabs.setdefault(layer, dest(layer)), ready.append)
        try:
            for payload in self._rpc.get(req, timeout=self._rpc.timeout_for(n * ns.page_bytes)):
                writer.write(payload)
                while ready:
                    layer = ready.pop(0)
                    yield layer, slabs.pop(layer)
                if stop is not None and stop.is_set():
                    raise KVStoreError(grpc.StatusCode.CANCELLED, "the get was stopped", "Get")
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
        req = pb.GetRequest(layout_id=ns.layout_id, keys=packed(keys))

        def call():
            writer = LayerMajorWriter(n, ns.layout.num_layers, ns.layer_bytes, dest)
            for payload in self._rpc.get(req, timeout=self._rpc.timeout_for(n * ns.page_bytes)):
                writer.write(payload)
            if not writer.done:
                raise KVStoreError(grpc.StatusCode.DATA_LOSS,
                                   f"Get ended after {writer.pos} of {writer.total} bytes", "Get")

        try:
            self._rpc.call("Get", call, ns)
        except KVStoreError as exc:
            raise PagesMissing.of(exc) from None

    @staticmethod
    def _raise_get(exc: grpc.RpcError):
        err = from_rpc_error(exc, "Get")
        if err.code == grpc.StatusCode.NOT_FOUND:
            raise PagesMissing.of(err) from None
        raise err from None

    # -- same-host data plane ---------------------------------------------------------
    def region(self) -> SharedRegion | None:
        """The server's pool mapped here, or None when only gRPC can be used."""
        return self._shm.region()

    def reserve(self, ns: LayoutHandle, keys: Sequence[bytes], lease_ms: int = 0) -> Reservation:
        """WRITING slots in the shared pool for the keys not yet stored (two-phase put).
        Write `views[i]`, then `commit()`; or `abort()`. lease_ms 0 = the server's ttl."""
        def fast(f):
            region = self._shm.need()      # read per attempt: see the gRPC call below
            return region, f.reserve(ns.layout_id, *packed_keys(keys), region.token, lease_ms)

        got = self._data.call("Reserve", ns, fast)
        if got is not USE_GRPC:
            region, r = got
            return Reservation(ns, r.lease_id, r.offsets, r.skipped, region,
                               self._commit_lease, self._abort_lease, r.in_flight)
        wire_keys = packed(keys)

        def call():
            # Offsets are valid only in the region whose token the server accepted, so
            # the token sent and the region returned come from one read of the mapping,
            # made again on each attempt: a retry after _call re-attached (the server
            # restarted) sends the new token and pairs the answer with the new mapping.
            region = self._shm.need()
            return region, self._rpc.reserve(pb.ReserveRequest(
                layout_id=ns.layout_id, keys=wire_keys, token=region.token, lease_ms=lease_ms),
                timeout=self.timeout)

        region, resp = self._rpc.call("Reserve", call, ns)
        offsets = np.frombuffer(resp.offsets, dtype="<i8")
        return Reservation(ns, resp.lease_id, offsets, resp.skipped, region,
                           self._commit_lease, self._abort_lease, resp.in_flight)

    def acquire(self, ns: LayoutHandle, keys: Sequence[bytes], lease_ms: int = 0) -> Acquired:
        """Pin the pages of keys in the shared pool and return read-only views of them;
        `release()` when done. NOT_FOUND (KVStoreError) if a key is missing."""
        def fast(f):
            region = self._shm.need()      # read per attempt: see reserve
            return region, f.acquire(ns.layout_id, *packed_keys(keys), region.token, lease_ms)

        got = self._data.call("Acquire", ns, fast)
        if got is not USE_GRPC:
            region, r = got
            return Acquired(ns, r.lease_id, r.offsets, region, self._release_later)
        wire_keys = packed(keys)

        def call():
            region = self._shm.need()      # read per attempt: see reserve
            return region, self._rpc.acquire(pb.AcquireRequest(
                layout_id=ns.layout_id, keys=wire_keys, token=region.token, lease_ms=lease_ms),
                timeout=self.timeout)

        region, resp = self._rpc.call("Acquire", call, ns)
        offsets = np.frombuffer(resp.offsets, dtype="<i8")
        return Acquired(ns, resp.lease_id, offsets, region, self._release_later)

    def _release_later(self, lease_id: int) -> None:
        """End a lease without waiting for the answer: the caller has finished reading,
        and a lost release only costs the pages their pin until the lease expires."""
        if self._data.call("ReleaseLease", None,
                           lambda f: f.release_later(lease_id)) is not USE_GRPC:
            return
        future = self._rpc.release.future(pb.ReleaseLeaseRequest(lease_id=lease_id),
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
        return self._rpc.call("Commit", lambda: self._rpc.commit(pb.CommitRequest(lease_id=lease_id),
                                                         timeout=self.timeout)).stored

    def _abort_lease(self, lease_id: int) -> bool:
        got = self._data.call("Abort", None, lambda f: f.abort(lease_id))
        if got is not USE_GRPC:
            return got
        return self._rpc.call("Abort", lambda: self._rpc.abort(pb.AbortRequest(lease_id=lease_id),
                                                       timeout=self.timeout)).aborted

    # -- admin (kvstore_client.admin: dataclasses, not protobuf messages) ----------------
    def stats(self) -> Stats:
        return self.admin.stats()

    def list_layouts(self) -> list[LayoutStats]:
        return self.admin.list_layouts()

    def evict(self, *, layout_id: bytes | None = None, nbytes: int | None = None,
              everything: bool = False, tier: str = "dram", force: bool = False) -> EvictResult:
        """Evict from tier "dram" (pages move to disk, if any), "disk", "far" or "all".
        force: first end every lease and reservation clients hold (clients that died)."""
        return self.admin.evict(layout_id=layout_id, nbytes=nbytes, everything=everything,
                                tier=tier, force=force)

    def clear(self, force: bool = False) -> ClearResult:
        """Delete every page; force: end clients' leases and reservations first."""
        return self.admin.clear(force)

    def inspect(self, layout_id: bytes, key: bytes) -> PageInfo:
        return self.admin.inspect(layout_id, key)


def _log_release_failure(future: grpc.Future) -> None:
    if future.exception() is not None:
        log.warning("releasing a lease failed (%s); it expires by itself",
                    future.exception())
