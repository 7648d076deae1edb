"""Who is calling: bearer tokens from an auth file, checked on every KVStore and Admin call.

A caller sends gRPC metadata `authorization: Bearer <token>`. The auth file (TOML,
`--auth-file`) holds only SHA-256 hashes of tokens, so reading it does not let anyone
call the server:

    [tenants.team-a]
    token_sha256 = "9f86d08..."        # 64 hex digits; a list allows rotation
    quota = "8GiB"                     # optional: DRAM bytes of its pages; 0 = unlimited
    shared_memory = true               # optional: may map the pool (trusted local engines)

    [admins.ops]
    token_sha256 = "60303ae..."

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
import sys
import threading
from collections.abc import Callable, Iterable

import grpc

from kvstore_client.units import format_size, parse_size

from .config import ConfigError
from .errors import Outcome, StoreError
from .status import CODES
from .tenants import DEFAULT_TENANT

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

__all__ = ["ANONYMOUS", "Authenticator", "Principal", "Role", "parse_auth_file",
           "tls_server_credentials"]

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

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_KEYS = {"tenants": {"token_sha256", "quota", "shared_memory"}, "admins": {"token_sha256"}}

Digest = bytes   # SHA-256 of a token: 32 bytes


def parse_auth_file(path: str) -> dict[Digest, Principal]:
    """Token hash -> principal; ConfigError names the file, the entry and the problem."""
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read auth file {path}: {exc}") from None
    unknown = set(table) - set(_KEYS)
    if unknown:
        raise ConfigError(f"auth file {path}: unknown table(s) {sorted(unknown)} "
                          "(known: [tenants.NAME], [admins.NAME])")
    out: dict[Digest, Principal] = {}
    for section, role in (("tenants", Role.TENANT), ("admins", Role.ADMIN)):
        entries = table.get(section, {})
        if not isinstance(entries, dict):
            raise ConfigError(f"auth file {path}: {section} must be tables [{section}.NAME]")
        for name, entry in entries.items():
            where = f"auth file {path}, [{section}.{name}]"
            principal = _principal(where, name, role, entry)
            for digest in _digests(where, entry.get("token_sha256")):
                if digest in out:
                    raise ConfigError(f"{where}: token_sha256 {digest.hex()[:12]}... is also "
                                      f"the token of {out[digest].role.value} "
                                      f"{out[digest].name!r}; every token must be unique")
                out[digest] = principal
    if not out:
        raise ConfigError(f"auth file {path} defines no [tenants.NAME] and no [admins.NAME]: "
                          "nobody could call the server")
    return out


def _principal(where: str, name: str, role: Role, entry: object) -> Principal:
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: must be a table with token_sha256")
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


def _digests(where: str, value: object) -> list[Digest]:
    values = value if isinstance(value, list) else [value]
    if value is None or not values:
        raise ConfigError(f"{where}: token_sha256 is missing (the SHA-256 of the token, "
                          "64 hex digits: printf %s \"$TOKEN\" | sha256sum)")
    out = []
    for v in values:
        if not isinstance(v, str) or not _HEX64.match(v.strip().lower()):
            raise ConfigError(f"{where}: token_sha256 must be 64 hex digits (a SHA-256), "
                              f"got {v!r}")
        out.append(bytes.fromhex(v.strip()))
    return out


def _bearer(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    for key, value in metadata or ():
        if key == "authorization":
            scheme, _, token = (value if isinstance(value, str) else value.decode()).partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            break
    raise StoreError(Outcome.UNAUTHENTICATED,
                     "missing bearer token: send metadata 'authorization: Bearer <token>' "
                     "(KVStoreClient(token=...), kvstore-admin --token or $KVSTORE_TOKEN)")


class Authenticator:
    """The principals of an auth file, reloadable; safe to use from any thread."""

    def __init__(self, path: str) -> None:
        """Raises ConfigError when the file cannot be used."""
        self.path = path
        self._reload_lock = threading.Lock()      # one reload at a time
        # Replaced whole on reload (one reference assignment), read without a lock.
        self._principals = parse_auth_file(path)

    def principal(self, metadata) -> Principal:
        """The caller of these invocation metadata; UNAUTHENTICATED if unknown."""
        # A dict keyed by the SHA-256 of the token, not by the token: what the lookup's
        # timing could reveal is how many leading bytes of a *hash* matched, and knowing
        # a prefix of SHA-256(token) does not help anyone find the token (the reason a
        # constant-time compare, hmac.compare_digest, matters for raw secrets).
        principal = self._principals.get(hashlib.sha256(_bearer(metadata).encode()).digest())
        if principal is None:
            raise StoreError(Outcome.UNAUTHENTICATED, "invalid token: the server does not "
                                                      "know it (revoked, or a typo?)")
        return principal

    def counts(self) -> tuple[int, int]:
        """(tenants, admins) known now."""
        principals = set(self._principals.values())
        tenants = sum(p.role is Role.TENANT for p in principals)
        return tenants, len(principals) - tenants

    def quotas(self) -> dict[str, int]:
        """Tenant name -> quota in bytes (0 = unlimited)."""
        return {p.name: p.quota_bytes for p in self._principals.values()
                if p.role is Role.TENANT}

    def reload(self) -> bool:
        """Read the file again. On any problem keep the principals in force, log why and
        return False. Calls in flight finish under the principal they started with."""
        with self._reload_lock:
            try:
                principals = parse_auth_file(self.path)
            except ConfigError as exc:
                tenants, admins = self.counts()
                log.error("auth reload failed, keeping the %d tenants and %d admins in "
                          "force: %s", tenants, admins, exc)
                return False
            self._principals = principals
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
    """Refuses KVStore calls without a tenant token and Admin calls without an admin one,
    before the request is read."""

    def __init__(self, auth: Authenticator, refused: Callable[[str, grpc.StatusCode], None]
                 ) -> None:
        self.auth = auth
        self._refused = refused

    def intercept_service(self, continuation, details):
        needed = _SERVICE_ROLES.get(details.method.rpartition("/")[0].lstrip("/"))
        if needed is None:
            return continuation(details)
        try:
            principal = self.auth.principal(details.invocation_metadata)
            if principal.role is not needed:
                raise StoreError(Outcome.DENIED, (
                    f"{principal.role.value} {principal.name!r} may not call "
                    f"{details.method}: it needs a{'n' if needed is Role.ADMIN else ''} "
                    f"{needed.value} token"))
        except StoreError as exc:
            log.debug("refused %s: %s", details.method, exc.message)
            handler = continuation(details)
            if handler is not None:          # None: no such method (UNIMPLEMENTED)
                self._refused(details.method.rpartition("/")[2], CODES[exc.outcome])
            return _refusal(handler, CODES[exc.outcome], exc.message)
        return continuation(details)


def _refusal(handler, code: grpc.StatusCode, message: str):
    """A handler of the same shape as `handler` that ends the call with code."""
    if handler is None:            # no such method: let gRPC answer UNIMPLEMENTED
        return None

    def refuse(_request, context):
        context.abort(code, message)

    make = {(False, False): grpc.unary_unary_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler}
    return make[handler.request_streaming, handler.response_streaming](
        refuse, request_deserializer=handler.request_deserializer,
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
