"""The KVStore gRPC service: decodes requests, makes the call, encodes its answer.

Each method decodes its message into one call of kvstore_server.rpc.calls (which applies
access, limits, ttl capping and quota, for the fast path too) and encodes what it returns;
no rule is applied here.

Outcomes become gRPC statuses in status.py, through `guarded`, which every service's
methods (this one's and Admin's) wear.

Every call acts for one tenant (auth.py): the layout ids a client sends are its own, and
are scoped to its tenant here before the store sees them (tenants.py); lease ids are
checked against the tenant that took them.

Bulk bytes bypass protobuf objects (see kvstore_protocol.grpc_frames): Put's data messages are
read as memoryviews of the received buffer and Get's chunks are framed straight from
the pool, one copy each way.

The fast path serves the calls named in KVStoreService.CARRIED with these very methods
(carriage.py: its CALL frame carries the method's name and this request, and the
connection's tenant comes as a `Carried` context). A new unary call rides both transports
once its name is added there.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import time
from collections.abc import Callable, Iterator

import grpc
import numpy as np

from kvstore_protocol._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore_protocol.convert import layout_from_proto
from kvstore_protocol.grpc_frames import GET_DATA_TAG, PUT_DATA_TAG, frame, unframe

from ..auth import ANONYMOUS, Authenticator, Principal
from ..metrics import Metrics
from ..region import TOKEN_OFFSET
from ..store import Store
from .calls import Calls
from .carried import Carried
from .limits import RequestLimits
from .lookup_streams import LookupStreams
from .parsing import Unparsed, checked, parser
from .status import Invalid, abort, code_of
from .stream_gate import StreamGate, gated_requests, gated_stream
from .watchdog import StreamWatchdog, watched_requests, watched_stream

__all__ = ["KVStoreService", "add_kvstore_service", "guarded"]

log = logging.getLogger(__name__)

# About 1 MiB per streamed message: large enough that per-message overhead is small,
# small enough that the first layer reaches the client early.
CHUNK_BYTES = 1 << 20


def guarded(method: str, metrics: Metrics) -> Callable:
    """Map exceptions to gRPC statuses, time the call, never let a request kill us."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def unary(self, request, context):
            start = time.perf_counter()
            code = grpc.StatusCode.OK
            try:
                return fn(self, checked(request), context)
            except Exception as exc:  # noqa: BLE001 - the server must survive any request
                code = code_of(exc, context)
                abort(context, method, exc)
            finally:
                metrics.observe(method, time.perf_counter() - start, code)

        @functools.wraps(fn)
        def streaming(self, request, context):
            start = time.perf_counter()
            code = grpc.StatusCode.OK
            try:
                yield from fn(self, checked(request), context)
            except GeneratorExit:
                code = grpc.StatusCode.CANCELLED
                raise
            except Exception as exc:  # noqa: BLE001
                code = code_of(exc, context)
                abort(context, method, exc)
            finally:
                metrics.observe(method, time.perf_counter() - start, code)

        return streaming if inspect.isgeneratorfunction(fn) else unary

    return wrap


_parse_put_request = parser(pb.PutRequest)


def _put_deserializer(message: bytes) -> memoryview | pb.PutRequest | Unparsed:
    """A PutRequest: its data payload as a memoryview (fast path), a parsed message, or
    parsing.Unparsed (never raises: see parsing.py)."""
    payload = unframe(message, PUT_DATA_TAG)
    return payload if payload is not None else _parse_put_request(message)


def _offsets(offsets: np.ndarray) -> bytes:
    return np.ascontiguousarray(offsets, dtype="<i8").tobytes()


class KVStoreService:
    """The KVStore RPCs over one Store."""

    # The unary calls the fast path also carries (its CALL frame, carriage.py): the cold
    # ones with no frame of their own. Not the hot calls (their frames are hand-packed),
    # nor Attach and RegisterLayout: the client's mends of a restart run over gRPC,
    # whatever state the fast path is in. RetainMany (the connector's retains for KV
    # events) rides here: a change to its messages needs no edit of either transport.
    CARRIED = frozenset({"Retain", "RetainMany", "ReleaseRetention", "Removals", "Limits"})

    def __init__(self, store: Store, metrics: Metrics,
                 auth: Authenticator | None = None,
                 limits: RequestLimits | None = None, unix_socket: str = "") -> None:
        """auth: who may call, from --auth-file; None = everyone is ANONYMOUS.
        limits: what one request may ask for (limits.py). unix_socket: the fast path's
        Unix socket, which Attach reports ("" = none)."""
        self.store = store
        self.unix_socket = unix_socket
        self.metrics = metrics
        self.auth = auth
        self.calls = Calls(store, auth is not None, limits)
        self.limits = self.calls.limits
        self._mem = store.mem.data

    def _caller(self, context: grpc.ServicerContext | Carried) -> Principal:
        """The tenant this call acts for (the interceptor already refused the others; on
        the fast path, the connection's HELLO and its check before each frame did)."""
        if isinstance(context, Carried):
            return context.who
        if self.auth is None:
            return ANONYMOUS
        return self.auth.caller(context)

    def Attach(self, request: pb.AttachRequest,
               context: grpc.ServicerContext) -> pb.AttachResponse:
        region = self.calls.attach(self._caller(context))
        # Who we are, so that a client can tell this server's socket from another
        # user's before it sends a token (kvstore_server.fastpath.unixsock).
        return pb.AttachResponse(path=region.path, size=region.size,
                                 token_offset=TOKEN_OFFSET, socket_path=self.unix_socket,
                                 uid=os.geteuid(), gid=os.getegid(), pid=os.getpid())

    def Reserve(self, request: pb.ReserveRequest,
                context: grpc.ServicerContext) -> pb.ReserveResponse:
        res = self.calls.reserve(self._caller(context), request.layout_id, request.keys.data,
                                 request.keys.key_size, request.token, request.lease_ms)
        return pb.ReserveResponse(lease_id=res.lease_id, offsets=_offsets(res.offsets),
                                  skipped=res.skipped, in_flight=res.in_flight)

    def Commit(self, request: pb.CommitRequest,
               context: grpc.ServicerContext) -> pb.CommitResponse:
        return pb.CommitResponse(stored=self.calls.commit(self._caller(context),
                                                          request.lease_id))

    def Abort(self, request: pb.AbortRequest,
              context: grpc.ServicerContext) -> pb.AbortResponse:
        return pb.AbortResponse(aborted=self.calls.abort(self._caller(context),
                                                         request.lease_id))

    def Acquire(self, request: pb.AcquireRequest,
                context: grpc.ServicerContext) -> pb.AcquireResponse:
        pinned = self.calls.acquire(self._caller(context), request.layout_id,
                                    request.keys.data, request.keys.key_size,
                                    request.token, request.lease_ms)
        return pb.AcquireResponse(lease_id=pinned.lease_id, offsets=_offsets(pinned.offsets))

    def RegisterLayout(self, request: pb.RegisterLayoutRequest,
                       context: grpc.ServicerContext) -> pb.RegisterLayoutResponse:
        if not request.HasField("layout"):
            raise Invalid("RegisterLayout needs a layout")
        layout = layout_from_proto(request.layout)
        info = self.calls.register_layout(self._caller(context), layout)
        # The client's id, not the store's scoped one: the client names its layouts.
        return pb.RegisterLayoutResponse(layout_id=layout.layout_id,
                                         page_bytes=info.page_bytes,
                                         layer_bytes=info.layer_bytes)

    def Lookup(self, request: pb.LookupRequest,
               context: grpc.ServicerContext) -> pb.LookupResponse:
        found = self.calls.lookup(self._caller(context), request.layout_ids,
                                  request.keys.data, request.keys.key_size, request.lease_ms)
        return pb.LookupResponse(count=found.count, lease_id=found.lease_id)

    def ReleaseLease(self, request: pb.ReleaseLeaseRequest,
                     context: grpc.ServicerContext) -> pb.ReleaseLeaseResponse:
        return pb.ReleaseLeaseResponse(released=self.calls.release(
            self._caller(context), request.lease_id, request.pages_read))

    def Exists(self, request: pb.ExistsRequest,
               context: grpc.ServicerContext) -> pb.ExistsResponse:
        present = self.calls.exists(self._caller(context), request.layout_id,
                                    request.keys.data, request.keys.key_size)
        return pb.ExistsResponse(bitmap=np.packbits(present, bitorder="little").tobytes(),
                                 count=len(present))

    def Delete(self, request: pb.DeleteRequest,
               context: grpc.ServicerContext) -> pb.DeleteResponse:
        return pb.DeleteResponse(deleted=self.calls.delete(
            self._caller(context), request.layout_id, request.keys.data,
            request.keys.key_size))

    def Retain(self, request: pb.RetainRequest,
               context: grpc.ServicerContext) -> pb.RetainResponse:
        kept = self.calls.retain(self._caller(context), request.layout_id, request.keys.data,
                                 request.keys.key_size, request.session, request.ttl_ms)
        return pb.RetainResponse(pages=kept.pages, refused=kept.refused, held=kept.held)

    def RetainMany(self, request: pb.RetainManyRequest,
                   context: grpc.ServicerContext) -> pb.RetainManyResponse:
        kept = self.calls.retain_many(
            self._caller(context), request.layout_id, request.keys.data,
            request.keys.key_size,
            [(s.session, s.ttl_ms, s.key_index) for s in request.sessions])
        return pb.RetainManyResponse(results=[
            pb.RetainResponse(pages=k.pages, refused=k.refused, held=k.held) for k in kept])

    def ReleaseRetention(self, request: pb.ReleaseRetentionRequest,
                         context: grpc.ServicerContext) -> pb.ReleaseRetentionResponse:
        return pb.ReleaseRetentionResponse(pages=self.calls.release_retention(
            self._caller(context), request.session))

    def Removals(self, request: pb.RemovalsRequest,
                 context: grpc.ServicerContext) -> pb.RemovalsResponse:
        read = self.calls.removals(self._caller(context), request.layout_ids,
                                   request.after_seq, request.epoch, request.limit)
        return pb.RemovalsResponse(
            epoch=read.epoch, next_seq=read.next_seq, gap=read.gap, more=read.more,
            seqs=read.seqs.tolist(), layout_index=read.layout_pos.tolist(),
            causes=read.causes, key_sizes=read.key_sizes, keys=read.keys)

    def Limits(self, request: pb.LimitsRequest,
               context: grpc.ServicerContext) -> pb.LimitsResponse:
        b = self.calls.bounds()
        return pb.LimitsResponse(max_keys_per_request=b.max_keys,
                                 max_request_bytes=b.max_request_bytes,
                                 max_lookup_layouts=b.max_lookup_layouts,
                                 max_retain_sessions=b.max_retain_sessions)

    def Put(self, request_iterator: Iterator[memoryview | pb.PutRequest],
            context: grpc.ServicerContext) -> pb.PutResponse:
        first = next(request_iterator, None)
        if first is None or isinstance(first, memoryview) or not first.HasField("header"):
            raise Invalid("Put must start with a header message (layout_id and keys)")
        header = first.header
        writing = self.calls.put(self._caller(context), header.layout_id, header.keys.data,
                                 header.keys.key_size)
        with writing:
            reservation, page_bytes = writing.reservation, writing.page_bytes
            n = len(reservation.offsets)
            expected = n * page_bytes
            offsets = reservation.offsets.tolist()
            mem = self.store.mem
            pos = 0
            for message in request_iterator:
                if isinstance(message, memoryview):
                    data = message
                elif message.WhichOneof("part") == "data":
                    data = memoryview(message.data)
                else:
                    raise Invalid("Put sent a second header; one Put stores one batch")
                if pos + len(data) > expected:
                    raise Invalid(f"Put sent more bytes than expected: {expected} "
                                   f"({n} pages of {page_bytes} bytes)")
                src = np.frombuffer(data, dtype=np.uint8)
                while src.size:
                    page, within = divmod(pos, page_bytes)
                    take = min(page_bytes - within, src.size)
                    off = offsets[page]
                    if off >= 0:
                        mem[off + within: off + within + take] = src[:take]
                    src = src[take:]
                    pos += take
            if pos != expected:
                raise Invalid(f"Put sent {pos} bytes, expected {expected} "
                               f"({n} pages of {page_bytes} bytes)")
            stored = writing.commit()
        return pb.PutResponse(stored=stored, skipped=reservation.skipped,
                              in_flight=reservation.in_flight)

    def Get(self, request: pb.GetRequest,
            context: grpc.ServicerContext) -> Iterator[bytes]:
        with self.calls.get(self._caller(context), request.layout_id, request.keys.data,
                            request.keys.key_size) as pinned:
            info = pinned.info
            layer_bytes = info.layer_bytes
            offsets = pinned.offsets.tolist()
            mem = self._mem
            for layer in range(info.layout.num_layers):
                parts: list[memoryview] = []
                size = 0
                for off in offsets:
                    start = off + layer * layer_bytes
                    done = 0
                    while done < layer_bytes:
                        take = min(layer_bytes - done, CHUNK_BYTES - size)
                        parts.append(mem[start + done: start + done + take])
                        size += take
                        done += take
                        if size >= CHUNK_BYTES:
                            yield frame(GET_DATA_TAG, parts)
                            parts, size = [], 0
                # End each layer on a message boundary so a reader can hand layer l
                # to the GPU as soon as its last message arrives.
                if parts:
                    yield frame(GET_DATA_TAG, parts)


def _describe_get(request) -> str:
    keys = getattr(request, "keys", None)       # None: parsing.Unparsed, refused later
    return "Get" if keys is None else f"Get of {len(keys.data) // max(1, keys.key_size)} keys"


def add_kvstore_service(server: grpc.Server, service: KVStoreService,
                        streams: StreamWatchdog | None = None,
                        lookup_streams: int = 0, workers: int = 16) -> LookupStreams:
    """streams: cancels Get and Put streams that stall (kvstore_server.rpc.watchdog).
    lookup_streams: LookupStream calls open at once (the server's pool needs as many
    threads on top of its workers). workers: the pool's other threads, of which Get and
    Put streams may take only a share (stream_gate.py). Returns the lookup streams, to
    start and stop with the server."""
    m = service.metrics
    streams = streams or StreamWatchdog(0)
    gate = StreamGate(workers, per_tenant=service.auth is not None)

    def tenant(context) -> str:
        return service._caller(context).name
    lookups = LookupStreams(lookup_streams, functools.partial(
        guarded("Lookup", m)(KVStoreService.Lookup), service))
    unary = grpc.unary_unary_rpc_method_handler

    def u(method) -> grpc.RpcMethodHandler:
        fn = guarded(method.name, m)(getattr(KVStoreService, method.name))
        return unary(functools.partial(fn, service),
                     request_deserializer=parser(getattr(pb, method.input_type.name)),
                     response_serializer=getattr(pb, method.output_type.name).SerializeToString)

    # Every unary call of the proto's service, served by the method of its name: a new
    # unary call needs its method above and no line here.
    handlers = {
        method.name: u(method)
        for method in pb.DESCRIPTOR.services_by_name["KVStore"].methods
        if not (method.client_streaming or method.server_streaming)
    }
    handlers.update({
        "Put": grpc.stream_unary_rpc_method_handler(
            gated_requests(gate, tenant, watched_requests(streams, functools.partial(
                guarded("Put", m)(KVStoreService.Put), service), "Put"), "Put"),
            request_deserializer=_put_deserializer,
            response_serializer=pb.PutResponse.SerializeToString),
        "Get": grpc.unary_stream_rpc_method_handler(
            gated_stream(gate, tenant, watched_stream(streams, functools.partial(
                guarded("Get", m)(KVStoreService.Get), service), _describe_get), "Get"),
            request_deserializer=parser(pb.GetRequest),
            response_serializer=lambda chunk: chunk),   # already framed
        "LookupStream": grpc.stream_stream_rpc_method_handler(
            lookups.handle, request_deserializer=parser(pb.LookupRequest),
            response_serializer=pb.LookupResponse.SerializeToString),
    })
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("kvstore.v1.KVStore", handlers),))
    return lookups
