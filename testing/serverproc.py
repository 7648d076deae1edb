"""Start a real kvstore-server process on a free loopback port, for tests and benchmarks."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

__all__ = ["ServerProcess", "fleet_secret_file", "free_port", "free_port_pair", "sigstop"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair() -> int:
    """A free port whose next port is free too: the server's fast path listens on the
    gRPC port + 1 by default, and skips TCP when that port is taken."""
    for _ in range(100):
        port = free_port()
        if port >= 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    return free_port()


def fleet_secret_file() -> str:
    """A far-tier secret file shared by every server these helpers start (one fleet), so
    servers with --far and no secret of their own start, and read each other's pages."""
    path = os.path.join(tempfile.gettempdir(), f"kvstore-test-far-secret-{os.getuid()}")
    if not os.path.exists(path):
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path))
        with os.fdopen(fd, "w") as f:
            f.write(os.urandom(32).hex() + "\n")
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)          # atomic and first wins: one secret, one whole file
        os.unlink(tmp)
    return path


class ServerProcess:
    """`kvstore-server` as a child process; `with ServerProcess(dram="64MiB") as srv:`.

    Extra keyword arguments become flags (`lease_ttl="1s"` -> `--lease-ttl 1s`). The
    process is stopped (SIGTERM, then SIGKILL) on exit; its log is kept in `self.log_path`.
    credentials: how the health check reaches a server started with --tls-cert.
    host: the address it listens on; prefix: a command it runs under (`ip netns exec NS`,
    bench/netns.py: a server "on another host").
    """

    def __init__(self, *args: str, port: int | None = None, env: dict | None = None,
                 credentials: grpc.ChannelCredentials | None = None, host: str = "127.0.0.1",
                 prefix: list[str] | tuple[str, ...] = (), **flags) -> None:
        self.credentials = credentials
        self.port = port or free_port_pair()
        self.address = f"{host}:{self.port}"
        self.prefix = list(prefix)
        self.args = list(args)
        flags.setdefault("dram", "64MiB")
        if flags.get("far") and "far_secret_file" not in flags and "far_insecure" not in flags:
            flags["far_secret_file"] = fleet_secret_file()    # one fleet: every test server
        for name, value in flags.items():
            self.args += ["--" + name.replace("_", "-"), str(value)]
        # The server ends with this process even when it is killed before it can stop
        # the server (kvstore_server.parentwatch); `env` may say otherwise.
        self.env = {**os.environ, "KVSTORE_EXIT_WITH_PARENT": "1", **(env or {})}
        self.proc: subprocess.Popen | None = None
        fd, self.log_path = tempfile.mkstemp(prefix="kvstore-server-", suffix=".log")
        os.close(fd)

    def start(self, wait: float = 20.0) -> ServerProcess:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - the server's, closed at stop
        self.proc = subprocess.Popen(
            [*self.prefix, sys.executable, "-m", "kvstore_server.main", "--listen",
             self.address, *self.args],
            stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        self.wait_healthy(wait)
        return self

    def wait_healthy(self, wait: float = 20.0) -> None:
        deadline = time.monotonic() + wait
        with (grpc.insecure_channel(self.address) if self.credentials is None else
              grpc.secure_channel(self.address, self.credentials)) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"kvstore-server exited with {self.proc.returncode}:\n"
                                       + self.log())
                try:
                    resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("kvstore-server did not become healthy:\n" + self.log())
                time.sleep(0.05)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def send_signal(self, sig: int) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def sigstop(pid: int) -> None:
    """Stop the process and wait until it is stopped (delivery is asynchronous)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return
        time.sleep(0.01)
