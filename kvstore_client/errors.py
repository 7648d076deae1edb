"""Errors the client raises: one class, carrying the gRPC status code and message."""

from __future__ import annotations

import grpc

__all__ = ["KVStoreError", "from_rpc_error"]


class KVStoreError(Exception):
    """A call the server refused or could not serve; `code` is the gRPC status code."""

    def __init__(self, code: grpc.StatusCode, message: str, method: str = "") -> None:
        super().__init__(f"{method}: {code.name}: {message}" if method else
                         f"{code.name}: {message}")
        self.code = code
        self.message = message


def from_rpc_error(exc: grpc.RpcError, method: str) -> KVStoreError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return KVStoreError(code, details or "", method)
