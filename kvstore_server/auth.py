"""Who is calling: bearer tokens and client certificates from an auth file, checked on
every KVStore and Admin call, on gRPC and on the fast path alike.

A caller sends gRPC metadata `authorization: Bearer <token>` (on the fast path: its
HELLO), or, over mutual TLS, presents a client certificate the auth file names. The
auth file (TOML, `--auth-file`) holds only SHA-256 hashes, of tokens and of
certificates, so reading it does not let anyone call the server:

    [tenants.team-a]
    token_sha256 = "9f86d08..."        # 64 hex digits; a list allows rotation
    cert_sha256 = "3A:5F:..."          # optional: its client certificate's fingerprint
    quota = "8GiB"                     # optional: DRAM bytes of its pages; 0 = unlimited
    shared_memory = true               # optional: may map the pool (trusted local engines)

    [admins.ops]
    token_sha256 = "60303ae..."

An entry needs a token, a certificate or both. Which credential wins (identify):

    token sent?   certificate named in the file?   the caller is
    no            no                               refused (UNAUTHENTICATED)
    no            yes                              the certificate's entry
    yes, known    no (or no certificate)           the token's entry (mTLS only gates)
    yes, known    yes, the same entry              that entry
    yes, known    yes, another entry               refused: the two disagree
    yes, unknown  any                              refused: a bad token is never ignored

Tenants may call kvstore.v1.KVStore and see only their own layouts and pages (see
tenants.py); admins may call kvstore.v1.Admin and see everything. Health and reflection
stay open so probes and grpcurl work without a token. SIGHUP makes the server read the
file again: a file that fails to parse keeps the tokens in force and logs why.

Without an auth file there is no Authenticator and no interceptor: every caller is the
built-in tenant (ANONYMOUS), Admin is open, and the server only listens on loopback
unless told otherwise (config.py).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import logging
import re
import threading
from collections.abc import Callable, Iterable

import grpc

from kvstore_protocol.units import format_size, parse_size

from .codes import CODES
from .errors import Outcome, StoreError
from .peercert import Digest, grpc_peer_digest, parse_fingerprint
from .tenants import DEFAULT_TENANT
from .tomlfile import ConfigError, read_toml

__all__ = ["ANONYMOUS", "Authenticator", "Credentials", "Principal", "Role", "parse_auth_file",
           "tls_server_credentials", "token_digest"]

log = logging.getLogger(__name__)


class Role(enum.Enum):
    TENANT = "tenant"     # kvstore.v1.KVStore, its own layouts and pages only
    ADMIN = "admin"       # kvstore.v1.Admin, everything


@dataclasses.dataclass(frozen=True, slots=True)
class Principal:
    """A caller the server knows."""

    name: str
    role: Role
    quota_bytes: int = 0          # DRAM bytes its pages may hold; 0 = unlimited
    shared_memory: bool = False   # may map the pool, which holds every tenant's pages


# Every caller of a server without an auth file.
ANONYMOUS = Principal(DEFAULT_TENANT, Role.TENANT, 0, shared_memory=True)

# Which role each service needs; services not listed (health, reflection) are open.
_SERVICE_ROLES = {"kvstore.v1.KVStore": Role.TENANT, "kvstore.v1.Admin": Role.ADMIN}
# Methods either role may call; the handler narrows a tenant to its own (Invalidate:
# rpc/admin_service.py)
_ANY_ROLE = {"/kvstore.v1.Admin/Invalidate"}

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_KEYS = {"tenants": {"token_sha256", "cert_sha256", "quota", "shared_memory"},
         "admins": {"token_sha256", "cert_sha256"}}


@dataclasses.dataclass(frozen=True, slots=True)
class Credentials:
    """What an auth file says: who each token and each client certificate is."""

    tokens: dict[Digest, Principal]      # SHA-256 of a token -> its caller
    certs: dict[Digest, Principal]       # SHA-256 of a certificate (DER) -> its caller

    def principals(self) -> set[Principal]:
        return set(self.tokens.values()) | set(self.certs.values())


def token_digest(token: str) -> Digest:
    return hashlib.sha256(token.encode()).digest()


def parse_auth_file(path: str) -> Credentials:
    """ConfigError names the file, the entry and the problem."""
    table = read_toml(path, "auth file")
    unknown = set(table) - set(_KEYS)
    if unknown:
        raise ConfigError(f"auth file {path}: unknown table(s) {sorted(unknown)} "
                          "(known: [tenants.NAME], [admins.NAME])")
    out = Credentials({}, {})
    for section, role in (("tenants", Role.TENANT), ("admins", Role.ADMIN)):
        entries = table.get(section, {})
        if not isinstance(entries, dict):
            raise ConfigError(f"auth file {path}: {section} must be tables [{section}.NAME]")
        for name, entry in entries.items():
            where = f"auth file {path}, [{section}.{name}]"
            principal = _principal(where, name, role, entry)
            if "token_sha256" not in entry and "cert_sha256" not in entry:
                raise ConfigError(f"{where}: token_sha256 is missing (the SHA-256 of the "
                                  "token, 64 hex digits: printf %s \"$TOKEN\" | sha256sum), "
                                  "and so is cert_sha256 (a client certificate's "
                                  "fingerprint): an entry needs one of them")
            for key, into, what in (("token_sha256", out.tokens, "token"),
                                    ("cert_sha256", out.certs, "certificate")):
                if key not in entry:
                    continue
                for digest in _digests(where, key, entry[key]):
                    if digest in into:
                        raise ConfigError(f"{where}: {key} {digest.hex()[:12]}... is also "
                                          f"the {what} of {into[digest].role.value} "
                                          f"{into[digest].name!r}; every {what} must be "
                                          "unique")
                    into[digest] = principal
    if not out.tokens and not out.certs:
        raise ConfigError(f"auth file {path} defines no [tenants.NAME] and no [admins.NAME]: "
                          "nobody could call the server")
    return out


def _principal(where: str, name: str, role: Role, entry: object) -> Principal:
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: must be a table with token_sha256 or cert_sha256")
    if not _NAME.match(name):
        raise ConfigError(f"{where}: a name is 1-64 letters, digits, '_', '.', '-'")
    unknown = set(entry) - _KEYS[role.value + "s"]
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)} "
                          f"(known: {sorted(_KEYS[role.value + 's'])})")
    quota = 0
    if "quota" in entry:
        try:
            quota = parse_size(entry["quota"])
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}: bad quota: {exc}") from None
    shared = entry.get("shared_memory", False)
    if not isinstance(shared, bool):
        raise ConfigError(f"{where}: shared_memory must be true or false, got {shared!r}")
    return Principal(name, role, quota, shared)


def _digests(where: str, key: str, value: object) -> list[Digest]:
    values = value if isinstance(value, list) else [value]
    if not values:
        raise ConfigError(f"{where}: {key} is an empty list")
    out = []
    for v in values:
        if key == "cert_sha256":
            try:
                out.append(parse_fingerprint(v if isinstance(v, str) else repr(v)))
            except ValueError as exc:
                raise ConfigError(f"{where}: cert_sha256: {exc} (openssl x509 -in "
                                  "client.pem -noout -fingerprint -sha256)") from None
            continue
        if not isinstance(v, str) or not _HEX64.match(v.strip().lower()):
            raise ConfigError(f"{where}: token_sha256 must be 64 hex digits (a SHA-256), "
                              f"got {v!r}")
        out.append(bytes.fromhex(v.strip()))
    return out


def _bearer(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The bearer token of the metadata; None when there is none (or not a bearer)."""
    for key, value in metadata or ():
        if key == "authorization":
            scheme, _, token = (value if isinstance(value, str) else value.decode()).partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            break
    return None


MISSING = ("missing bearer token: send metadata 'authorization: Bearer <token>' "
           "(KVStoreClient(token=...), kvstore-admin --token or $KVSTORE_TOKEN), or over "
           "mutual TLS a client certificate the auth file names (cert_sha256)")


class Authenticator:
    """The principals of an auth file, reloadable; safe to use from any thread."""

    def __init__(self, path: str) -> None:
        """Raises ConfigError when the file cannot be used."""
        self.path = path
        self._reload_lock = threading.Lock()      # one reload at a time
        # Replaced whole on reload (one reference assignment), read without a lock:
        # tokens and certificates change together.
        self._creds = parse_auth_file(path)

    def identify(self, token: Digest | None, cert: Digest | None) -> Principal:
        """The caller of a token's SHA-256 and a client certificate's (None: not sent);
        UNAUTHENTICATED as the table in the module's docstring says. Looked up again at
        every call, so a reload revokes open connections and streams too."""
        # Dicts keyed by SHA-256, not by the token: what the lookup's timing could reveal
        # is how many leading bytes of a *hash* matched, and knowing a prefix of
        # SHA-256(token) does not help anyone find the token (the reason a constant-time
        # compare, hmac.compare_digest, matters for raw secrets).
        creds = self._creds
        by_cert = creds.certs.get(cert) if cert is not None else None
        if token is None:
            if by_cert is not None:
                return by_cert
            if cert is not None:
                raise StoreError(Outcome.UNAUTHENTICATED, (
                    f"no bearer token, and the client certificate (SHA-256 "
                    f"{cert.hex()[:16]}...) is not named in the auth file (revoked?)"))
            raise StoreError(Outcome.UNAUTHENTICATED, MISSING)
        by_token = creds.tokens.get(token)
        if by_token is None:
            raise StoreError(Outcome.UNAUTHENTICATED, "invalid token: the server does not "
                                                      "know it (revoked, or a typo?)")
        if by_cert is not None and (by_cert.name, by_cert.role) != (by_token.name,
                                                                    by_token.role):
            raise StoreError(Outcome.UNAUTHENTICATED, (
                f"the bearer token names {by_token.role.value} {by_token.name!r} and the "
                f"client certificate {by_cert.role.value} {by_cert.name!r}: send the "
                "credentials of one caller"))
        return by_token

    def principal(self, metadata, cert: Digest | None = None) -> Principal:
        """The caller of these invocation metadata (and client certificate)."""
        token = _bearer(metadata)
        return self.identify(None if token is None else token_digest(token), cert)

    def caller(self, context) -> Principal:
        """The caller of a gRPC call: its metadata and its client certificate."""
        return self.principal(context.invocation_metadata(), grpc_peer_digest(context))

    def counts(self) -> tuple[int, int]:
        """(tenants, admins) known now."""
        principals = self._creds.principals()
        tenants = sum(p.role is Role.TENANT for p in principals)
        return tenants, len(principals) - tenants

    def certificates(self) -> int:
        """Client certificates the auth file names."""
        return len(self._creds.certs)

    def quotas(self) -> dict[str, int]:
        """Tenant name -> quota in bytes (0 = unlimited)."""
        return {p.name: p.quota_bytes for p in self._creds.principals()
                if p.role is Role.TENANT}

    def reload(self) -> bool:
        """Read the file again. On any problem keep the principals in force, log why and
        return False. Calls in flight finish under the principal they started with."""
        with self._reload_lock:
            try:
                creds = parse_auth_file(self.path)
            except Exception as exc:  # noqa: BLE001 - any problem: the old ones stay
                tenants, admins = self.counts()
                log.error("auth reload failed, keeping the %d tenants and %d admins in "
                          "force: %s", tenants, admins, exc)
                return False
            self._creds = creds
            tenants, admins = self.counts()
            quotas = ", ".join(f"{n}={format_size(q)}" for n, q in self.quotas().items() if q)
            log.info("auth reloaded from %s: %d tenants, %d admins%s", self.path, tenants,
                     admins, f"; quotas {quotas}" if quotas else "")
            return True

    def interceptor(self, refused: Callable[[str, grpc.StatusCode], None] = lambda m, c: None
                    ) -> grpc.ServerInterceptor:
        """refused(method, code) is told of every call refused here (for the metrics:
        these calls never reach a handler that would count them)."""
        return _AuthInterceptor(self, refused)


class _AuthInterceptor(grpc.ServerInterceptor):
    """Refuses KVStore calls but a tenant's and Admin calls but an admin's, before the
    handler runs (and before it reads a request stream).

    The refusal runs inside the call, not here: who calls may be its client certificate,
    and only the call's context has that (grpc.ServicerContext.auth_context); what an
    interceptor sees is the method and the metadata. So each KVStore and Admin handler is
    wrapped by one of the same shape that identifies the caller first."""

    def __init__(self, auth: Authenticator, refused: Callable[[str, grpc.StatusCode], None]
                 ) -> None:
        self.auth = auth
        self._refused = refused

    def intercept_service(self, continuation, details):
        needed = _SERVICE_ROLES.get(details.method.rpartition("/")[0].lstrip("/"))
        handler = continuation(details)
        if needed is None or handler is None:    # open service; no such method
            return handler
        method = details.method

        def check(context) -> None:
            try:
                principal = self.auth.caller(context)
                if principal.role is not needed and method not in _ANY_ROLE:
                    raise StoreError(Outcome.DENIED, (
                        f"{principal.role.value} {principal.name!r} may not call "
                        f"{method}: it needs a{'n' if needed is Role.ADMIN else ''} "
                        f"{needed.value} token or certificate"))
            except StoreError as exc:
                log.debug("refused %s: %s", method, exc.message)
                self._refused(method.rpartition("/")[2], CODES[exc.outcome])
                context.abort(CODES[exc.outcome], exc.message)

        return _guarded(handler, check)


_MAKE = {(False, False): (grpc.unary_unary_rpc_method_handler, "unary_unary"),
         (True, False): (grpc.stream_unary_rpc_method_handler, "stream_unary"),
         (False, True): (grpc.unary_stream_rpc_method_handler, "unary_stream"),
         (True, True): (grpc.stream_stream_rpc_method_handler, "stream_stream")}


def _guarded(handler, check: Callable[[object], None]):
    """A handler of the same shape as `handler` that calls check(context) first (which
    aborts the call to refuse it)."""
    make, kind = _MAKE[handler.request_streaming, handler.response_streaming]
    inner = getattr(handler, kind)
    if handler.response_streaming:
        def behaviour(request, context):
            check(context)
            yield from inner(request, context)
    else:
        def behaviour(request, context):
            check(context)
            return inner(request, context)
    return make(behaviour, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


def tls_server_credentials(cert_file: str, key_file: str,
                           client_ca_file: str = "") -> grpc.ServerCredentials:
    """TLS with this certificate chain and key; with client_ca_file, mutual TLS: a client
    must present a certificate that CA signed. OSError if a file cannot be read."""
    def read(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    client_ca = read(client_ca_file) if client_ca_file else None
    return grpc.ssl_server_credentials([(read(key_file), read(cert_file))],
                                       root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)
