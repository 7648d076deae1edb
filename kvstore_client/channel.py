"""gRPC channels to a kvstore-server: plain or TLS, with a bearer token on every call.

    open_channel("10.0.0.5:50051", token="...", tls_ca="ca.pem")                  # TLS
    open_channel(addr, token=t, tls_ca="ca.pem", tls_cert="me.pem", tls_key="me.key")  # mTLS

TLS is on when a CA or a client certificate is given; `tls_ca` None then means the
system's root certificates. Every PEM argument is a path or the PEM bytes themselves.
The token travels as metadata `authorization: Bearer <token>` on every call, health
checks included (the server ignores it there). Without TLS it travels in clear text:
fine on loopback, not across a network (SECURITY.md).
"""

from __future__ import annotations

import collections
import re
from collections.abc import Sequence

import grpc

from kvstore_protocol.grpc_frames import CHANNEL_OPTIONS

__all__ = ["open_channel", "with_token"]

PEM = str | bytes    # a path to a PEM file, or the PEM bytes


def _pem(value: PEM | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    with open(value, "rb") as f:
        return f.read()


def open_channel(address: str, *, token: str | None = None, tls_ca: PEM | None = None,
                 tls_cert: PEM | None = None, tls_key: PEM | None = None,
                 options: Sequence[tuple[str, object]] = CHANNEL_OPTIONS) -> grpc.Channel:
    """A channel to address; OSError if a PEM file cannot be read, ValueError for a port
    out of range."""
    _check_port(address)
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("a client certificate needs both tls_cert and tls_key")
    if tls_ca is None and tls_cert is None:
        channel = grpc.insecure_channel(address, options=list(options))
    else:
        creds = grpc.ssl_channel_credentials(root_certificates=_pem(tls_ca),
                                             private_key=_pem(tls_key),
                                             certificate_chain=_pem(tls_cert))
        channel = grpc.secure_channel(address, creds, options=list(options))
    return with_token(channel, token)


def _check_port(address: str) -> None:
    """gRPC takes a port past 65535 modulo 2**16: `host:115587` reached port 50051, and
    `kvstore-admin --server` so cleared a server other than the one it named."""
    if address.startswith("unix"):
        return
    match = re.search(r":(\d+)$", address)
    if match is not None and not 1 <= int(match.group(1)) <= 65535:
        raise ValueError(f"{address}: the port must be 1 to 65535")


def with_token(channel: grpc.Channel, token: str | None) -> grpc.Channel:
    """channel, sending `token` on every call (unchanged when token is None or "")."""
    if not token:
        return channel
    if any(c.isspace() for c in token) or not token.isprintable():
        raise ValueError("a token must be printable and contain no whitespace")
    return grpc.intercept_channel(channel, _BearerToken(token))


class _CallDetails(collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                         "compression")), grpc.ClientCallDetails):
    pass


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `authorization: Bearer <token>` to each call's metadata."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, d: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(d.method, d.timeout, [*(d.metadata or ()), self._header],
                            d.credentials, d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)
