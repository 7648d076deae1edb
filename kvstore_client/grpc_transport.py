"""The page calls over gRPC (a transport.Transport), and the calls only gRPC carries.

Each method builds its request message, runs it through Rpc.call (a timeout, retries of
idempotent calls on UNAVAILABLE, the error as a KVStoreError with the server's Reason) and
answers what the fast path answers for the same call. Restart recovery is not here: the
chooser runs every call inside the one loop (transport.Recovery).

Bulk bytes bypass protobuf objects (kvstore_protocol.grpc_frames): a Put's data messages
are framed around views of the caller's pages, and a Get's arrive layer-major and are
written where each layer belongs (buffers.LayerMajorWriter).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Generator, Iterator

import grpc
import numpy as np
from google.protobuf.message import Message

from kvstore_protocol._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore_protocol.grpc_frames import PUT_DATA_TAG, frame

from .buffers import LayerMajorWriter
from .errors import KVStoreError, PagesMissing, from_rpc_error
from .results import FastLease, LayoutHandle, Pins
from .rpc import Rpc

__all__ = ["CHUNK_BYTES", "GrpcTransport"]

log = logging.getLogger("kvstore_client.client")

CHUNK_BYTES = 1 << 20          # Put data messages; matches the server's Get chunks


def _keys(key_size: int, packed: bytes) -> pb.PackedKeys:
    return pb.PackedKeys(data=packed, key_size=key_size)


class GrpcTransport:
    """The page calls over one client's gRPC channel."""

    def __init__(self, rpc: Rpc) -> None:
        self._rpc = rpc
        self._releases: set[grpc.Future] = set()   # lease releases still in flight

    @property
    def timeout(self) -> float:
        return self._rpc.timeout

    # -- control ------------------------------------------------------------------------
    def lookup(self, layout_ids: list[bytes], key_size: int, packed: bytes,
               lease_ms: int = 0, pins: bool = False) -> tuple[int, int, Pins | None]:
        """pins: never answered over gRPC (only the fast path tells where pages lie)."""
        req = pb.LookupRequest(layout_ids=layout_ids, keys=_keys(key_size, packed),
                               lease_ms=lease_ms)
        lookups = self._rpc.lookups

        def call() -> pb.LookupResponse:
            # The stream when it can answer, else the unary call (lookup_stream.py).
            response = None if lookups is None else lookups.ask(req, self.timeout)
            return response if response is not None else self._rpc.lookup(
                req, timeout=self.timeout)

        resp = self._rpc.call("Lookup", call)
        return resp.count, resp.lease_id, None

    def exists(self, layout_id: bytes, key_size: int, packed: bytes) -> list[bool]:
        req = pb.ExistsRequest(layout_id=layout_id, keys=_keys(key_size, packed))
        resp = self._rpc.call("Exists", lambda: self._rpc.exists(req, timeout=self.timeout))
        bits = np.unpackbits(np.frombuffer(resp.bitmap, dtype=np.uint8), bitorder="little")
        return bits[: resp.count].astype(bool).tolist()

    def delete(self, layout_id: bytes, key_size: int, packed: bytes) -> int:
        req = pb.DeleteRequest(layout_id=layout_id, keys=_keys(key_size, packed))
        return self._rpc.call("Delete", lambda: self._rpc.delete(
            req, timeout=self.timeout)).deleted

    # -- leases -------------------------------------------------------------------------
    def reserve(self, layout_id: bytes, key_size: int, packed: bytes, region_token: bytes,
                lease_ms: int = 0) -> FastLease:
        req = pb.ReserveRequest(layout_id=layout_id, keys=_keys(key_size, packed),
                                token=region_token, lease_ms=lease_ms)
        resp = self._rpc.call("Reserve", lambda: self._rpc.reserve(req, timeout=self.timeout))
        return FastLease(resp.lease_id, np.frombuffer(resp.offsets, dtype="<i8"),
                         resp.skipped, resp.in_flight)

    def acquire(self, layout_id: bytes, key_size: int, packed: bytes, region_token: bytes,
                lease_ms: int = 0) -> FastLease:
        req = pb.AcquireRequest(layout_id=layout_id, keys=_keys(key_size, packed),
                                token=region_token, lease_ms=lease_ms)
        resp = self._rpc.call("Acquire", lambda: self._rpc.acquire(req, timeout=self.timeout))
        return FastLease(resp.lease_id, np.frombuffer(resp.offsets, dtype="<i8"))

    def commit(self, lease_id: int) -> int:
        return self._rpc.call("Commit", lambda: self._rpc.commit(
            pb.CommitRequest(lease_id=lease_id), timeout=self.timeout)).stored

    def abort(self, lease_id: int) -> bool:
        return self._rpc.call("Abort", lambda: self._rpc.abort(
            pb.AbortRequest(lease_id=lease_id), timeout=self.timeout)).aborted

    def release(self, lease_id: int, pages_read: int = 0) -> bool:
        return self._rpc.call("ReleaseLease", lambda: self._rpc.release(
            pb.ReleaseLeaseRequest(lease_id=lease_id, pages_read=pages_read),
            timeout=self.timeout)).released

    def release_later(self, lease_id: int, pages_read: int = 0) -> None:
        """End a lease without waiting for the answer: the caller has finished reading,
        and a lost release only costs the pages their pin until the lease expires."""
        future = self._rpc.release.future(
            pb.ReleaseLeaseRequest(lease_id=lease_id, pages_read=pages_read),
            timeout=self.timeout)
        self._releases.add(future)
        future.add_done_callback(self._release_done)

    def _release_done(self, future: grpc.Future) -> None:
        self._releases.discard(future)
        if future.exception() is not None:
            log.warning("releasing a lease failed (%s); it expires by itself",
                        future.exception())

    def unary(self, method: str, request: Message) -> Message:
        """The KVStore method of that name (Rpc.unary finds its stub by name)."""
        stub = self._rpc.unary(method)
        return self._rpc.call(method, lambda: stub(request, timeout=self.timeout))

    # -- page bytes ---------------------------------------------------------------------
    def put(self, layout_id: bytes, key_size: int, packed: bytes, data: memoryview
            ) -> tuple[int, int, int]:
        header = pb.PutRequest(header=pb.PutHeader(layout_id=layout_id,
                                                   keys=_keys(key_size, packed)))
        total = data.nbytes

        def messages() -> Iterator[pb.PutRequest | bytes]:
            yield header
            for start in range(0, total, CHUNK_BYTES):
                yield frame(PUT_DATA_TAG, (data[start:start + CHUNK_BYTES],))

        resp = self._rpc.call("Put", lambda: self._rpc.put(
            messages(), timeout=self._rpc.timeout_for(total)))
        return resp.stored, resp.skipped, resp.in_flight

    def get_into(self, layout_id: bytes, key_size: int, packed: bytes, out: memoryview,
                 page_bytes: int, layers: int = 1) -> None:
        n = len(packed) // key_size if key_size else 0
        if n == 0:
            return
        lb = page_bytes // layers
        by_layer = np.frombuffer(out, dtype=np.uint8).reshape(n, layers, lb)
        req = pb.GetRequest(layout_id=layout_id, keys=_keys(key_size, packed))

        def call() -> None:
            writer = LayerMajorWriter(n, layers, lb, lambda layer: by_layer[:, layer, :])
            for payload in self._rpc.get(req, timeout=self._rpc.timeout_for(n * page_bytes)):
                writer.write(payload)
            if not writer.done:
                raise KVStoreError(grpc.StatusCode.DATA_LOSS,
                                   f"Get ended after {writer.pos} of {writer.total} bytes", "Get")

        self._rpc.call("Get", call)

    def get_layers(self, ns: LayoutHandle, key_size: int, packed: bytes,
                   dest: Callable[[int], np.ndarray], stop: threading.Event | None
                   ) -> Generator[tuple[int, np.ndarray], None, None]:
        """(layer, slab) as each layer arrives (KVStoreClient.get_layers)."""
        n, lb = len(packed) // key_size, ns.layer_bytes
        req = pb.GetRequest(layout_id=ns.layout_id, keys=_keys(key_size, packed))
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
            raise PagesMissing.of(from_rpc_error(exc, "Get")) from None
        if not writer.done:
            raise KVStoreError(grpc.StatusCode.DATA_LOSS,
                               f"Get ended after {writer.pos} of {writer.total} bytes", "Get")

    def close(self) -> None:
        """Let releases still in flight reach the server."""
        for future in list(self._releases):
            with contextlib.suppress(grpc.RpcError, grpc.FutureTimeoutError):
                future.result(timeout=1.0)
