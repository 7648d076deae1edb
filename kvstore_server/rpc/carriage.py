"""The fast path's CALL: a unary call carried whole, served by the gRPC servicer's method.

A CALL names a KVStore method and brings its protobuf request (kvstore_protocol.carriage).
It is served here by the same KVStoreService method gRPC runs, with the request decoded
by the same deserializer, so the fast path adds no rule of its own: access, limits, ttl
and quota are calls.py's, once. What the fast path brings is only who calls: the
connection's principal, authenticated at HELLO and looked up again before every frame
(fastpath/connection.py), handed to the method as a `Carried` context, which
KVStoreService._caller answers with.

What is carried is the servicer's CARRIED set, nothing else. Every other name gets a
clear error and the connection goes on:

    an Admin method              DENIED: gRPC only, with an admin's credentials
    a KVStore method not carried UNIMPLEMENTED: the client sends it over gRPC (a hot call
                                 has a frame of its own; Attach and RegisterLayout stay
                                 on gRPC, the mends of a restart must not need this path)
    any other name               UNIMPLEMENTED
    bytes that do not parse      INVALID, with the parser's reason
    a request the calls refuse   their outcome and message, as on gRPC

A body's size is bounded on its header, before it is read (Ops.max_call_body: what gRPC
takes in one message). A method that fails in a way no rule names is a server defect:
INTERNAL, logged, and the connection goes on (the frame was read whole).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvstore_protocol import fastwire as fw
from kvstore_protocol.carriage import admin_call, decode_call, messages, service_call
from kvstore_protocol.keys import MalformedKeys

from ..auth import Principal
from ..errors import Outcome, StoreError
from .carried import Carried
from .parsing import checked, parser
from .status import Invalid

if TYPE_CHECKING:
    from .service import KVStoreService

__all__ = ["Carriage"]

log = logging.getLogger(__name__)


class Carriage:
    """Serves CALL bodies with one servicer's methods (see the module docstring)."""

    def __init__(self, service: KVStoreService) -> None:
        self._service = service
        # Each carried method's request deserializer, the one its gRPC handler has.
        self._parsers: dict[str, Callable[[bytes], Any]] = {}
        for method in service.CARRIED:
            types = messages(method)
            if types is None:
                raise ValueError(f"CARRIED names {method}, not a unary KVStore method")
            self._parsers[method] = parser(types[0])

    def serve(self, who: Principal, body: memoryview | bytes) -> bytes:
        """The serialized response of the call the body names, made as `who`."""
        method, payload = decode_call(body)
        parse = self._parsers.get(method)
        if parse is None:
            raise self._refusal(method)
        request = checked(parse(payload))
        try:
            response = getattr(self._service, method)(request, Carried(who))
        except (StoreError, MalformedKeys, ValueError):
            raise                         # outcomes: the connection answers them
        except Invalid as exc:
            raise fw.WireError(str(exc), fw.Status.INVALID) from None
        except Exception:
            log.exception("fast path: carried %s failed", method)
            raise fw.WireError(f"internal error in {method}; see the server log",
                               fw.Status.INTERNAL) from None
        return response.SerializeToString()

    @staticmethod
    def _refusal(method: str) -> Exception:
        if admin_call(method):
            return StoreError(Outcome.DENIED, f"{method} is an Admin call: gRPC only, with "
                                              "an admin's token or certificate")
        if service_call(method):
            return fw.WireError(f"{method} is not carried on the fast path (it has a frame "
                                "of its own, or is gRPC only): call it over gRPC",
                                fw.Status.UNIMPLEMENTED)
        return fw.WireError(f"no call named {method!r} on this server", fw.Status.UNIMPLEMENTED)
