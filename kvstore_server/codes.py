"""Outcomes as statuses: the one map, for every service and both transports.

    Outcome.INVALID   -> INVALID_ARGUMENT      Outcome.EXHAUSTED -> RESOURCE_EXHAUSTED
    Outcome.NOT_FOUND -> NOT_FOUND             Outcome.EXPIRED   -> FAILED_PRECONDITION
    Outcome.UNAUTHENTICATED -> UNAUTHENTICATED Outcome.DENIED    -> PERMISSION_DENIED
    Outcome.UNFINISHED -> ABORTED

The fast path answers the same outcome with the fastwire.Status of the same name, whose
gRPC code both ends read from fastwire.GRPC_CODES: so the table above is that one, plus
the outcomes only Admin calls have (errors.ADMIN_ONLY), which the fast path never serves.

Why here, beside errors.py and not in the RPC layer: auth's interceptor refuses a call
with these codes before any service runs, and the RPC layer (rpc/status.py, which ends a
call with them) imports auth; the map sits below both.
"""

from __future__ import annotations

import grpc

from kvstore_protocol import fastwire as fw

from .errors import ADMIN_ONLY, Outcome, StoreError

__all__ = ["CODES", "status_of"]

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
