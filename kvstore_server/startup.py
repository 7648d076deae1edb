"""Start-up steps of kvstore-server that stand alone: binding the gRPC port with a reason,
--check-config, and pool progress reported to systemd."""

from __future__ import annotations

import errno
import socket
import sys
import time

import grpc

from kvstore_protocol.units import format_size

from .config import ConfigError, ServerConfig
from .preflight import check_host
from .region import Progress, region_bytes
from .sdnotify import Notifier

__all__ = ["EXIT_CANNOT_START", "EXIT_PORT_TAKEN", "PortTaken", "bind_grpc", "check_config",
           "progress_reporter"]

# Exit status of a start-up refused for a setting (sysexits' EX_CONFIG; 2 = bad usage):
# distinct from 1, a crash, so a systemd unit can restart after a crash but not loop on a
# mistake that will fail the same way every time (RestartPreventExitStatus=2 78).
EXIT_CANNOT_START = 78

# Exit status of a start-up that found a port held by another process (sysexits'
# EX_TEMPFAIL). Not a setting that fails the same way every time: the holder may be the
# previous server still stopping, or another local user who bound the port first, and
# whatever another user did must not leave the unit stopped for good. So it is not 78, and
# systemd restarts the server (RestartPreventExitStatus lists 2 and 78 only) until the
# port is free, logging each try.
EXIT_PORT_TAKEN = 75


class PortTaken(ConfigError):
    """A port the server must listen on is held by another process (EADDRINUSE)."""


def listen_error(setting: str, address: str, exc: OSError) -> ConfigError:
    """The error for a port that could not be bound: PortTaken when another process holds
    it, a plain ConfigError (a setting to fix) otherwise."""
    cls = PortTaken if exc.errno == errno.EADDRINUSE else ConfigError
    return cls(f"{setting}: cannot listen on {address}: {exc.strerror or exc}")


def bind_grpc(server: grpc.Server, listen: str, tls) -> int:
    """Bind the gRPC port now, before the pool exists: grpcio binds in add_*_port and
    raises RuntimeError (or returns 0) when it cannot, without saying why; a plain
    socket's bind to the same address gives the reason."""
    try:
        port = (server.add_secure_port(listen, tls) if tls is not None
                else server.add_insecure_port(listen))
    except RuntimeError:
        port = 0
    if port == 0:
        raise bind_error(listen)
    return port


def bind_error(listen: str) -> ConfigError:
    """Why gRPC could not bind listen, from a plain socket's bind to the same address."""
    host, _, port = listen.rpartition(":")
    try:
        infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return ConfigError(f"listen: cannot listen on {listen}: cannot resolve {host}: "
                           f"{exc.strerror}")
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.bind(address)
        except OSError as exc:
            return listen_error("listen", listen, exc)
    return ConfigError(f"listen: cannot listen on {listen}: refused by gRPC")


def check_config(config: ServerConfig) -> int:
    """--check-config: the checks of a start-up that need no port and no pool."""
    try:
        check_host(config, region_bytes(config.dram))
    except ConfigError as exc:
        print(f"kvstore-server: {exc}", file=sys.stderr)
        return EXIT_CANNOT_START
    disk = (f"disk tier {format_size(config.disk)} in {config.disk_dir}" if config.disk
            else "no disk tier")
    metrics = f"metrics on 127.0.0.1:{config.metrics_port}" if config.metrics_port else ""
    print(f"kvstore-server: config OK: listen {config.listen}, pool "
          f"{format_size(config.dram)} in {config.shm_dir}, {disk}"
          + (f", {metrics}" if metrics else "")
          + " (ports are checked at start: they may be held by a running server)")
    return 0


def progress_reporter(notifier: Notifier) -> Progress:
    """Pool start-up progress to systemd (STATUS, and more start time while it moves)."""
    last = [0.0]

    def report(done: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] >= 1.0 or done == total:
            last[0] = now
            notifier.notify(STATUS=f"preparing the pool: {100 * done // total}%",
                            EXTEND_TIMEOUT_USEC=60_000_000)
    return report
