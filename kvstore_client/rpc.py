"""The client's gRPC plumbing: one stub per method, and one way to call them, with retries.

Idempotent calls are retried with backoff when the server is UNAVAILABLE (restarting,
briefly overloaded); a failure is raised as a KVStoreError carrying the server's Reason
(errors.reason_of). What a server restart calls for (register a layout again, map the new
region) is mended above every transport, in one loop (transport.Recovery).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from kvstore_protocol._proto.kvstore.v1 import admin_pb2 as apb, kvstore_pb2 as pb
from kvstore_protocol.grpc_frames import GET_DATA_TAG, unframe
from kvstore_protocol.keys import Packed, pack_keys

from .errors import from_rpc_error
from .lookup_stream import LookupStream

__all__ = ["RETRY_CODES", "Rpc", "packed"]

T = TypeVar("T")

RETRY_CODES = (grpc.StatusCode.UNAVAILABLE,)


def _put_serializer(message) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def _get_deserializer(message: bytes):
    payload = unframe(message, GET_DATA_TAG)
    return payload if payload is not None else memoryview(pb.GetResponse.FromString(message).data)


def packed(keys) -> pb.PackedKeys:
    """Keys for the wire; a Packed (kvstore_protocol.keys) passes through without the
    per-key checks, a Python call per key."""
    if isinstance(keys, Packed):
        return pb.PackedKeys(data=keys.data, key_size=keys.size)
    data, size = pack_keys(keys)
    return pb.PackedKeys(data=data, key_size=size)


class Rpc:
    """The stubs of one channel and `call`, which runs one of them with retries.

    timeout: seconds per call; retries: extra attempts of idempotent calls on UNAVAILABLE
    (0 = none); both may be changed at any time."""

    def __init__(self, channel: grpc.Channel, *, timeout: float, retries: int,
                 lookup_stream: bool) -> None:
        self.channel = channel
        self.timeout = timeout
        self.retries = retries
        c = channel
        s = "/kvstore.v1.KVStore/"
        a = "/kvstore.v1.Admin/"

        def unary(path, req, resp):
            return c.unary_unary(path, request_serializer=req.SerializeToString,
                                 response_deserializer=resp.FromString)

        self.register = unary(s + "RegisterLayout", pb.RegisterLayoutRequest,
                              pb.RegisterLayoutResponse)
        self.lookup = unary(s + "Lookup", pb.LookupRequest, pb.LookupResponse)
        # Lookups go over one open stream where they can (kvstore_client.lookup_stream).
        self.lookups = LookupStream(c.stream_stream(
            s + "LookupStream", request_serializer=pb.LookupRequest.SerializeToString,
            response_deserializer=pb.LookupResponse.FromString)) if lookup_stream else None
        self.release = unary(s + "ReleaseLease", pb.ReleaseLeaseRequest, pb.ReleaseLeaseResponse)
        self.exists = unary(s + "Exists", pb.ExistsRequest, pb.ExistsResponse)
        self.delete = unary(s + "Delete", pb.DeleteRequest, pb.DeleteResponse)
        self.put = c.stream_unary(s + "Put", request_serializer=_put_serializer,
                                  response_deserializer=pb.PutResponse.FromString)
        self.get = c.unary_stream(s + "Get", request_serializer=pb.GetRequest.SerializeToString,
                                  response_deserializer=_get_deserializer)
        self.attach = unary(s + "Attach", pb.AttachRequest, pb.AttachResponse)
        self.reserve = unary(s + "Reserve", pb.ReserveRequest, pb.ReserveResponse)
        self.commit = unary(s + "Commit", pb.CommitRequest, pb.CommitResponse)
        self.abort = unary(s + "Abort", pb.AbortRequest, pb.AbortResponse)
        self.acquire = unary(s + "Acquire", pb.AcquireRequest, pb.AcquireResponse)
        self.stats = unary(a + "Stats", apb.StatsRequest, apb.StatsResponse)
        self.evict = unary(a + "Evict", apb.EvictRequest, apb.EvictResponse)
        self.clear = unary(a + "Clear", apb.ClearRequest, apb.ClearResponse)
        self.list_layouts = unary(a + "ListLayouts", apb.ListLayoutsRequest,
                                  apb.ListLayoutsResponse)
        self.inspect = unary(a + "Inspect", apb.InspectRequest, apb.InspectResponse)
        self._unary = unary
        self._stubs: dict[str, Any] = {}

    def unary(self, name: str) -> Any:
        """The KVStore service's unary method `name`, its messages read from the proto's
        service description: a new call needs no line here."""
        stub = self._stubs.get(name)
        if stub is None:
            method = pb.DESCRIPTOR.services_by_name["KVStore"].methods_by_name[name]
            stub = self._stubs[name] = self._unary(
                "/kvstore.v1.KVStore/" + name, getattr(pb, method.input_type.name),
                getattr(pb, method.output_type.name))
        return stub

    def call(self, method: str, fn: Callable[[], T], retry: bool = True) -> T:
        """fn(), retried as the module docstring says; a failure is raised as a
        KVStoreError naming method."""
        attempts = 1 + (self.retries if retry else 0)
        attempt = 0
        while True:
            try:
                return fn()
            except grpc.RpcError as exc:
                code = exc.code()
                attempt += 1
                if code in RETRY_CODES and attempt < attempts:
                    time.sleep(min(0.05 * 2 ** attempt, 1.0))
                    continue
                raise from_rpc_error(exc, method) from None

    def timeout_for(self, nbytes: int) -> float:
        """A bulk call's timeout: extra time at a pessimistic 100 MB/s."""
        return self.timeout + nbytes / 100e6

    def close(self) -> None:
        if self.lookups is not None:
            self.lookups.close()
        self.channel.close()
