"""TLS for the fast path's TCP port, from the same files as gRPC's (--tls-cert, ...)."""

from __future__ import annotations

import ssl

__all__ = ["fast_tls_context"]


def fast_tls_context(cert_file: str, key_file: str, client_ca_file: str = ""
                     ) -> ssl.SSLContext | None:
    """None without a certificate (the fast path is plain, like gRPC); with
    client_ca_file, clients must present a certificate that CA signed (mutual TLS)."""
    if not cert_file:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert_file, key_file)
    if client_ca_file:
        ctx.load_verify_locations(client_ca_file)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx
