"""kvstore-server: start the store, serve it over gRPC, stop cleanly on SIGTERM/SIGINT."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvstore_client._proto.kvstore.v1 import admin_pb2, kvstore_pb2
from kvstore_client.wire import CHANNEL_OPTIONS

from . import __version__
from .admin_service import AdminService, add_admin_service
from .auth import Authenticator, tls_server_credentials
from .config import ConfigError, ServerConfig, data_address, is_loopback, load_config
from .fastpath import FastPathServer
from .fastpath.tls import fast_tls_context
from .disk import DiskTier
from kvstore_client.malloc import keep_freed_buffers, limit_arenas
from .metrics import Metrics
from .region import HEADER_BYTES, Region, remove_stale
from .service import KVStoreService, add_kvstore_service
from .store import Store
from .watchdog import StreamWatchdog
from kvstore_client.units import format_size

__all__ = ["Server", "main"]

log = logging.getLogger("kvstore_server")

SERVICES = ("kvstore.v1.KVStore", "kvstore.v1.Admin")


class Server:
    """The daemon's parts wired together; `start()`, then `stop()`."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        # Who may call (auth.py); None = no auth file, everyone is the default tenant.
        # Read first, with the TLS files, so a bad file fails before the pool exists.
        self.auth = Authenticator(config.auth_file) if config.auth_file else None
        tls = (tls_server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
               if config.tls_cert else None)
        # Rounded up to 2 MiB so the region can live on hugetlbfs, whose files must be a
        # whole number of huge pages.
        size = -(-(config.dram // 4096 * 4096 + HEADER_BYTES) // (2 << 20)) * (2 << 20)
        remove_stale(config.shm_dir)      # pools of servers killed before they could stop
        self.region = Region(size, config.shm_dir, config.shm_group)
        self.region.prefault()
        self.region.lock()
        self.disk = None
        if config.disk:
            self.disk = DiskTier(config.disk_dir, config.disk)
            stats = self.disk.stats()
            log.info("disk tier: %s in %s, %d pages found on disk (%.2fs), %s I/O",
                     format_size(config.disk), config.disk_dir, stats["pages"],
                     stats["rebuild_seconds"], "direct" if stats["direct_io"] else "buffered")
        self.store = Store(self.region, lease_ttl=config.lease_ttl,
                           high_watermark=config.high_watermark,
                           low_watermark=config.low_watermark, lower=self.disk)
        self.metrics = Metrics()
        self.metrics.watch_store(self.store.stats, lambda: {"kvstore_lookup_streams": (
            "gauge", "Open LookupStream calls", self.lookups.open_streams())})
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self.grpc = grpc.server(
            # Each open LookupStream holds a thread (lookup_streams.py): they get their own.
            futures.ThreadPoolExecutor(max_workers=config.workers + config.lookup_streams,
                                       thread_name_prefix="rpc"),
            options=[*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0)],
            interceptors=[self.auth.interceptor(self.metrics.refused)] if self.auth else None)
        self.streams = StreamWatchdog(config.stream_timeout)
        self.lookups = add_kvstore_service(
            self.grpc, KVStoreService(self.store, self.metrics, self.auth), self.streams,
            config.lookup_streams)
        add_admin_service(self.grpc, AdminService(self.store, self.metrics, self.auth))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection(
            (*SERVICES, health.SERVICE_NAME, reflection.SERVICE_NAME,
             kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name,
             admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name), self.grpc)
        if tls is not None:
            self.port = self.grpc.add_secure_port(config.listen, tls)
        else:
            self.port = self.grpc.add_insecure_port(config.listen)
        if self.port == 0:
            raise ConfigError(f"cannot listen on {config.listen} (in use or not allowed)")
        self.fast = self._fast_path(config)

    def _fast_path(self, config: ServerConfig) -> FastPathServer | None:
        """The fast path beside gRPC (kvstore_server.fastpath), or None when off."""
        tcp = data_address(config)
        if tcp is None and not config.data_socket:
            return None
        tls = fast_tls_context(config.tls_cert, config.tls_key, config.tls_client_ca)
        make = lambda tcp: FastPathServer(  # noqa: E731
            self.store, self.metrics, self.auth, tcp=tcp, unix=config.data_socket, tls=tls,
            max_connections=config.data_connections, stream_timeout=config.stream_timeout)
        try:
            return make(tcp)
        except OSError as exc:
            if config.data_listen.strip().lower() != "auto":
                raise ConfigError(f"cannot listen on data_listen {config.data_listen}: "
                                  f"{exc}") from None
            log.warning("fast path: port %s:%d is taken (%s); serving it on the Unix "
                        "socket only, remote clients use gRPC", tcp[0], tcp[1], exc)
            return make(None) if config.data_socket else None

    def start(self) -> None:
        self.grpc.start()
        for name in ("", *SERVICES):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        for target, name in ((self._evictor, "evictor"), (self._reaper, "lease-reaper")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        self.streams.start()
        self.lookups.start()
        if self.fast is not None:
            self.fast.start()
            log.info("fast path on %s%s%s", f"tcp port {self.fast.port}" if self.fast.port
                     else "no tcp port", " (TLS)" if self.fast.port and self.fast.tls else "",
                     f", unix socket {self.fast.unix_path}" if self.fast.unix_path else "")
        if self.config.metrics_port:
            self.metrics.serve(self.config.metrics_port)
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
            except Exception:  # noqa: BLE001 - keep evicting whatever happened
                log.exception("background eviction failed")

    def _reaper(self) -> None:
        period = min(0.1, self.config.lease_ttl / 10)
        while not self._stopping.wait(period):
            try:
                self.store.expire_leases()
            except Exception:  # noqa: BLE001
                log.exception("lease expiry failed")

    def stop(self, grace: float = 5.0) -> None:
        """Refuse new calls, let running ones finish for `grace` seconds, free the pool."""
        if self._stopping.is_set():
            return
        log.info("stopping: draining calls for up to %.0fs", grace)
        for name in ("", *SERVICES):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._stopping.set()
        self.store.pressure.set()
        self.lookups.stop()
        if self.fast is not None:
            self.fast.stop()
        self.grpc.stop(grace).wait()
        self.metrics.stop()
        self.streams.stop()
        for thread in self._threads:
            thread.join(timeout=2)
        if self.disk is not None:
            if self.config.flush_on_stop:
                offered, left = self.store.spill_all(self.config.flush_timeout)
                log.info("flushed DRAM to disk: %d pages offered, %d not written in %.0fs",
                         offered, left, self.config.flush_timeout)
            self.disk.close()
        self.region.close()
        log.info("stopped")

    def wait(self) -> None:
        self.grpc.wait_for_termination()


def main(argv: list[str] | None = None) -> int:
    try:
        config = load_config(argv)
    except ConfigError as exc:
        print(f"kvstore-server: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    keep_freed_buffers()
    limit_arenas()
    try:
        server = Server(config)
    except (ConfigError, OSError, ValueError) as exc:
        log.error("cannot start: %s", exc)
        return 1
    server.start()

    def on_signal(signum, _frame):
        log.info("received %s", signal.Signals(signum).name)
        threading.Thread(target=server.stop, name="stopper").start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # Reload in a thread: the handler runs on the main thread between its waits.
    signal.signal(signal.SIGHUP, lambda _s, _f: threading.Thread(
        target=server.reload, name="reloader").start())
    server.wait()
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
