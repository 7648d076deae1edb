"""The far tier's settings, parsed from the server's `--far*` flags into one value.

`--far URL[,URL...]` names the cluster: any of its nodes (a cluster client learns the
rest from CLUSTER SLOTS), as `redis://`, `rediss://` (TLS), `valkey://` or `valkeys://`,
with optional `user:password@`. All URLs must agree on scheme and credentials: they are
one cluster. A password may come from `--far-password-file` instead, so it stays out of
process listings and config files; the file wins over the URL. A user name (an ACL user,
Redis >= 6) comes from the URL only: it is not a secret.

    --far-ca-file    PEM CA certificates the cluster's TLS certificates are checked
                     against (rediss:// only; default: the system's trust store)

    --far-cluster    auto | on | off   auto: ask the first node (INFO cluster)
    --far-ttl        seconds a page lives in the cluster; 0 = no expiry (maxmemory
                     eviction, e.g. allkeys-lru, decides)
    --far-timeout    deadline of one far call (default 50ms): a lookup pays at most this
                     much on top of its local work, then counts the rest as misses
    --far-write      evict: pages go to the far tier when they leave this host;
                     through: on commit as well, so other hosts see them at once
                     (prefill/decode hand-over across hosts); off: read only
    --far-namespace  prefix of every key this server writes: servers of one fleet share
                     it, and admin clear/evict reach only it
    --far-queue      bytes the write-behind queue may hold; past it pages are dropped
    --far-secret-file  the fleet's secrets, one a line (secret.py): the first signs every
                     value written, all are accepted when reading; re-read on change
    --far-insecure   run the far tier without a secret: values are checked for damage
                     but anyone who can write the cluster can forge them

    The removal watch (watch.py: the pages only the far tier holds for this server,
    checked so that what the cluster removes by itself is reported):
    --far-watch-pages     pages watched at most (default 65536, ~200 bytes each); past
                          it the oldest is reported removed (an under-estimate)
    --far-watch-round     pages one round checks at most, one EXISTS each (default 16384)
    --far-watch-interval  time between two rounds (default 1s)
    A removal the cluster makes reaches the ring within pages / round + 1 intervals.

A server refuses to start a far tier with neither of the last two: the MAC is what makes
"a page served from the far tier is the page stored under that key" true against anyone
who holds the cluster's password (every server of the fleet does), so running without
it must be a choice written in the config, not an oversight. (A FarSettings made in
code, by a bench or a test, defaults to the insecure key.)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

from .codec import Keys
from .secret import INSECURE, SecretFile
from .watch import CAPACITY, INTERVAL, PER_ROUND

__all__ = ["ClusterMode", "FarSettings", "WritePolicy", "from_config", "parse_far"]

_SCHEMES = {"redis": False, "valkey": False, "rediss": True, "valkeys": True}  # -> TLS
# The watch's bounds: its memory (~200 bytes a page: 800 MiB at the most) and the
# cluster's load (a round's EXISTS at most every 100 ms); an hour between rounds is
# already a router told of removals an hour late.
_WATCH_PAGES_MAX = 1 << 22
_WATCH_INTERVAL = (0.1, 3600.0)


class ClusterMode(enum.Enum):
    AUTO = "auto"
    ON = "on"
    OFF = "off"


class WritePolicy(enum.Enum):
    EVICT = "evict"
    THROUGH = "through"
    OFF = "off"


@dataclass(frozen=True, slots=True)
class FarSettings:
    """Where the far tier is and how this server uses it."""

    nodes: tuple[tuple[str, int], ...]      # (host, port) of each URL: startup nodes
    tls: bool
    username: str | None                    # None: the default user
    password: str | None = field(default=None, repr=False)  # never printed into a log
    cluster: ClusterMode = ClusterMode.AUTO
    ttl: float = 0.0                        # seconds; 0 = no expiry
    timeout: float = 0.05                   # seconds per far call
    write: WritePolicy = WritePolicy.EVICT
    namespace: str = "kvstore"
    queue_bytes: int = 256 << 20
    ca_pem: bytes | None = field(default=None, repr=False)  # TLS roots; None: the system's
    keys: Keys = field(default=INSECURE, repr=False)   # sign and check values (codec.py)
    signed: bool = False                    # keys come from a secret file, not INSECURE
    watch_pages: int = CAPACITY             # the removal watch (watch.py): pages at most,
    watch_round: int = PER_ROUND            # pages checked a round,
    watch_interval: float = INTERVAL        # seconds between rounds


def _node(url: str) -> tuple[str, int, bool, str | None, str | None]:
    parts = urlsplit(url.strip())
    if parts.scheme not in _SCHEMES:
        raise ValueError(f"far URL {url!r}: scheme must be one of "
                         f"{', '.join(s + '://' for s in _SCHEMES)}")
    if not parts.hostname:
        raise ValueError(f"far URL {url!r} names no host")
    try:
        port = parts.port or 6379
    except ValueError:
        raise ValueError(f"far URL {url!r}: bad port") from None
    if parts.path not in ("", "/", "/0"):
        raise ValueError(f"far URL {url!r}: a cluster has only database 0")
    user = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password else None
    return parts.hostname, port, _SCHEMES[parts.scheme], user, password


def parse_far(urls: str, *, cluster: str = "auto", password_file: str = "", ttl: float = 0.0,
              timeout: float = 0.05, write: str = "evict", namespace: str = "kvstore",
              queue_bytes: int = 256 << 20, ca_file: str = "",
              secret_file: str = "", watch_pages: int = CAPACITY,
              watch_round: int = PER_ROUND,
              watch_interval: float = INTERVAL) -> FarSettings | None:
    """FarSettings from the flags' values; None when `urls` is empty (no far tier).
    ValueError says what is wrong."""
    if not urls.strip():
        return None
    nodes = [_node(u) for u in urls.split(",") if u.strip()]
    if len({(tls, user, pw) for _, _, tls, user, pw in nodes}) != 1:
        raise ValueError("far URLs disagree on scheme or credentials: they must name one "
                         "cluster")
    _, _, tls, username, password = nodes[0]
    if password_file:
        try:
            with open(password_file) as f:
                password = f.readline().rstrip("\r\n")
        except OSError as exc:
            raise ValueError(f"far password file: {exc}") from None
        if not password:
            raise ValueError(f"far password file {password_file} is empty")
    ca_pem = None
    if ca_file:
        if not tls:
            raise ValueError("far_ca_file needs rediss:// or valkeys:// URLs (TLS)")
        try:
            with open(ca_file, "rb") as f:
                ca_pem = f.read()
        except OSError as exc:
            raise ValueError(f"far CA file: {exc}") from None
        if b"-----BEGIN CERTIFICATE-----" not in ca_pem:
            raise ValueError(f"far CA file {ca_file} holds no PEM certificate")
    try:
        mode, policy = ClusterMode(cluster.lower()), WritePolicy(write.lower())
    except ValueError as exc:
        raise ValueError(f"{exc} (far_cluster: auto/on/off; far_write: evict/through/off)"
                         ) from None
    if not 0 < timeout <= 10:
        raise ValueError(f"far_timeout must be above 0 and at most 10s, got {timeout}")
    if ttl < 0:
        raise ValueError("far_ttl must be >= 0 (0 = no expiry)")
    if not namespace or any(c in namespace for c in "{}:*?[] "):
        raise ValueError(f"far_namespace must be non-empty without {{}}:*?[] or spaces, "
                         f"got {namespace!r}")
    if queue_bytes < (1 << 20):
        raise ValueError("far_queue must be at least 1MiB")
    _check_watch(watch_pages, watch_round, watch_interval)
    keys = SecretFile(secret_file) if secret_file else INSECURE
    return FarSettings(tuple((h, p) for h, p, *_ in nodes), tls, username, password, mode,
                       ttl, timeout, policy, namespace, queue_bytes, ca_pem, keys,
                       bool(secret_file), watch_pages, watch_round, watch_interval)


def _check_watch(pages: int, per_round: int, interval: float) -> None:
    """ValueError for a removal watch outside its bounds (see _WATCH_PAGES_MAX)."""
    if not 1 <= pages <= _WATCH_PAGES_MAX:
        raise ValueError(f"far_watch_pages must be 1 to {_WATCH_PAGES_MAX}, got {pages}")
    if not 1 <= per_round <= pages:
        raise ValueError(f"far_watch_round must be 1 to far_watch_pages ({pages}), got "
                         f"{per_round}")
    low, high = _WATCH_INTERVAL
    if not low <= interval <= high:
        raise ValueError(f"far_watch_interval must be {low:g}s to {high:g}s, got "
                         f"{interval:g}s")


def from_config(config) -> FarSettings | None:
    """The far tier's settings of a ServerConfig (kvstore_server.config); None: no far tier.
    ValueError when --far has neither a secret file nor --far-insecure."""
    settings = parse_far(config.far, cluster=config.far_cluster,
                         password_file=config.far_password_file, ttl=config.far_ttl,
                         timeout=config.far_timeout, write=config.far_write,
                         namespace=config.far_namespace, queue_bytes=config.far_queue,
                         ca_file=config.far_ca_file, secret_file=config.far_secret_file,
                         watch_pages=config.far_watch_pages,
                         watch_round=config.far_watch_round,
                         watch_interval=config.far_watch_interval)
    if settings is not None and config.far_secret_file and config.far_insecure:
        raise ValueError("far_secret_file and far_insecure contradict each other: choose one")
    if settings is not None and not settings.signed and not config.far_insecure:
        raise ValueError("the far tier needs --far-secret-file (the fleet's secret, e.g. "
                         "`openssl rand -hex 32`): without it anyone who can write the "
                         "cluster can make servers serve pages of their choosing; "
                         "--far-insecure runs it without one")
    return settings
