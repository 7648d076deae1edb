"""Exceptions as statuses: a call that raised ends with the status of its outcome, from
the one map of outcomes to statuses (kvstore_server.codes, below this layer so that auth's
interceptor refuses a call with the same codes), or of what went wrong:

    StoreError(outcome) -> codes.CODES[outcome] (and its reason, if any)
    malformed input (Invalid, MalformedKeys, ValueError) -> INVALID_ARGUMENT
    anything else -> INTERNAL, logged with its traceback (the caller sees no internals)

Where a client must react (errors.Reason: a layout unknown after a restart, a stale
shared-memory token, pages missing), the reason travels beside the status as trailing
metadata REASON_KEY = reason.value; clients branch on it, never on the message.
"""

from __future__ import annotations

import logging

import grpc

from kvstore_protocol.keys import MalformedKeys
from kvstore_protocol.reasons import REASON_KEY

from ..codes import CODES, status_of
from ..errors import Reason, StoreError

__all__ = ["CODES", "REASON_KEY", "Invalid", "abort", "code_of", "status_of"]

log = logging.getLogger(__name__)

_MALFORMED = (MalformedKeys, ValueError)


class Invalid(Exception):
    """A request malformed in a way the store never sees (a stream's shape, a missing
    field): INVALID_ARGUMENT."""


def code_of(exc: BaseException, context: grpc.ServicerContext) -> grpc.StatusCode:
    """The status a call that raised exc ends with (for metrics; abort sends it)."""
    if isinstance(exc, StoreError):
        return CODES[exc.outcome]
    if isinstance(exc, (Invalid, *_MALFORMED)):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, grpc.RpcError) and not context.is_active():
        return context.code() or grpc.StatusCode.CANCELLED
    return context.code() or grpc.StatusCode.INTERNAL


def abort(context: grpc.ServicerContext, method: str, exc: BaseException) -> None:
    """End the call with exc's status (context.abort raises); re-raises exc where the
    call already has a status or is over."""
    reason: Reason | None = None
    if isinstance(exc, StoreError):
        code, message, reason = CODES[exc.outcome], exc.message, exc.reason
    elif isinstance(exc, (Invalid, *_MALFORMED)):
        code, message = grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    elif context.code() is not None:      # context.abort already ran: keep its status
        raise exc
    elif isinstance(exc, grpc.RpcError) and not context.is_active():
        raise exc     # the call is over (peer gone, or refused by gRPC): not our error
    else:
        log.error("%s failed", method, exc_info=exc)
        code, message = grpc.StatusCode.INTERNAL, f"internal error in {method}; see the server log"
    if reason is not None:
        context.set_trailing_metadata(((REASON_KEY, reason.value),))
    context.abort(code, message)
    raise AssertionError("unreachable: context.abort raises")
