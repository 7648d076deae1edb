"""kvstore-server: start the store, serve it over gRPC, stop cleanly on SIGTERM/SIGINT.

Threads. The main thread starts everything, then waits; signals run there (a SIGTERM or
SIGINT starts a `stopper` thread, a SIGHUP a `reloader` that re-reads the auth file).
gRPC calls run on the `rpc` pool (--workers + --lookup-streams threads) beside gRPC's own
C threads. Beside them: `evictor` (watermarks), `lease-reaper` (expired leases),
two `stream-watchdog` threads (streams that stop moving; lookup streams left idle),
`disk-health` and `disk-writer` (with a disk tier), `fast-accept-tcp`, `fast-accept-unix`
and one `fast-conn` per fast-path connection, `pool-handout` (with --shm-group), the
metrics port's HTTP thread, and with a far tier `kvstore-far-writer`, `kvstore-far-watch`
(far-only pages checked for what the cluster drops, far/watch.py), the `far-read` pool
and the cluster client's own threads.

Locks, in the only order they are taken (never the reverse): the store's lock
(`StoreState.lock`, a TimedLock: evictions spill under it) -> the disk tier's lock (its
`offer` copies into staging) -> the far writer's queue condition (a page leaving the
host). Every other lock (the fast-path server's, the stream gate's, the watchdog's, a
breaker's, the auth reload lock, the far watch's: its thread asks the store, the disk
tier and the cluster with it released) is a leaf: nothing else is taken while it is held.
Reads from the tiers below DRAM (store/below.py) and the copies of page bytes into and out
of the pool for clients happen outside the store's lock; a spill's copy into the disk
tier's staging is the one made under it.

Over 400 lines because Server is the wiring: every part built in start-up order with its
undoing registered beside it (_build, about 125 lines), start and stop beside it,
and the background loops that drive its parts. The process around it (signals during
start-up, systemd notices, exit codes: main and _run, about 85 lines) is a second idea
and the next split, leaving Server a module of its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvstore_protocol._proto.kvstore.v1 import admin_pb2, kvstore_pb2
from kvstore_protocol.congestion import CongestionRefused
from kvstore_protocol.grpc_frames import CHANNEL_OPTIONS
from kvstore_protocol.malloc import keep_freed_buffers, limit_arenas
from kvstore_protocol.presence_map import BEAT_SECONDS
from kvstore_protocol.units import format_size

from . import __version__
from .auth import Authenticator, tls_server_credentials
from .config import (
    ConfigError,
    ServerConfig,
    argument_parser,
    data_address,
    is_loopback,
    load_config,
)
from .disk.tier import DiskTier
from .far import wiring as far_wiring
from .fastpath import FastPathServer, SocketFolder, remove_stale_folders, socket_path
from .fastpath.tls import fast_tls_context
from .metrics import Metrics
from .parentwatch import watch_parent
from .preflight import check_host
from .region import Progress, Region, region_bytes, remove_own, remove_stale
from .removals import RemovalRing
from .rpc.admin_service import AdminService, add_admin_service
from .rpc.limits import RequestLimits, request_message_bytes
from .rpc.service import KVStoreService, add_kvstore_service
from .rpc.watchdog import StreamWatchdog
from .sdnotify import Notifier
from .startup import (
    EXIT_CANNOT_START,
    EXIT_PORT_TAKEN,
    PortTaken,
    bind_grpc,
    check_config,
    listen_error,
    progress_reporter,
)
from .store import Store
from .store.eviction import load_policy
from .store.retention import RetentionLimits
from .tier import TierChain

__all__ = ["Server", "main"]

log = logging.getLogger("kvstore_server")

SERVICES = ("kvstore.v1.KVStore", "kvstore.v1.Admin")
# The health service name of the disk tier (with --disk): NOT_SERVING once its writes
# failed. The server as a whole ("") stays SERVING then, degraded: DRAM serves as before
# and pages already on disk are still read; only spilling stopped.
DISK_HEALTH = "disk"


class Server:
    """The daemon's parts wired together, in start-up order; `start()`, then `stop()`.

    Start-up runs from the cheapest step to the most expensive, so a mistake costs as
    little as possible and nothing is left behind:

        settings parsed and checked (config.py)  ->  the host checked against them
        (preflight.py)  ->  the gRPC and metrics ports bound  ->  the disk tier opened
        ->  the pool file allocated (posix_fallocate), pre-faulted, locked  ->  serving,
        READY=1 to systemd

    Every step that holds something registers its undoing on an ExitStack; a step that
    fails (or a SIGTERM/SIGINT, which main() turns into an exception while starting)
    unwinds them all, so the pool file is removed and the ports closed before the one
    line that says why. Failures are ConfigErrors whose message starts with the setting.
    """

    def __init__(self, config: ServerConfig, progress: Progress | None = None) -> None:
        self.config = config
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        with contextlib.ExitStack() as undo:
            self._build(config, undo, progress)
            undo.pop_all()          # built: stop() undoes it from now on

    def _build(self, config: ServerConfig, undo: contextlib.ExitStack,
               progress: Progress | None) -> None:
        # Who may call (auth.py); None = no auth file, everyone is the default tenant.
        self.auth = Authenticator(config.auth_file) if config.auth_file else None
        try:
            tls = (tls_server_credentials(config.tls_cert, config.tls_key,
                                          config.tls_client_ca) if config.tls_cert else None)
        except OSError as exc:
            raise ConfigError(f"tls_cert/tls_key: {exc}") from None
        self.metrics = Metrics()
        self.grpc = grpc.server(
            # Each open LookupStream holds a thread (rpc/lookup_streams.py): they get their own.
            futures.ThreadPoolExecutor(max_workers=config.workers + config.lookup_streams,
                                       thread_name_prefix="rpc"),
            # Requests are bounded (rpc/limits.py): a smaller receive limit than clients'.
            options=[*[o for o in CHANNEL_OPTIONS if o[0] != "grpc.max_receive_message_length"],
                     ("grpc.max_receive_message_length",
                      request_message_bytes(config.max_keys_per_request)),
                     ("grpc.so_reuseport", 0)],
            interceptors=[self.auth.interceptor(self.metrics.refused)] if self.auth else None)
        undo.callback(self.grpc.stop, None)
        self.port = bind_grpc(self.grpc, config.listen, tls)
        if config.metrics_port:
            try:
                self.metrics.serve(config.metrics_port)
            except OSError as exc:
                raise listen_error("metrics_port", f"127.0.0.1:{config.metrics_port}",
                                   exc) from None
            undo.callback(self.metrics.stop)
        try:
            policy = load_policy(config.eviction_policy)
        except ValueError as exc:
            raise ConfigError(f"eviction_policy: {exc}") from None
        # Pages leaving this server, for engines' KV-event streams: DRAM, disk and the
        # far tier's watch record.
        removals = RemovalRing(config.removal_ring)
        self.disk: DiskTier | None = None
        if config.disk:
            try:
                self.disk = DiskTier(config.disk_dir, config.disk, policy=policy,
                                     removals=removals)
            except (OSError, RuntimeError) as exc:
                raise ConfigError(f"disk_dir: {exc}") from None
            undo.callback(self.disk.close)
            stats = self.disk.stats()
            log.info("disk tier: %s in %s, %d pages found on disk (%.2fs), %s I/O",
                     format_size(config.disk), config.disk_dir, stats.pages,
                     stats.rebuild_seconds, "direct" if stats.direct_io else "buffered")
        try:
            self.far = far_wiring.open_far(config)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.far is not None:
            undo.callback(self.far.close)
        # The Unix socket's private folder, before the pool: the pool's name is visible
        # for the seconds its allocation takes, and a name derived from it in a folder
        # anyone may write could be taken or blocked by another user meanwhile
        # (kvstore_server.fastpath.unixsock).
        # With --shm-group the pool's hand-out socket lies in it too (kvstore_server.region).
        self.sockets: SocketFolder | None = None
        if config.data_socket or config.shm_group:
            base = config.socket_dir or config.shm_dir
            remove_stale_folders(base)
            try:
                self.sockets = SocketFolder(base, _group_id(config.shm_group))
            except (OSError, KeyError) as exc:
                raise ConfigError(f"socket_dir: cannot make a folder for the Unix socket "
                                  f"in {base}: {exc}") from None
            undo.callback(self.sockets.close)
        size = region_bytes(config.dram)
        log.info("allocating and pre-faulting the pool: %s in %s", format_size(size),
                 config.shm_dir)
        started = time.monotonic()
        undo.callback(remove_own, config.shm_dir)
        try:
            self.region = Region(size, config.shm_dir, config.shm_group, progress,
                                 socket_folder=self.sockets.path if self.sockets else "")
        except OSError as exc:
            raise ConfigError(f"dram: cannot allocate {format_size(size)} in shm_dir "
                              f"{config.shm_dir}: {exc.strerror}") from None
        undo.callback(self.region.close)
        self.region.prefault()
        self.region.lock()
        log.info("pool ready in %.1fs", time.monotonic() - started)
        self.store = Store(self.region, lease_ttl=config.lease_ttl,
                           lease_memory=config.lease_memory,
                           max_layouts=config.max_layouts,
                           high_watermark=config.high_watermark,
                           low_watermark=config.low_watermark,
                           lower=TierChain([t for t in (self.disk, self.far) if t is not None]),
                           policy=policy, through=far_wiring.through(self.far),
                           presence=True,
                           retention=RetentionLimits(config.retention_quota,
                                                     config.retention_sessions),
                           removals=removals)
        # The far tier writes each layout's record beside its pages, so that Invalidate
        # finds the layouts of a model that only other servers registered (far/records.py)
        far_wiring.know_layouts(self.far, self.store.info)
        # Pages only the far tier holds for this server are checked, so that what the
        # cluster removes by itself (--far-ttl, maxmemory) reaches the ring (far/watch.py)
        far_wiring.watch(self.far, removals, self.store.in_dram, self.disk)
        log.info("presence map: %s", "on (same-host clients answer misses without a call)"
                 if self.store.presence is not None else
                 "off (a tier below DRAM holds pages the map cannot see)")
        # DRAM's families and each tier's below, each registered by its owner.
        self.store.register_metrics(self.metrics.registry)
        self.metrics.gauge("kvstore_lookup_streams", "Open LookupStream calls",
                           lambda: self.lookups.open_streams())
        self.streams = StreamWatchdog(config.stream_timeout)
        # One limits object for both paths: they refuse the same requests alike.
        self.limits = RequestLimits(config.max_keys_per_request)
        # Where the fast path's Unix socket will be, for Attach to report ("" = none).
        self.unix_socket = socket_path(self.sockets.path) \
            if self.sockets is not None and config.data_socket else ""
        self.lookups = add_kvstore_service(
            self.grpc, KVStoreService(self.store, self.metrics, self.auth, self.limits,
                                      self.unix_socket),
            self.streams,
            config.lookup_streams, config.workers)
        add_admin_service(self.grpc, AdminService(self.store, self.metrics, self.auth))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection(
            (*SERVICES, health.SERVICE_NAME, reflection.SERVICE_NAME,
             kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name,
             admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name), self.grpc)
        self.fast = self._fast_path(config)
        if self.fast is not None:
            undo.callback(self.fast.stop)

    def _fast_path(self, config: ServerConfig) -> FastPathServer | None:
        """The fast path beside gRPC (kvstore_server.fastpath), or None when off."""
        tcp = data_address(config)
        if tcp is None and not self.unix_socket:
            return None
        tls = fast_tls_context(config.tls_cert, config.tls_key, config.tls_client_ca)
        make = lambda tcp: FastPathServer(  # noqa: E731
            self.store, self.metrics, self.auth, tcp=tcp, unix=self.unix_socket, tls=tls,
            max_connections=config.data_connections, stream_timeout=config.stream_timeout,
            hello_connections=config.data_hello_connections,
            limits=self.limits, congestion=config.data_congestion)
        try:
            return make(tcp)
        except CongestionRefused as exc:
            raise ConfigError(f"data_congestion: {exc}") from None
        except OSError as exc:
            if config.data_listen.strip().lower() != "auto":
                raise listen_error("data_listen", config.data_listen, exc) from None
            log.warning("fast path: port %s:%d is taken (%s); serving it on the Unix "
                        "socket only, remote clients use gRPC", *(tcp or ("", 0)), exc)
            return make(None) if self.unix_socket else None

    def start(self) -> None:
        self.grpc.start()
        for name in ("", *SERVICES):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        workers = [(self._evictor, "evictor"), (self._reaper, "lease-reaper")]
        if self.store.presence is not None:
            workers.append((self._beat, "presence-beat"))
        if self.disk is not None:
            self.health.set(DISK_HEALTH, health_pb2.HealthCheckResponse.SERVING)
            workers.append((self._watch_disk, "disk-health"))
        for target, name in workers:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        self.streams.start()
        self.lookups.start()
        if self.fast is not None:
            self.fast.start()
            log.info("fast path on %s%s%s%s", f"tcp port {self.fast.port}" if self.fast.port
                     else "no tcp port", " (TLS)" if self.fast.port and self.fast.tls else "",
                     f" (TCP congestion control {self.fast.congestion})"
                     if self.fast.port else "",
                     f", unix socket {self.fast.unix_path}" if self.fast.unix_path else "")
        host = self.config.listen.rpartition(":")[0]
        log.info("kvstore-server %s listening on %s:%d; pool %s in %s%s; lease ttl %.3gs",
                 __version__, host, self.port, format_size(self.store.pool.capacity_bytes),
                 self.region.path, "" if self.region.locked else " (not locked)",
                 self.config.lease_ttl)
        if self.config.metrics_port:
            log.info("metrics on http://127.0.0.1:%d/metrics", self.config.metrics_port)
        self._log_security(host)

    def _log_security(self, host: str) -> None:
        c = self.config
        tls = ("mutual TLS" if c.tls_client_ca else "TLS") if c.tls_cert else "no TLS"
        if self.auth is None:
            log.info("auth: off (no --auth-file): every caller is one tenant and may use "
                     "Admin; %s", tls)
        else:
            tenants, admins = self.auth.counts()
            log.info("auth: %d tenants, %d admins from %s (SIGHUP reloads); %s", tenants,
                     admins, c.auth_file, tls)
            if self.auth.certificates() and not c.tls_client_ca:
                log.warning("the auth file names %d client certificates (cert_sha256), but "
                            "without --tls-client-ca no client presents one: those "
                            "entries can only be reached by token", self.auth.certificates())
        if not is_loopback(host):
            if self.auth is not None and not c.tls_cert:
                log.warning("auth is on but TLS is off on %s: bearer tokens and pages "
                            "travel in clear text; add --tls-cert/--tls-key", c.listen)
            elif self.auth is None and not c.tls_client_ca:
                log.warning("listening on %s with no auth (--insecure-listen): anyone who "
                            "reaches the port can read, overwrite or clear every page",
                            c.listen)

    def reload(self) -> None:
        """SIGHUP: read the auth file again (a bad file keeps the tokens in force)."""
        if self.auth is None:
            log.info("SIGHUP: nothing to reload (no --auth-file)")
        else:
            self.auth.reload()

    def _evictor(self) -> None:
        # Background eviction keeps usage under the high watermark so puts rarely have to
        # evict on the request path; it wakes when a reservation crosses the watermark.
        while not self._stopping.is_set():
            self.store.pressure.wait(0.1)
            if self._stopping.is_set():
                return
            try:
                evicted = self.store.evict_to_watermark()
                if evicted:
                    log.debug("evicted %d pages to the low watermark", evicted)
            except Exception:                   # keep evicting whatever happened
                log.exception("background eviction failed")

    def _reaper(self) -> None:
        period = min(0.1, self.config.lease_ttl / 10)
        while not self._stopping.wait(period):
            try:
                self.store.expire_leases()
            except Exception:
                log.exception("lease expiry failed")

    def _beat(self) -> None:
        # Same-host clients trust the presence map only while this beats
        # (kvstore_protocol.presence_map.LIVE_SECONDS).
        presence = self.store.presence
        while presence is not None and not self._stopping.wait(BEAT_SECONDS):
            presence.beat()

    def _watch_disk(self) -> None:
        # The tier only ever fails one way (writes stop, for good): report it once.
        disk = self.disk
        while disk is not None and not self._stopping.wait(0.5):
            if disk.stats().failed:
                self.health.set(DISK_HEALTH, health_pb2.HealthCheckResponse.NOT_SERVING)
                return

    def stop(self, grace: float = 5.0) -> None:
        """Refuse new calls, let running ones finish for `grace` seconds, free the pool."""
        if self._stopping.is_set():
            return
        log.info("stopping: draining calls for up to %.0fs", grace)
        for name in ("", *SERVICES, *((DISK_HEALTH,) if self.disk is not None else ())):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._stopping.set()
        if self.store.presence is not None:
            self.store.presence.stop()    # clients ask the server again from now on
        self.store.pressure.set()
        self.lookups.stop()
        if self.fast is not None:
            self.fast.stop()
        self.grpc.stop(grace).wait()
        self.metrics.stop()
        self.streams.stop()
        for thread in self._threads:
            thread.join(timeout=2)
        if self.store.lower.holds_pages and self.config.flush_on_stop:
            offered, left = self.store.spill_all(self.config.flush_timeout)
            # "flushed DRAM to disk: ..." is what operators look for (deploy/README.md).
            below = " and ".join(str(t.name) for t in (self.disk, self.far) if t is not None)
            log.info("flushed DRAM to %s: %d pages offered, %d not written in %.0fs",
                     below, offered, left, self.config.flush_timeout)
        if self.disk is not None:
            self.disk.close()
        if self.far is not None:
            self.far.close()
        self.region.close()
        if self.sockets is not None:
            self.sockets.close()
        log.info("stopped")

    def wait(self) -> None:
        self.grpc.wait_for_termination()


def _group_id(name: str) -> int:
    """The gid of group name; -1 for "" (this process's own group)."""
    if not name:
        return -1
    import grp
    return grp.getgrnam(name).gr_gid


class _StopDuringStartUp(BaseException):
    """SIGTERM or SIGINT arrived while the server was starting (BaseException, like
    KeyboardInterrupt, so no `except Exception` on the way swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop_starting(signum: int, _frame) -> None:
    # Once: a second signal must not interrupt the clean-up the first one started.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise _StopDuringStartUp(signum)


def main(argv: list[str] | None = None) -> int:
    # The handlers go in first: a SIGTERM or Ctrl-C at any point of start-up unwinds it
    # (pool file removed) with one line, not a traceback or a leaked pool.
    signal.signal(signal.SIGTERM, _stop_starting)
    signal.signal(signal.SIGINT, _stop_starting)
    watch_parent()        # after the handlers: the watch stops the server by SIGTERM
    try:
        return _run(argv)
    except _StopDuringStartUp as exc:
        print(f"kvstore-server: stopped by {exc} during start-up; nothing left behind",
              file=sys.stderr)
        return 128 + exc.signum


def _run(argv: list[str] | None) -> int:
    check_only = argument_parser().parse_args(argv).check_config
    try:
        config = load_config(argv)
    except ConfigError as exc:
        print(f"kvstore-server: {exc}", file=sys.stderr)
        return 2
    if check_only:
        return check_config(config)
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    keep_freed_buffers()
    limit_arenas()
    notifier = Notifier()
    try:
        # Pools of servers killed before they could stop: first, so their space counts
        # as free in the checks.
        remove_stale(config.shm_dir)
        check_host(config, region_bytes(config.dram))
        server = Server(config, progress_reporter(notifier))
    except (ConfigError, OSError, ValueError, RuntimeError) as exc:
        log.error("cannot start: %s", exc)
        notifier.notify(STATUS=f"cannot start: {exc}")
        return EXIT_PORT_TAKEN if isinstance(exc, PortTaken) else EXIT_CANNOT_START

    def on_signal(signum, _frame):
        log.info("received %s", signal.Signals(signum).name)
        notifier.notify(STOPPING=1, STATUS="stopping")
        threading.Thread(target=server.stop, name="stopper").start()

    try:
        server.start()
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
    except _StopDuringStartUp:
        server.stop(grace=0)
        raise
    # Reload in a thread: the handler runs on the main thread between its waits.
    signal.signal(signal.SIGHUP, lambda _s, _f: threading.Thread(
        target=server.reload, name="reloader", daemon=True).start())
    notifier.notify(READY=1, STATUS=f"serving on {config.listen}", MAINPID=os.getpid())
    server.wait()
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
