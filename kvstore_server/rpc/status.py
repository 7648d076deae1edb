"""Outcomes and exceptions as statuses: the one map, for every service and both transports.

    Outcome.INVALID   -> INVALID_ARGUMENT      Outcome.EXHAUSTED -> RESOURCE_EXHAUSTED
    Outcome.NOT_FOUND -> NOT_FOUND             Outcome.EXPIRED   -> FAILED_PRECONDITION
    Outcome.UNAUTHENTICATED -> UNAUTHENTICATED Outcome.DENIED    -> PERMISSION_DENIED
    Outcome.UNFINISHED -> ABORTED
    malformed input (Invalid, KeyError_, ValueError) -> INVALID_ARGUMENT
    anything else -> INTERNAL, logged with its traceback (the caller sees no internals)

The fast path answers the same outcome with the fastwire.Status of the same name, whose
gRPC code both ends read from fastwire.GRPC_CODES: so the table above is that one, plus
the outcomes only Admin calls have (errors.ADMIN_ONLY), which the fast path never serves.

Where a client must react (errors.Reason: a layout unknown after a restart, a stale
shared-memory token, pages missing), the reason travels beside the status as trailing
metadata REASON_KEY = reason.value; clients branch on it, never on the message.
"""

from __future__ import annotations

import logging

import grpc

from kvstore_protocol import fastwire as fw
from kvstore_protocol.keys import KeyError_
from kvstore_protocol.reasons import REASON_KEY

from ..errors import ADMIN_ONLY, Outcome, Reason, StoreError

__all__ = ["CODES", "REASON_KEY", "Invalid", "abort", "code_of", "status_of"]

log = logging.getLogger(__name__)

# A data call's outcome: the fast path's status of its name (a new outcome without one
# fails here, at import, unless it is Admin-only).
_STATUS: dict[Outcome, fw.Status] = {o: fw.Status[o.name] for o in Outcome if o not in ADMIN_ONLY}
_ADMIN_CODES = {Outcome.UNFINISHED: grpc.StatusCode.ABORTED}
CODES: dict[Outcome, grpc.StatusCode] = {
    **{o: fw.GRPC_CODES[status] for o, status in _STATUS.items()}, **_ADMIN_CODES}
assert set(CODES) == set(Outcome)


def status_of(exc: StoreError) -> fw.Status:
    """exc's status on the fast path; an Admin-only outcome there is a server defect
    (INTERNAL), answered as one rather than a KeyError that would close the connection."""
    return _STATUS.get(exc.outcome, fw.Status.INTERNAL)


_MALFORMED = (KeyError_, ValueError)


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
