"""Connector settings, shared by the scheduler and worker halves and every adapter."""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Mapping
from typing import Any

from kvstore_client import KVStoreClient
from kvstore_protocol.congestion import CongestionRefused, check_congestion

__all__ = ["ConnectorConfig", "LoadMode", "LookupMode", "Role", "SavePolicy", "min_hit_tokens",
           "open_client", "remote_store"]


class Role(enum.Enum):
    """What this engine instance does with the store (vLLM's kv_role)."""

    PRODUCER = "kv_producer"   # only saves: a prefill instance handing KV to decoders
    CONSUMER = "kv_consumer"   # only loads: a decode instance
    BOTH = "kv_both"

    @property
    def loads(self) -> bool:
        return self is not Role.PRODUCER

    @property
    def saves(self) -> bool:
        return self is not Role.CONSUMER


class LoadMode(enum.Enum):
    # The request runs in the same step as its load; each layer's attention waits only
    # for that layer's pages, so the copy of layer l+1 hides behind the compute of layer
    # l. Best time to first token.
    LAYERWISE = "layerwise"
    # The load runs between steps (vLLM's WAITING_FOR_REMOTE_KVS) and the request is
    # scheduled once every layer is in place; other requests keep running meanwhile.
    ASYNC = "async"


class LookupMode(enum.Enum):
    """Where the scheduler half asks the store how much of a new prompt it holds."""

    # On a background thread: a request not looked up yet hears "ask again" unless its
    # answer comes within the step's share of lookup_wait_ms; the next schedule() reads
    # it (connector.scheduler.prefetch). A burst of 64 new requests costs the loop 4x less than
    # SYNC (docs/perf/admit-a516f10033.json, at a 1 ms step).
    PREFETCH = "prefetch"
    # On the engine's scheduler loop, one Lookup per request as it is asked.
    SYNC = "sync"


class SavePolicy(enum.Enum):
    ALL = "all"          # every full page the engine computes, prompt and output
    PROMPT = "prompt"    # only pages inside the prompt (outputs are rarely reused)
    NONE = "none"


@dataclasses.dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """Settings from the engine's connector config (vLLM: kv_connector_extra_config).

    Defaults suit one engine on the store's host.
    """

    server: str = "127.0.0.1:50051"
    page_tokens: int = 0            # tokens per stored page; 0 = the engine's block size
    lookup_timeout: float = 0.5     # seconds; a slower lookup answers "ask again later"
    # A store that timed out or was unreachable is not asked again (no hits) except by one
    # probe every probe_interval seconds (connector.breaker); a request hears "ask again"
    # at most ask_again times, then "no hit".
    probe_interval: float = 2.0
    ask_again: int = 2
    lease_ms: int = 30_000          # pages a lookup counted stay pinned until loaded
    lookups: LookupMode = LookupMode.PREFETCH
    # Prefetch: how long, in total per scheduler step, the loop may wait for the answers
    # of requests it sees for the first time. A lone request is then answered in the
    # step it arrives, and a burst costs the loop at most this
    # before the rest hear "ask again". An answer asked for again waits at most until
    # lookup_timeout after it was first asked, then counts as "no hit".
    lookup_wait_ms: float = 2.0
    # Hits shorter than this many tokens are reported as no hit (recomputed), per tier:
    # min_hit_tokens where the engine reads the store's pool (same host), and
    # remote_min_hit_tokens where every page crosses the network (shared_memory false, or
    # a store not on a loopback address). 0 = every hit counts. A request too short to
    # reach it is not looked up, nor, where every group is full attention, its pages saved
    # before it reaches it (connector.scheduler). Where a hit stops winning is measured:
    # `kvstore-bench e2e` prints it per model and tier (docs/connector.md renders it).
    min_hit_tokens: int = 0
    remote_min_hit_tokens: int = 0
    role: Role = Role.BOTH
    load_mode: LoadMode = LoadMode.LAYERWISE
    save: SavePolicy = SavePolicy.ALL
    salt: str = ""                  # namespace for pages (e.g. per deployment or tenant)
    model: str = ""                 # page namespace; "" = the engine's model name
    # The weights' revision in every layout, so pages of other weights never meet; ""
    # = the engine's revision, else a fingerprint of the weights' folder
    # (connector.revision). Set it where weights change under one folder or name.
    model_revision: str = ""
    token: str = ""                 # credentials for the store (bearer token)
    # TLS to a store across the network (SECURITY.md); "" = plain text, fine on loopback.
    tls_ca: str = ""                # PEM file of the CA that signed the server's certificate
    tls_cert: str = ""              # this engine's certificate and key (PEM files), for a
    tls_key: str = ""               # ... server that requires mutual TLS
    # The TCP congestion control of this engine's fast-path connections to the store,
    # which its saves' pages are sent under (a load's pages come under the server's
    # --data-congestion), e.g. "reno"; "" = the host's. On hosts that default to bbr, a
    # burst after an idle gap is paced: across a veth pair a 1 MiB put took 219 µs under
    # reno against 556 under bbr (docs/fastpath.md, TCP congestion control).
    data_congestion: str = ""
    shared_memory: bool | None = None   # None = use the shared pool when mappable
    # Seconds for store calls other than the lookup (Reserve, Acquire, Commit; a bulk
    # gRPC Put or Get gets more by its size: kvstore_client). It is what a store that
    # hangs costs an engine step when the worker meets it first: as lookup_timeout by
    # default, so a hang costs one step at most that on either side. A healthy control
    # call takes well under a millisecond on the store's host.
    timeout: float = 0.5
    # Without the shared pool (a store on another host, or shared_memory false) a load is
    # received layer by layer into pinned host memory and each layer copied to the GPU as
    # it lands (connector.worker.remote): this many bytes of it, in four slabs (each at least
    # one page's layer; a load's layer larger than a slab is received in page chunks) ...
    remote_staging_bytes: int = 512 << 20
    # ... over at most this many connections at once (a Get is split by pages; each
    # connection gets at least 16 MiB of it).
    remote_connections: int = 8
    # KV events (connector.events): while the engine publishes KV events (vLLM's
    # --kv-events-config), pages the store holds for it are announced on that stream as
    # BlockStored / BlockRemoved with this medium, the store polled every events_interval
    # seconds (a removal reaches the stream within about that). events false: never.
    events: bool = True
    events_interval: float = 0.5
    events_medium: str = "KVSTORE"
    # For testing only: a regular expression; the first load of each request whose id it
    # matches (re.search) fails as a store fault would, so a test can show what the
    # engine's kv_load_failure_policy does with it. "" = off.
    fail_loads: str = ""

    @classmethod
    def fields_of(cls, values: Mapping[str, Any]) -> dict[str, Any]:
        """The entries of `values` that name a field of this class, for an engine whose
        one settings mapping holds its own keys beside ours (SGLang's extra config): the
        others are the engine's, left to it."""
        known = {f.name for f in dataclasses.fields(cls)}
        return {name: value for name, value in values.items() if name in known}

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], role: str | None = None) -> ConnectorConfig:
        """Build from a plain dict (JSON config); ValueError names a bad key or value."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown kvstore connector settings: {sorted(unknown)} "
                             f"(known: {sorted(known)})")
        kwargs = dict(values)
        if role is not None:
            kwargs.setdefault("role", role)
        try:
            for name, enum_type in (("role", Role), ("load_mode", LoadMode),
                                    ("lookups", LookupMode), ("save", SavePolicy)):
                if name in kwargs and not isinstance(kwargs[name], enum_type):
                    kwargs[name] = enum_type(kwargs[name])
        except ValueError as exc:
            raise ValueError(f"kvstore connector config: {exc}") from None
        config = cls(**kwargs)
        if (config.page_tokens < 0 or config.lookup_timeout <= 0 or config.lease_ms < 0
                or config.probe_interval <= 0 or config.ask_again < 0
                or config.lookup_wait_ms < 0 or config.min_hit_tokens < 0
                or config.remote_min_hit_tokens < 0
                or config.remote_staging_bytes <= 0 or config.remote_connections <= 0
                or config.events_interval <= 0):
            raise ValueError("kvstore connector config: page_tokens must be >= 0, "
                             "lookup_timeout > 0, lease_ms >= 0, probe_interval > 0, "
                             "ask_again >= 0, lookup_wait_ms >= 0, min_hit_tokens and "
                             "remote_min_hit_tokens >= 0, remote_staging_bytes > 0, "
                             "remote_connections > 0 and events_interval > 0")
        try:
            re.compile(config.fail_loads)
        except re.error as exc:
            raise ValueError(f"kvstore connector config: fail_loads: {exc}") from None
        if config.data_congestion:
            # A name this host lacks stops the engine's start with the setting named
            # (KVStoreClient would refuse it too, without saying which setting).
            try:
                check_congestion(config.data_congestion)
            except CongestionRefused as exc:
                raise ValueError(f"kvstore connector config: data_congestion: {exc}"
                                 ) from None
        if bool(config.tls_cert) != bool(config.tls_key):
            raise ValueError("kvstore connector config: a client certificate needs both "
                             "tls_cert and tls_key")
        return config


def remote_store(config: ConnectorConfig) -> bool:
    """Whether pages cross the network: shared memory turned off, or a store that is not
    on this host's loopback (or a Unix socket). A store on this host named by another of
    its addresses counts as remote here (its pool is still mapped by the worker)."""
    if config.shared_memory is False:
        return True
    server = config.server
    if server.startswith("unix:"):
        return False
    host = (server.rsplit(":", 1)[0] if ":" in server else server).strip("[]")
    return not (host in ("localhost", "::1") or host.startswith("127."))


def min_hit_tokens(config: ConnectorConfig) -> int:
    """The floor under hits for this config's tier (remote_store)."""
    return config.remote_min_hit_tokens if remote_store(config) else config.min_hit_tokens


def open_client(config: ConnectorConfig, timeout: float, *, retries: int = 3,
                shared_memory: bool | None = None, data_connections: int = 4,
                local_socket: bool = False) -> KVStoreClient:
    """A client of config.server with the config's credentials (token, TLS);
    data_connections: most connections one Get is striped over; local_socket: see
    KVStoreClient."""
    return KVStoreClient(config.server, timeout=timeout, retries=retries,
                         shared_memory=shared_memory, token=config.token or None,
                         tls_ca=config.tls_ca or None, tls_cert=config.tls_cert or None,
                         tls_key=config.tls_key or None,
                         data_connections=data_connections, local_socket=local_socket,
                         data_congestion=config.data_congestion)
