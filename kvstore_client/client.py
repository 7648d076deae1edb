"""KVStoreClient: register layouts, put, look up, get and delete KV pages.

On the same host as the server, page bytes move through the server's shared-memory pool
(kvstore_client.shm) and gRPC carries only offsets and leases; elsewhere they stream over
gRPC. `put`, `get`, `get_into` and `get_layers` pick the path by themselves.

Each page call reads "shared memory, else transport.op(...)": the mapped region
(attach.py, shm.py) where this host has it, else one call through the chooser
(dataplane.py), which runs it on the fast path or on gRPC (transport.py names what both
answer; grpc_transport.py, fastpath.py) and mends a server restart in one loop. The Admin
service is in admin.py (also `client.admin`), as dataclasses. Every call has a timeout;
puts are idempotent (keys already stored are skipped by the server).

Over 400 lines because KVStoreClient is the one public face of the library, about 30
short methods. Session retention and the removals feed (off the hot path, Transport.unary:
Retention, Removal, Removals and their calls, about 110 lines) are a second idea and the
next split.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Generator, Sequence

import grpc
import numpy as np

from kvstore_protocol._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore_protocol.congestion import check_congestion
from kvstore_protocol.convert import layout_to_proto
from kvstore_protocol.keys import Packed
from kvstore_protocol.layout import PageLayout

from .admin import AdminClient, ClearResult, EvictResult, LayoutStats, PageInfo, Stats
from .attach import RegionAttachment
from .buffers import as_uint8, byte_view, page_aligned_empty
from .channel import PEM, open_channel, with_token
from .dataplane import Chooser, packed_keys, tls_context
from .errors import KVStoreError, PagesMissing
from .fastpath import FastPath
from .grpc_transport import GrpcTransport
from .layerget import Dest, Landed
from .lookup_stream import LookupStream
from .presence import PresenceMap
from .results import LayoutHandle, Lease, Pins, PutResult
from .rpc import Rpc, packed
from .shm import Acquired, Reservation, SharedRegion, copy_layer, copy_pages
from .transport import Transport

__all__ = ["KVStoreClient", "LayoutHandle", "Lease", "PutResult", "Removal", "Removals",
           "Retention", "ServerLimits"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class Retention:
    """What KVStoreClient.retain did: the prefix's leading pages in DRAM (kept, unless
    refused) and, where the server refused (quota, session cap, retention off), why."""

    pages: int
    refused: str = ""           # "" = retained
    held: int = 0               # pages the session keeps after it (0: none, or an older
                                # server that does not say)

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


@dataclasses.dataclass(frozen=True, slots=True)
class ServerLimits:
    """What one request may ask for on the server (KVStoreClient.limits)."""

    max_keys_per_request: int
    max_request_bytes: int      # one request message
    max_lookup_layouts: int     # layouts one lookup or removals read may name
    max_retain_sessions: int    # sessions one retain_many call may name


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
    Unix socket when this host has it (a client that only asks and leases). clock: the
    monotonic clock the presence map's heartbeat is compared with (a test may advance it).
    data_congestion: the TCP congestion control of the fast path's TCP connections, what
    a Put's pages are sent under, e.g. "reno" ("" = the host's; a name the host lacks or
    does not let this user pick: ValueError here; docs/fastpath.md says when to set it).
    """

    def __init__(self, address: str, *, timeout: float = 10.0, retries: int = 3,
                 shared_memory: bool | None = None, token: str | None = None,
                 tls_ca: PEM | None = None, tls_cert: PEM | None = None,
                 tls_key: PEM | None = None, lookup_stream: bool = True,
                 channel: grpc.Channel | None = None, data_plane: bool | None = None,
                 data_address: str | None = None, data_connections: int = 4,
                 local_socket: bool = False,
                 clock: Callable[[], float] = time.monotonic,
                 data_congestion: str = "") -> None:
        self.address = address
        if data_congestion:
            # A name this host lacks is an error here, not a fast path that falls back
            # to gRPC later.
            check_congestion(data_congestion)
        self._channel = (with_token(channel, token) if channel is not None else
                         open_channel(address, token=token, tls_ca=tls_ca, tls_cert=tls_cert,
                                      tls_key=tls_key))
        self._rpc = Rpc(self._channel, timeout=timeout, retries=retries,
                        lookup_stream=lookup_stream)
        self._lookups = self._rpc.lookups
        if self._lookups is not None:
            # A client dropped without close() would keep its stream, and a server thread,
            # open until the server's idle timeout (5 minutes): close it with the client
            # (not at interpreter exit, where the process's end closes it anyway).
            weakref.finalize(self, self._lookups.close).atexit = False
        self._shm = RegionAttachment(self._rpc, shared_memory, clock)
        # Lookups may be answered from the server's presence map when this client may be
        # on its host (kvstore_client.presence); how many were.
        self._presence_ok = shared_memory is not False or local_socket
        self.presence_misses = 0
        self.admin = AdminClient(self._rpc)
        self._data = Chooser(
            GrpcTransport(self._rpc), address, enabled=data_plane, data_address=data_address, token=token,
            tls=tls_context(tls_ca, tls_cert, tls_key),
            # self.timeout, read at every call without a Python frame (a C partial)
            timeout=functools.partial(getattr, self._rpc, "timeout"),
            connections=data_connections, congestion=data_congestion, region=self.region,
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

    @property
    def lookup_stream(self) -> LookupStream | None:
        """The stream lookups take (None: unary calls); its `opened` counts streams opened."""
        return self._lookups

    def presence_map(self) -> PresenceMap | None:
        """The server's presence map while it is live (kvstore_client.presence), else None."""
        return self._shm.presence()

    def fast_path(self) -> FastPath | None:
        """The fast path this client's page calls take now (opened if due), or None: gRPC."""
        return self._data.fast()

    # -- plumbing -------------------------------------------------------------------
    def close(self) -> None:
        self._data.close()                      # lets releases in flight reach the server
        self._rpc.close()
        self._shm.close()

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- layouts --------------------------------------------------------------------
    def register_layout(self, layout: PageLayout) -> LayoutHandle:
        req = pb.RegisterLayoutRequest(layout=layout_to_proto(layout))
        resp = self._rpc.call("RegisterLayout", lambda: self._rpc.register(
            req, timeout=self.timeout))
        if resp.layout_id != layout.layout_id:
            raise KVStoreError(grpc.StatusCode.INTERNAL,
                               "server computed a different layout id: client and server "
                               "disagree on the layout encoding (version mismatch?)")
        return LayoutHandle(layout, resp.layout_id, resp.page_bytes, resp.layer_bytes)

    # -- pages ----------------------------------------------------------------------
    def put(self, ns: LayoutHandle, keys: Sequence[bytes] | Packed, pages) -> PutResult:
        """Store pages (N, page_bytes) under keys; keys already present are skipped.
        keys: equal-length bytes, or a Packed (kvstore_protocol.keys), sent as it is."""
        keys = keys if type(keys) is list or isinstance(keys, Packed) else list(keys)
        total = len(keys) * ns.page_bytes
        if keys and self._shm.region() is not None:
            by_page = as_uint8(pages, total).reshape(len(keys), ns.page_bytes)
            with self.reserve(ns, keys) as res:
                copy_pages(by_page, res.region.mem, res.offsets, to_pool=True)
                stored = res.commit()
            return PutResult(stored, res.skipped, res.in_flight)
        view = byte_view(pages, total)
        key_size, data = packed_keys(keys)
        return PutResult(*self._data.ask("Put", ns, "put", ns.layout_id, key_size, data,
                                         view))

    def lookup(self, ns: LayoutHandle | Sequence[LayoutHandle],
               keys: Sequence[bytes] | Packed) -> int:
        """How many leading keys are stored (in every layout, when several are given)."""
        return self._lookup_call(ns, keys, 0)[0]

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
        count, lease_id, got_pins = self._lookup_call(ns, keys, lease_ms, pins)
        return Lease(lease_id, count, got_pins)

    def _lookup_call(self, ns, keys, lease_ms: int, pins: bool = False
                     ) -> tuple[int, int, Pins | None]:
        """(count, lease id or 0, pins or None); lookup reads the count alone, so no
        Lease is made for it."""
        if isinstance(ns, LayoutHandle):
            first, ids = ns, [ns.layout_id]
        else:
            handles = list(ns)
            first, ids = handles[0], [h.layout_id for h in handles]
        key_size, data = packed_keys(keys)
        if self._presence_ok and data and self._missed_here(ids, key_size, data):
            return 0, 0, None
        return self._data.ask("Lookup", first, "lookup", ids, key_size, data, lease_ms, pins)

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
        return self._data.ask("ReleaseLease", None, "release", lease_id, pages_read)

    # A remote engine's leased lookup is two round trips when it waits for the release's
    # answer, and the answer only says whether the lease was still there: the release
    # rides the connection ahead of the next call instead (fastwire.QUIET where the
    # server grants it: no answer at all), so lookup + release costs one round trip.
    def release_lease_later(self, lease: Lease | int, pages_read: int = 0) -> None:
        """End a lease without waiting for the answer (release_lease's pages_read): for a
        caller that would not act on it. A release that fails is only logged by the
        server; one never sent costs the pages their pin until the lease expires."""
        lease_id = lease.lease_id if isinstance(lease, Lease) else lease
        if lease_id:
            self._data.ask("ReleaseLease", None, "release_later", lease_id, pages_read)

    def exists(self, ns: LayoutHandle, keys: Sequence[bytes]) -> list[bool]:
        key_size, data = packed_keys(keys)
        return self._data.call("Exists", ns, lambda t: t.exists(ns.layout_id, key_size, data))

    def delete(self, ns: LayoutHandle, keys: Sequence[bytes]) -> int:
        key_size, data = packed_keys(keys)
        return self._data.call("Delete", ns, lambda t: t.delete(ns.layout_id, key_size, data))

    def _unary(self, method: str, handle: LayoutHandle | None, request):
        """A unary call with no frame of its own (Transport.unary): over the fast path's
        CALL where the server carries it, else gRPC, mended after a server restart like
        every other (transport.Recovery); handle: the layout it names, or None."""
        return self._data.call(method, handle, lambda t: t.unary(method, request))

    # -- session retention (one call a turn, off the hot path) ---------------------------
    def retain(self, ns: LayoutHandle, keys: Sequence[bytes], session: str,
               ttl: float) -> Retention:
        """Ask the server to keep the prefix `keys` (its leading run in DRAM) from
        eviction for `session` during ttl seconds (more than 0, at most a day). Again
        under the same session: adds pages, and the ttl starts anew. A refusal (the
        tenant's retention quota or session cap) is an answer, not an error."""
        req = pb.RetainRequest(layout_id=ns.layout_id, keys=packed(keys), session=session,
                               ttl_ms=max(1, round(ttl * 1000)) if ttl > 0 else 0)
        resp = self._unary("Retain", ns, req)
        return Retention(resp.pages, resp.refused, resp.held)

    # -- removals (a poll every fraction of a second, off the hot path) ------------------
    def removals(self, handles: Sequence[LayoutHandle], after_seq: int = 0, epoch: int = 0,
                 limit: int = 0) -> Removals:
        """Pages of these layouts that left the server after the cursor (after_seq of
        epoch); epoch 0 starts a cursor at the newest removal and returns none. limit: at
        most this many (0 = the server's cap, 16384)."""
        ids = [h.layout_id for h in handles]
        req = pb.RemovalsRequest(layout_ids=ids, after_seq=after_seq, epoch=epoch,
                                 limit=limit)
        resp = self._unary("Removals", handles[0] if len(handles) == 1 else None, req)
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
                # No keys (a session's turn that added no pages, the common ask): no index.
                idx = np.array([table.setdefault(k, len(table)) for k in keys],
                               dtype="<u4").tobytes() if keys else b""
                sessions.append(pb.RetainSession(
                    session=session, ttl_ms=max(1, round(ttl * 1000)) if ttl > 0 else 0,
                    key_index=idx))
            req = pb.RetainManyRequest(layout_id=ns.layout_id, keys=packed(list(table)),
                                       sessions=sessions)
            out += self._retain_part(ns, req)
        return out

    def _retain_part(self, ns: LayoutHandle, req: pb.RetainManyRequest) -> list[Retention]:
        resp = self._unary("RetainMany", ns, req)
        return [Retention(r.pages, r.refused, r.held) for r in resp.results]

    def release_retention(self, session: str) -> int:
        """End a session's retention now: the pages it kept (0: no such session)."""
        req = pb.ReleaseRetentionRequest(session=session)
        return self._unary("ReleaseRetention", None, req).pages

    def limits(self) -> ServerLimits:
        """What one request may ask for on this server: past these it is refused."""
        r = self._unary("Limits", None, pb.LimitsRequest())
        return ServerLimits(r.max_keys_per_request, r.max_request_bytes,
                            r.max_lookup_layouts, r.max_retain_sessions)

    def get(self, ns: LayoutHandle, keys: Sequence[bytes]) -> np.ndarray:
        """The pages of keys as a new (N, page_bytes) uint8 array; KeyError if one is missing."""
        keys = list(keys)
        # Page-aligned like the pool, so long runs copy at full speed (shm.copy_pages).
        out = page_aligned_empty((len(keys), ns.page_bytes))
        self.get_into(ns, keys, out)
        return out

    def get_into(self, ns: LayoutHandle, keys: Sequence[bytes] | Packed, out) -> None:
        """Fill a caller's (N, page_bytes) buffer (numpy, torch CPU, pinned, bytearray).
        keys: equal-length bytes, or a Packed (kvstore_protocol.keys), sent as it is: an
        engine that asks per layer packs its keys once."""
        keys = keys if type(keys) is list or isinstance(keys, Packed) else list(keys)
        n = len(keys)
        if self._shm.region() is None:
            view = byte_view(out, n * ns.page_bytes, writable=True, what="out")
            if not n:
                return
            key_size, data = packed_keys(keys)
            try:
                self._data.ask("Get", ns, "get_into", ns.layout_id, key_size, data, view,
                               ns.page_bytes, ns.layout.num_layers)
            except KVStoreError as exc:
                raise PagesMissing.of(exc) from None
            return
        flat = as_uint8(out, n * ns.page_bytes, writable=True, what="out")
        if n:
            with self._acquire_or_keyerror(ns, keys) as acq:
                copy_pages(flat.reshape(n, ns.page_bytes), acq.region.mem, acq.offsets,
                           to_pool=False)

    def get_layers(self, ns: LayoutHandle, keys: Sequence[bytes], dest: Dest | None = None,
                   stop: threading.Event | None = None, landed: Landed | None = None
                   ) -> Generator[tuple[int, np.ndarray], None, None]:
        """Yield (layer, slab) as each layer arrives; slab is a contiguous (N, layer_bytes)
        array holding every page's bytes of that layer: a new one, or dest(layer), the
        caller's (pinned memory, say; called once per layer, it may block until one is
        free). Over the fast path a large get is striped over the pooled connections
        (kvstore_client.layerget); setting `stop` from another thread ends it (the
        iteration raises), and a failing get sets it, so a dest that waits can give up.
        landed(layer, slab), if given, is called before each yield, over the fast path
        on the thread that received the layer's last bytes (no hop to the caller's)."""
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
                    if landed is not None:
                        landed(layer, slab)
                    yield layer, slab
            return
        try:
            yield from self._data.get_layers(ns, *packed_keys(keys), dest, stop,
                                             lambda: self.register_layout(ns.layout),
                                             landed)
        except KVStoreError as exc:
            raise PagesMissing.of(exc) from None

    # -- same-host data plane ---------------------------------------------------------
    def region(self) -> SharedRegion | None:
        """The server's pool mapped here, or None when only gRPC can be used."""
        return self._shm.region()

    def reserve(self, ns: LayoutHandle, keys: Sequence[bytes] | Packed, lease_ms: int = 0) -> Reservation:
        """WRITING slots in the shared pool for the keys not yet stored (two-phase put).
        Write `views[i]`, then `commit()`; or `abort()`. lease_ms 0 = the server's ttl."""
        key_size, data = packed_keys(keys)

        def call(t: Transport):
            # Offsets are valid only in the region whose token the server accepted, so
            # the token sent and the region returned come from one read of the mapping,
            # made again on each run: a run after a re-attach (the server restarted)
            # sends the new token and pairs the answer with the new mapping.
            region = self._shm.need()
            return region, t.reserve(ns.layout_id, key_size, data, region.token, lease_ms)

        region, r = self._data.call("Reserve", ns, call)
        return Reservation(ns, r.lease_id, r.offsets, r.skipped, region,
                           self._commit_lease, self._abort_lease, r.in_flight)

    def acquire(self, ns: LayoutHandle, keys: Sequence[bytes] | Packed, lease_ms: int = 0) -> Acquired:
        """Pin the pages of keys in the shared pool and return read-only views of them;
        `release()` when done. NOT_FOUND (KVStoreError) if a key is missing."""
        key_size, data = packed_keys(keys)

        def call(t: Transport):
            region = self._shm.need()      # read per run: see reserve
            return region, t.acquire(ns.layout_id, key_size, data, region.token, lease_ms)

        region, r = self._data.call("Acquire", ns, call)
        return Acquired(ns, r.lease_id, r.offsets, region, self.release_lease_later)

    def _acquire_or_keyerror(self, ns: LayoutHandle, keys: Sequence[bytes] | Packed) -> Acquired:
        try:
            return self.acquire(ns, keys)
        except KVStoreError as exc:
            if exc.code == grpc.StatusCode.NOT_FOUND:
                raise PagesMissing.of(exc) from None
            raise

    def _commit_lease(self, lease_id: int) -> int:
        return self._data.call("Commit", None, lambda t: t.commit(lease_id))

    def _abort_lease(self, lease_id: int) -> bool:
        return self._data.call("Abort", None, lambda t: t.abort(lease_id))

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

