"""A caller's TLS client certificate, as the SHA-256 fingerprint an auth file names.

With mutual TLS (--tls-client-ca) every connection presents a certificate the CA signed;
an auth file entry may name a tenant (or admin) by that certificate's fingerprint
(`cert_sha256`), so a connection that presents it acts for that tenant without a token.

Why the fingerprint of the whole certificate (SHA-256 of its DER bytes, what
`openssl x509 -noout -fingerprint -sha256` prints) and not its subject CN or a SAN: a
fingerprint names exactly one certificate, so a CA that issues another certificate with
the same name (by mistake, or for another team) gives nobody that tenant's pages, and
the same number is what both gRPC and the fast path can compute from what they get
(gRPC's auth context holds the PEM, Python's ssl the DER). The price is that a renewed
certificate is a new entry: list both while rolling it out, as with tokens.
"""

from __future__ import annotations

import functools
import hashlib
import ssl

__all__ = ["Digest", "der_digest", "grpc_peer_digest", "parse_fingerprint"]

Digest = bytes   # SHA-256: 32 bytes


def der_digest(der: bytes | None) -> Digest | None:
    """The fingerprint of a DER certificate (what SSLSocket.getpeercert(True) gives)."""
    return hashlib.sha256(der).digest() if der else None


# Most callers present one of a few certificates on every call: the PEM -> DER -> SHA-256
# work is done once per certificate, not per call. Bounded: 1,024 certificates' digests.
@functools.lru_cache(maxsize=1024)
def _pem_digest(pem: bytes) -> Digest | None:
    try:
        return der_digest(ssl.PEM_cert_to_DER_cert(pem.decode("ascii")))
    except (ValueError, UnicodeDecodeError):
        return None


def grpc_peer_digest(context) -> Digest | None:
    """The fingerprint of the certificate a gRPC caller presented; None without mutual
    TLS (grpc's auth context then holds no `x509_pem_cert`)."""
    pems = context.auth_context().get("x509_pem_cert")
    return _pem_digest(pems[0]) if pems else None


def parse_fingerprint(value: str) -> Digest:
    """A fingerprint as an auth file writes it: 64 hex digits, upper or lower case, with
    or without the colons `openssl x509 -fingerprint -sha256` puts between bytes.
    ValueError when it is not one."""
    text = value.strip().replace(":", "").lower()
    if len(text) != 64 or any(c not in "0123456789abcdef" for c in text):
        raise ValueError(f"a SHA-256 fingerprint is 64 hex digits (colons allowed), got "
                         f"{value!r}")
    return bytes.fromhex(text)
