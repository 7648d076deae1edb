"""What a transport is to KVStoreClient, and the one loop that mends a server restart.

Two transports carry the page calls: gRPC (grpc_transport.GrpcTransport) and the fast
path (fastpath.FastPath). Both answer the calls below with the same values and raise the
same errors: KVStoreError carrying the server's Reason where the client must react, and
FastPathUnavailable when the fast path itself went away (the chooser, dataplane.py, then
uses gRPC). A call with no frame of its own on the fast path (retention, the removals feed, a call
added tomorrow) is `unary(name, request)` on both, so a new call needs no line here.
Shared memory is not a transport: it moves page bytes beside them, under
leases a transport takes (shm.py).

A server that restarted has forgotten the layouts and made a new shared-memory region.
`Recovery.run` is the one place that mends it, whichever transport refused: a call refused
with Reason.SHM_TOKEN_STALE maps the new region, one refused with Reason.LAYOUT_UNKNOWN
registers its layout again, each once, and the call runs again (so a call that reads the
region's token reads it on each run). The reason is machine-readable; the message is
never matched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

from .errors import KVStoreError, Reason

if TYPE_CHECKING:
    from google.protobuf.message import Message

    from .results import FastLease, LayoutHandle, Pins

__all__ = ["NotCarried", "Recovery", "Transport"]

T = TypeVar("T")


class NotCarried(Exception):
    """This transport does not carry that call (a server too old for the fast path's
    CALL, or one that does not carry that method): the chooser sends it over gRPC and
    keeps the fast path for everything else."""


class Transport(Protocol):
    """The page calls both transports serve; keys travel packed (key size, bytes)."""

    def lookup(self, layout_ids: list[bytes], key_size: int, packed: bytes,
               lease_ms: int = 0, pins: bool = False) -> tuple[int, int, Pins | None]:
        """(leading keys stored in every layout, lease id or 0, where the pages lie)."""
        ...

    def exists(self, layout_id: bytes, key_size: int, packed: bytes) -> list[bool]: ...

    def delete(self, layout_id: bytes, key_size: int, packed: bytes) -> int: ...

    def put(self, layout_id: bytes, key_size: int, packed: bytes, data: memoryview
            ) -> tuple[int, int, int]:
        """(stored, skipped, in flight); data: the pages back to back."""
        ...

    def get_into(self, layout_id: bytes, key_size: int, packed: bytes, out: memoryview,
                 page_bytes: int, layers: int = 1) -> None:
        """Fill out with the pages, page after page; layers: the layout's."""
        ...

    def reserve(self, layout_id: bytes, key_size: int, packed: bytes, region_token: bytes,
                lease_ms: int = 0) -> FastLease: ...

    def acquire(self, layout_id: bytes, key_size: int, packed: bytes, region_token: bytes,
                lease_ms: int = 0) -> FastLease: ...

    def commit(self, lease_id: int) -> int: ...

    def abort(self, lease_id: int) -> bool: ...

    def release(self, lease_id: int, pages_read: int = 0) -> bool: ...

    def release_later(self, lease_id: int, pages_read: int = 0) -> None:
        """End a lease without waiting for the answer (pages_read: as release's)."""
        ...

    def unary(self, method: str, request: Message) -> Message:
        """Any other unary call of the KVStore service, by its name: its request message
        in, its response message out (gRPC: the method's stub; fast path: a CALL frame,
        kvstore_protocol.carriage, or NotCarried where the server does not carry it)."""
        ...


class Recovery:
    """The two mends a server restart calls for (see the module docstring)."""

    def __init__(self, reattach: Callable[[], object],
                 reregister: Callable[[LayoutHandle], object]) -> None:
        """reattach: Attach again and map the region it names, never keeping the old
        mapping (the token it was mapped with is stale). reregister: register a layout
        again."""
        self._reattach = reattach
        self._reregister = reregister

    @staticmethod
    def mends(exc: KVStoreError, handle: LayoutHandle | None) -> bool:
        """Whether a refusal calls for a mend (run would try the call again after it)."""
        return exc.reason is Reason.SHM_TOKEN_STALE or (
            handle is not None and exc.reason is Reason.LAYOUT_UNKNOWN)

    def run(self, fn: Callable[[], T], handle: LayoutHandle | None,
            failed: KVStoreError | None = None) -> T:
        """fn(), run again after each mend its refusal calls for (each at most once);
        handle: the layout the call names (None: no layout to register again). failed:
        the refusal of a first try made outside this loop (Chooser.call's), mended
        first, as if fn had raised it here."""
        reattached = reregistered = False
        while True:
            if failed is not None:
                if not reattached and failed.reason is Reason.SHM_TOKEN_STALE:
                    reattached = True             # the server restarted: map its new region
                    self._reattach()
                elif (handle is not None and not reregistered
                        and failed.reason is Reason.LAYOUT_UNKNOWN):
                    reregistered = True           # the server restarted: register again
                    self._reregister(handle)
                else:
                    raise failed
            try:
                return fn()
            except KVStoreError as exc:
                failed = exc
