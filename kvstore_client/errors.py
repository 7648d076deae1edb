"""Errors the client raises: one class, carrying the gRPC status code and message."""

from __future__ import annotations

import grpc

# Re-exported: the client's callers catch KVStoreError and read its Reason from here.
from kvstore_protocol.reasons import REASON_KEY, Reason

__all__ = ["REASON_KEY", "KVStoreError", "PagesMissing", "Reason", "from_rpc_error",
           "reason_of"]


class KVStoreError(Exception):
    """A call the server refused or could not serve; `code` is the gRPC status code."""

    def __init__(self, code: grpc.StatusCode, message: str, method: str = "",
                 reason: Reason | None = None) -> None:
        super().__init__(f"{method}: {code.name}: {message}" if method else
                         f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.reason = reason        # set where the caller must react (see Reason)


class PagesMissing(KVStoreError, KeyError):
    """A page asked for is stored nowhere (NOT_FOUND). Also a KeyError, as a mapping's
    missing key is, so `except KeyError` catches it; its code and message are a
    KVStoreError's."""

    __str__ = Exception.__str__         # not KeyError's, which quotes the message

    @classmethod
    def of(cls, exc: KVStoreError) -> KVStoreError:
        """exc as a PagesMissing if its code is NOT_FOUND, else exc itself."""
        if exc.code != grpc.StatusCode.NOT_FOUND:
            return exc
        missing = cls(exc.code, exc.message, reason=exc.reason or Reason.PAGES_MISSING)
        missing.args = exc.args
        return missing


def from_rpc_error(exc: grpc.RpcError, method: str) -> KVStoreError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return KVStoreError(code, details or "", method, reason_of(exc))


def reason_of(exc: grpc.RpcError) -> Reason | None:
    """The Reason the server sent with this error, if any (one it does not know: None)."""
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == REASON_KEY:
            try:
                return Reason(value)
            except ValueError:
                return None
    return None
