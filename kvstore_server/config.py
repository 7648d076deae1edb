"""Server configuration: a TOML file, then KVSTORE_* environment variables, then flags.

Over 400 lines because each of the 44 settings is written three times, as a field with
its default and meaning, a parser and a flag with its help, kept in step side by side.
The range checks (_check and its parts, about 95 lines) are a second idea and the next
split if the settings grow.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from kvstore_protocol.units import parse_duration, parse_size

from . import __version__
from .far.settings import from_config
from .removals import DEFAULT_CAPACITY as DEFAULT_REMOVAL_RING
from .rpc.limits import MAX_KEYS_LIMIT
from .store.layouts import DEFAULT_MAX_LAYOUTS
from .store.leases import DEFAULT_LEASE_MEMORY
from .store.retention import DEFAULT_MAX_SESSIONS, DEFAULT_RETENTION_QUOTA
from .tomlfile import ConfigError, read_toml

__all__ = ["LOG_LEVELS", "ConfigError", "ServerConfig", "data_address", "is_loopback",
           "load_config"]

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# A TCP congestion control's name as the kernel spells them (TCP_CA_NAME_MAX is 16 with
# its NUL); whether this kernel has it, and lets this user pick it, is found at start.
_CONGESTION = re.compile(r"[a-z0-9_-]{1,15}")


@dataclasses.dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything the daemon needs to start. Defaults suit one engine host."""

    listen: str = "127.0.0.1:50051"
    dram: int = 1 << 30             # bytes of the shared-memory page pool
    disk: int = 0                   # bytes of the disk tier; 0 = no disk tier
    disk_dir: str = ""              # where the disk tier keeps its slot files
    flush_on_stop: bool = True      # a graceful stop writes DRAM pages to disk first
    flush_timeout: float = 60.0     # ... for at most this many seconds
    metrics_port: int = 0           # Prometheus /metrics on 127.0.0.1:port; 0 = off
    lease_ttl: float = 30.0         # seconds a lease or reservation lives unless released
    # Bytes of memory the leases clients hold may take; past it a leased Lookup answers
    # without a lease, Acquire and Reserve RESOURCE_EXHAUSTED (kvstore_server.store.leases);
    # 0 = unlimited
    lease_memory: int = DEFAULT_LEASE_MEMORY
    max_layouts: int = DEFAULT_MAX_LAYOUTS    # layouts kept; past it RegisterLayout is refused
    # What one tenant's sessions may keep from eviction (kvstore_server.store.retention): a
    # share of the pool (at most 1) or bytes; past it a retain is refused; 0 = off
    retention_quota: float = DEFAULT_RETENTION_QUOTA
    retention_sessions: int = DEFAULT_MAX_SESSIONS    # sessions one tenant may hold
    # Removals kept for engines' KV-event streams (kvstore_server.removals): a reader
    # further behind than this many entries is told of a gap
    removal_ring: int = DEFAULT_REMOVAL_RING
    high_watermark: float = 0.95    # background eviction starts above this share of the pool
    low_watermark: float = 0.85     # ... and stops below this one
    # Which pages DRAM and the disk tier evict first: a module of kvstore_server.store ("lru")
    # or any importable module that defines POLICY (kvstore_server.store.eviction says how)
    eviction_policy: str = "lru"
    shm_dir: str = "/dev/shm"       # where the pool's backing file lives (tmpfs or hugetlbfs)
    shm_group: str = ""             # group allowed to map the pool too (0660); "" = owner only
    workers: int = 16               # gRPC handler threads
    # A Get or Put stream that moves no message for this long is cancelled, so a client
    # that stops reading or writing cannot hold a handler thread and its pages for ever
    # (kvstore_server.rpc.watchdog); 0 = never
    stream_timeout: float = 30.0
    # Open LookupStream calls allowed at once; each holds a handler thread of its own (on
    # top of `workers`) for as long as it is open. One per engine scheduler is typical.
    # Past the limit a client falls back to unary Lookup; 0 = no streams.
    lookup_streams: int = 32
    # Keys one request may name; past it INVALID_ARGUMENT (kvstore_server.rpc.limits)
    max_keys_per_request: int = 16_384
    log_level: str = "INFO"
    # Security (SECURITY.md). Without auth_file every caller is one tenant with Admin
    # open, so the server refuses a non-loopback listen address unless insecure_listen.
    auth_file: str = ""             # TOML of token hashes: tenants, quotas, admins (auth.py)
    insecure_listen: bool = False   # allow a non-loopback address with no auth and no mTLS
    tls_cert: str = ""              # PEM certificate chain; with tls_key, serve TLS only
    tls_key: str = ""               # PEM private key of tls_cert
    tls_client_ca: str = ""         # PEM CA: clients must present a certificate it signed
    # The fast path beside gRPC (kvstore_server.fastpath): "auto" = the listen host, port
    # + 1 (skipped with a warning if that port is taken); "off"; or HOST:PORT
    data_listen: str = "auto"
    data_socket: bool = True        # also a Unix socket (a private folder), for local clients
    # Where the server makes the private folder (0750) that holds its Unix sockets
    # (kvstore_server.fastpath.unixsock); "" = shm_dir, where clients already see the pool
    socket_dir: str = ""
    data_connections: int = 256     # fast-path connections open at once, one thread each
    # TCP congestion control of the fast path's TCP connections (set on its listener,
    # which accepted connections take), e.g. "reno" or "cubic"; "" = the host's default
    # (net.ipv4.tcp_congestion_control). docs/fastpath.md says when to set it: on hosts
    # whose default is bbr, a Get's answer is paced.
    data_congestion: str = ""
    # fast-path connections not yet authenticated (TLS handshake, HELLO), apart from those
    data_hello_connections: int = 64
    # The shared far tier on a Valkey/Redis Cluster (kvstore_server.far.settings says
    # what each means); far = "" means none
    far: str = ""                   # redis:// rediss:// valkey:// URLs, comma-separated
    far_cluster: str = "auto"       # auto / on / off
    far_password_file: str = ""     # first line: the password (wins over the URL's)
    far_ca_file: str = ""           # PEM CA of the cluster's TLS certificates; "" = system's
    far_ttl: float = 0.0            # seconds a page lives there; 0 = no expiry
    far_timeout: float = 0.05       # deadline of one far call
    far_write: str = "evict"        # evict / through / off
    far_namespace: str = "kvstore"  # key prefix shared by one fleet's servers
    far_queue: int = 256 << 20      # bytes the write-behind queue may hold
    far_secret_file: str = ""       # the fleet's secrets, one a line: sign and check values
    far_insecure: bool = False      # run the far tier without a secret (values forgeable)
    far_watch_pages: int = 1 << 16  # far-only pages watched for the cluster's removals
    far_watch_round: int = 1 << 14  # of them, checked a round
    far_watch_interval: float = 1.0  # seconds between two rounds


def _share_or_size(value: object) -> float:
    """A share of the pool (a number, at most 1) or a size with its unit (bytes)."""
    text = str(value).strip()
    if text and (text[-1].isalpha() or float(text) > 1):
        return float(parse_size(text))
    return float(text)


def _bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {value!r} (true/false)")


# How each key is parsed, shared by the file, the environment and the flags.
# setting -> its parser: text (or a TOML value) -> the typed value
_PARSERS: dict[str, Callable[[Any], Any]] = {
    "listen": str,
    "dram": parse_size,
    "disk": parse_size,
    "disk_dir": str,
    "flush_on_stop": _bool,
    "flush_timeout": parse_duration,
    "metrics_port": int,
    "lease_ttl": parse_duration,
    "lease_memory": parse_size,
    "max_layouts": int,
    "retention_quota": _share_or_size,
    "retention_sessions": int,
    "removal_ring": int,
    "high_watermark": float,
    "low_watermark": float,
    "eviction_policy": str,
    "shm_dir": str,
    "shm_group": str,
    "workers": int,
    "stream_timeout": parse_duration,
    "lookup_streams": int,
    "max_keys_per_request": int,
    "log_level": str,
    "auth_file": str,
    "insecure_listen": _bool,
    "tls_cert": str,
    "tls_key": str,
    "tls_client_ca": str,
    "data_listen": str,
    "data_socket": _bool,
    "socket_dir": str,
    "data_connections": int,
    "data_congestion": str,
    "data_hello_connections": int,
    "far": str,
    "far_cluster": str,
    "far_password_file": str,
    "far_ca_file": str,
    "far_ttl": parse_duration,
    "far_timeout": parse_duration,
    "far_write": str,
    "far_namespace": str,
    "far_queue": parse_size,
    "far_secret_file": str,
    "far_insecure": _bool,
    "far_watch_pages": int,
    "far_watch_round": int,
    "far_watch_interval": parse_duration,
}


def _parse(source: str, key: str, value: object) -> object:
    if key not in _PARSERS:
        raise ConfigError(f"{source}: unknown setting {key!r} (known: {', '.join(sorted(_PARSERS))})")
    parser = _PARSERS[key]
    # TOML's true is a Python int and 0.9 truncates to one: `workers = true` ran one
    # worker and `metrics_port = 0.9` turned metrics off, silently.
    if isinstance(value, bool) and parser is not _bool:
        raise ConfigError(f"{source}: bad value for {key!r}: {value!r} is a boolean")
    if isinstance(value, float) and parser is int and not value.is_integer():
        raise ConfigError(f"{source}: bad value for {key!r}: {value!r} is not a whole number")
    try:
        parsed = parser(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ConfigError(f"{source}: bad value for {key!r}: {exc}") from None
    if isinstance(parsed, float) and not math.isfinite(parsed):
        raise ConfigError(f"{source}: bad value for {key!r}: {value!r} is not a finite number")
    return parsed


def argument_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvstore-server",
        description="KV-cache page store: DRAM pool with disk spill, served over gRPC.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("--check-config", action="store_true",
                   help="check the settings against this host (ports, files, folders, free "
                        "memory and space), print what would start, and exit: 0 if it "
                        "would start")
    p.add_argument("--config", metavar="FILE", help="TOML file with any of the settings below")
    p.add_argument("--listen", metavar="HOST:PORT", help="gRPC address (default 127.0.0.1:50051)")
    p.add_argument("--dram", metavar="SIZE", help="page pool size, e.g. 4GiB (default 1GiB)")
    p.add_argument("--disk", metavar="SIZE", help="disk tier size; 0 = no disk tier (default 0)")
    p.add_argument("--disk-dir", metavar="PATH", help="folder for the disk tier's slot files")
    p.add_argument("--flush-on-stop", metavar="BOOL",
                   help="on SIGTERM write DRAM pages to the disk tier first (default true)")
    p.add_argument("--flush-timeout", metavar="DURATION",
                   help="longest that flush may take (default 60s)")
    p.add_argument("--metrics-port", metavar="N", help="Prometheus port on 127.0.0.1; 0 = off")
    p.add_argument("--lease-ttl", metavar="DURATION", help="lease lifetime, e.g. 30s (default 30s)")
    p.add_argument("--lease-memory", metavar="SIZE",
                   help="memory the leases clients hold may take; 0 = unlimited "
                        "(default 256MiB)")
    p.add_argument("--high-watermark", metavar="F", help="evict above this pool share (0.95)")
    p.add_argument("--low-watermark", metavar="F", help="evict down to this pool share (0.85)")
    p.add_argument("--eviction-policy", metavar="NAME",
                   help="which pages DRAM and disk evict first: lru, or a module that "
                        "defines POLICY (default lru)")
    p.add_argument("--shm-dir", metavar="PATH", help="tmpfs or hugetlbfs folder for the pool")
    p.add_argument("--shm-group", metavar="GROUP",
                   help="let clients of this group map the pool (mode 0660); default: owner only")
    p.add_argument("--workers", metavar="N", help="gRPC handler threads (default 16)")
    p.add_argument("--stream-timeout", metavar="DURATION",
                   help="cancel a Get or Put stream that moves nothing for this long; "
                        "0 = never (default 30s)")
    p.add_argument("--lookup-streams", metavar="N",
                   help="open LookupStream calls allowed, each on a thread of its own; "
                        "0 = none, clients use Lookup (default 32)")
    p.add_argument("--max-keys-per-request", metavar="N",
                   help="keys one request may name (default 16384)")
    p.add_argument("--max-layouts", metavar="N",
                   help="layouts the server keeps, all tenants together (default 4096)")
    p.add_argument("--retention-quota", metavar="SHARE|SIZE",
                   help="what one tenant's sessions may keep from eviction: a share of "
                        "the pool (0.1) or a size (2GiB); 0 = retention off (default 0.1)")
    p.add_argument("--retention-sessions", metavar="N",
                   help="retention sessions one tenant may hold at once (default 1024)")
    p.add_argument("--removal-ring", metavar="N",
                   help="removals kept for KV-event streams, ~70 bytes each; a reader "
                        f"further behind is told of a gap (default {DEFAULT_REMOVAL_RING})")
    p.add_argument("--log-level", metavar="LEVEL",
                   help="DEBUG, INFO, WARNING, ERROR (default INFO)")
    s = p.add_argument_group("security (see SECURITY.md)")
    s.add_argument("--auth-file", metavar="FILE",
                   help="TOML with the SHA-256 of each tenant's and admin's bearer token; "
                        "reloaded on SIGHUP. Default: no auth (everyone is one tenant)")
    s.add_argument("--insecure-listen", nargs="?", const="true", metavar="BOOL",
                   help="allow a non-loopback --listen without --auth-file or "
                        "--tls-client-ca: anyone who reaches the port can read every page")
    s.add_argument("--tls-cert", metavar="FILE", help="PEM certificate chain: serve TLS")
    s.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert")
    s.add_argument("--tls-client-ca", metavar="FILE",
                   help="PEM CA certificate(s): require clients to present a certificate "
                        "they signed (mutual TLS)")
    f = p.add_argument_group("fast path (docs/fastpath.md)")
    f.add_argument("--data-listen", metavar="HOST:PORT",
                   help="TCP address of the fast path; 'auto' = the --listen host, port + 1 "
                        "(default); 'off' = none")
    f.add_argument("--data-socket", metavar="BOOL",
                   help="also serve the fast path on a Unix socket, in a private folder "
                        "(--socket-dir; default true)")
    f.add_argument("--socket-dir", metavar="PATH",
                   help="folder in which the server makes a private folder for its Unix "
                        "sockets (default: --shm-dir)")
    f.add_argument("--data-connections", metavar="N",
                   help="fast-path connections open at once (default 256)")
    f.add_argument("--data-congestion", metavar="NAME",
                   help="TCP congestion control of the fast path's connections, e.g. reno "
                        "or cubic (default: the host's, net.ipv4.tcp_congestion_control; "
                        "docs/fastpath.md says when to set it)")
    f.add_argument("--data-hello-connections", metavar="N",
                   help="fast-path connections not yet authenticated, apart from "
                        "--data-connections (default 64)")
    r = p.add_argument_group("far tier on a Valkey/Redis Cluster (docs/far.md)")
    r.add_argument("--far", metavar="URL[,URL...]",
                   help="nodes of the cluster: redis://, rediss:// (TLS), valkey://, "
                        "with optional user:password@ (default: no far tier)")
    r.add_argument("--far-cluster", metavar="MODE",
                   help="auto (ask the node), on or off (one server) (default auto)")
    r.add_argument("--far-password-file", metavar="FILE",
                   help="file whose first line is the password (wins over the URL's)")
    r.add_argument("--far-ca-file", metavar="FILE",
                   help="PEM CA the cluster's TLS certificates are checked against "
                        "(rediss:// only; default: the system's trust store)")
    r.add_argument("--far-ttl", metavar="DURATION",
                   help="how long a page lives in the cluster; 0 = no expiry (default 0)")
    r.add_argument("--far-timeout", metavar="DURATION",
                   help="deadline of one far call; past it, misses (default 50ms)")
    r.add_argument("--far-write", metavar="POLICY",
                   help="evict: pages leaving this host; through: on commit as well; "
                        "off: read only (default evict)")
    r.add_argument("--far-namespace", metavar="NAME",
                   help="key prefix shared by one fleet's servers (default kvstore)")
    r.add_argument("--far-queue", metavar="SIZE",
                   help="bytes the write-behind queue may hold; past it pages are "
                        "dropped (default 256MiB)")
    r.add_argument("--far-secret-file", metavar="FILE",
                   help="the fleet's secrets, one a line (the first signs, all are "
                        "accepted), re-read on change; needed unless --far-insecure")
    r.add_argument("--far-insecure", nargs="?", const="true", metavar="BOOL",
                   help="run the far tier without a secret: anyone who can write the "
                        "cluster can forge pages (default false)")
    r.add_argument("--far-watch-pages", metavar="N",
                   help="far-only pages watched for removals the cluster makes by itself; "
                        "past it the oldest is reported removed (default 65536)")
    r.add_argument("--far-watch-round", metavar="N",
                   help="watched pages one round checks, one EXISTS each (default 16384)")
    r.add_argument("--far-watch-interval", metavar="DURATION",
                   help="time between two rounds of the watch (default 1s)")
    return p


def load_config(argv: list[str] | None = None,
                environ: Mapping[str, str] | None = None) -> ServerConfig:
    """Build the config; later sources override earlier ones: file < environment < flags."""
    args = argument_parser().parse_args(argv)
    env: Mapping[str, str] = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    config_file = args.config or env.get("KVSTORE_CONFIG")
    if config_file:
        table = read_toml(config_file, "config file")
        for key, value in table.items():
            values[key.replace("-", "_")] = _parse(config_file, key.replace("-", "_"), value)
    for key in _PARSERS:
        env_name = "KVSTORE_" + key.upper()
        if env_name in env:
            values[key] = _parse(env_name, key, env[env_name])
    for key in _PARSERS:
        flag_value = getattr(args, key, None)
        if flag_value is not None:
            values[key] = _parse("--" + key.replace("_", "-"), key, flag_value)
    config = ServerConfig(**values)
    _check(config)
    return config


def _check(c: ServerConfig) -> None:
    """Every setting in range and the listeners safe; the first that is not, as a
    ConfigError (checked in this order: the store, serving, the listeners, TLS)."""
    _check_store(c)
    _check_serving(c)
    host = _check_listeners(c)
    _check_tls(c, host)


def _check_store(c: ServerConfig) -> None:
    if c.dram < (16 << 20):
        raise ConfigError(f"dram must be at least 16MiB, got {c.dram} bytes")
    if not 0 < c.low_watermark < c.high_watermark <= 1:
        raise ConfigError("watermarks must satisfy 0 < low < high <= 1, got "
                          f"low={c.low_watermark} high={c.high_watermark}")
    if c.lease_ttl <= 0:
        raise ConfigError("lease_ttl must be positive")
    if c.lease_memory < 0:
        raise ConfigError("lease_memory must be >= 0 (0 = unlimited)")
    if c.max_layouts < 1:
        raise ConfigError("max_layouts must be >= 1")
    if c.retention_quota < 0:
        raise ConfigError("retention_quota must be >= 0 (a share of the pool, or bytes; "
                          "0 = off)")
    if c.retention_sessions < 1:
        raise ConfigError("retention_sessions must be >= 1")
    if not 1 <= c.removal_ring <= 1 << 24:
        raise ConfigError("removal_ring must be 1 to 16777216 entries")
    if c.disk and not c.disk_dir:
        raise ConfigError("disk tier needs disk_dir (--disk-dir) when disk > 0")


def _check_serving(c: ServerConfig) -> None:
    if c.workers < 1:
        raise ConfigError("workers must be >= 1")
    if c.stream_timeout < 0:
        raise ConfigError("stream_timeout must be >= 0 (0 = never)")
    if not 1 <= c.max_keys_per_request <= MAX_KEYS_LIMIT:
        # Past it the message limit it implies overflowed gRPC's int32 option, and one
        # request's work under the store's lock would be seconds (kvstore_server.rpc.limits).
        raise ConfigError(f"max_keys_per_request must be 1 to {MAX_KEYS_LIMIT}, got "
                          f"{c.max_keys_per_request}")
    if c.lookup_streams < 0:
        raise ConfigError("lookup_streams must be >= 0 (0 = none)")


def _check_listeners(c: ServerConfig) -> str:
    """The gRPC and fast-path listeners, the metrics port and the log level; returns the
    gRPC listener's host."""
    host, sep, port = c.listen.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"listen must be HOST:PORT, got {c.listen!r}")
    # grpcio takes port 65536 as "any port" and 99999 modulo 2**16: a typo must not
    # quietly listen somewhere else.
    if not 1 <= int(port) <= 65535:
        raise ConfigError(f"listen: port must be 1 to 65535, got {c.listen!r}")
    if not 0 <= c.metrics_port <= 65535:
        raise ConfigError(f"metrics_port must be 1 to 65535, or 0 = off, got {c.metrics_port}")
    if c.log_level.upper() not in LOG_LEVELS:
        raise ConfigError(f"log_level must be one of {', '.join(LOG_LEVELS)}, "
                          f"got {c.log_level!r}")
    if c.data_connections < 1:
        raise ConfigError("data_connections must be >= 1")
    if c.data_hello_connections < 1:
        raise ConfigError("data_hello_connections must be >= 1")
    if c.data_congestion and not _CONGESTION.fullmatch(c.data_congestion):
        raise ConfigError(f"data_congestion must name a TCP congestion control (letters, "
                          f"digits, _ or -, at most 15), got {c.data_congestion!r}")
    data = data_address(c)
    if data is not None and not (c.auth_file or c.tls_client_ca or c.insecure_listen
                                 or is_loopback(data[0])):
        raise ConfigError(
            f"data_listen {c.data_listen} is not loopback and no --auth-file is set: anyone "
            "who can reach it could read or overwrite every page. Add --auth-file or "
            "--tls-client-ca, or --insecure-listen to accept that on a trusted network")
    try:
        from_config(c)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return host


def _check_tls(c: ServerConfig, host: str) -> None:
    if bool(c.tls_cert) != bool(c.tls_key):
        raise ConfigError("TLS needs both tls_cert and tls_key (--tls-cert, --tls-key)")
    if c.tls_client_ca and not c.tls_cert:
        raise ConfigError("tls_client_ca (--tls-client-ca) needs TLS: add --tls-cert and "
                          "--tls-key")
    # Without auth the first caller on the network could read, overwrite or clear every
    # page, so only loopback is allowed unless the operator says otherwise. Plain TLS
    # does not count: it hides the bytes on the wire, not who may call.
    if not (c.auth_file or c.tls_client_ca or c.insecure_listen or is_loopback(host)):
        raise ConfigError(
            f"listen address {c.listen} is not loopback and no --auth-file is set: anyone "
            "who can reach it could read, overwrite or clear every page. Add --auth-file "
            "FILE (bearer tokens, see SECURITY.md) or --tls-client-ca FILE (mutual TLS), or "
            "--insecure-listen to accept that on a trusted network")


def data_address(c: ServerConfig) -> tuple[str, int] | None:
    """(host, port) of the fast path's TCP listener; None when off."""
    value = c.data_listen.strip().lower()
    if value == "off":
        return None
    if value == "auto":
        host, _, port = c.listen.rpartition(":")
        return host, (int(port) + 1 if 0 < int(port) < 65535 else 0)
    host, sep, port = c.data_listen.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"data_listen must be HOST:PORT, auto or off, got {c.data_listen!r}")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Whether HOST (of HOST:PORT) only accepts connections from this machine."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False        # a host name: it may resolve to anything
