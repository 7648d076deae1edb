"""Start a real Valkey or Redis Cluster on loopback ports, for tests and benchmarks.

`with ClusterProcess(masters=3, replicas=1) as cluster:` starts `valkey-server` (or
`redis-server`) processes in a temporary folder, one per node, joins them with
`valkey-cli --cluster create` (the tool the servers ship, which also assigns replicas
and waits for the slot map to agree), and on exit stops every node and removes the
folder. Nodes persist nothing (no RDB, no AOF): a killed master comes back empty.

Ports: each node takes a client port and a cluster-bus port, both picked free on
127.0.0.1 (`cluster-port`, Redis >= 7 / Valkey), so parallel runs do not collide.
`cluster-node-timeout` is short (1 s by default) so a failover takes seconds, not the
15 s default, in tests that kill a master.

TLS and ACL users (`tls=TlsFiles(...)`, `users=("kv on >pw ~* +@all",)`): each node
then also listens on a TLS port (`tls-port`, `tls-cluster yes` so the cluster bus and
the slot map are TLS too, clients not asked for certificates), and `urls` are
`rediss://` URLs of those ports; the plain port stays open on loopback for the cli that
this module drives. `users` are ACL rules (`user` lines) added to the default user.

Where the binaries come from: `server_binaries()` looks for valkey-server then
redis-server on PATH (CI installs Debian's redis-server in .ci/run); None when neither
can be had, which tests turn into a skip that says so.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass

__all__ = ["ClusterNode", "ClusterProcess", "TlsFiles", "server_binaries"]


def server_binaries() -> tuple[str, str] | None:
    """(server, cli) paths of Valkey's or Redis's binaries, or None where neither is on PATH."""
    for server, cli in (("valkey-server", "valkey-cli"), ("redis-server", "redis-cli")):
        found = shutil.which(server), shutil.which(cli)
        if found[0] and found[1]:
            return found[0], found[1]
    return None


def _free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (held open together while picked, so distinct)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files of a TLS cluster: every node's certificate and key, and the CA."""

    cert: str
    key: str
    ca: str


@dataclass(slots=True)
class ClusterNode:
    """One server process of the cluster."""

    port: int
    bus_port: int
    proc: subprocess.Popen | None = None
    tls_port: int = 0               # 0: no TLS port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class ClusterProcess:
    """A cluster of `masters` masters with `replicas` replicas each, torn down on exit."""

    def __init__(self, masters: int = 3, replicas: int = 0, node_timeout_ms: int = 1000,
                 binaries: tuple[str, str] | None = None, tls: TlsFiles | None = None,
                 users: tuple[str, ...] = ()) -> None:
        found = binaries or server_binaries()
        if found is None:
            raise FileNotFoundError("no valkey-server or redis-server (with its cli) on PATH")
        self.server, self.cli = found
        self.masters, self.replicas = masters, replicas
        self.node_timeout_ms = node_timeout_ms
        self.dir = tempfile.mkdtemp(prefix="kvstore-cluster-")
        self.tls, self.users = tls, users
        count = masters * (1 + replicas)
        ports = _free_ports(3 * count)
        self.nodes = [ClusterNode(ports[3 * i], ports[3 * i + 1],
                                  tls_port=ports[3 * i + 2] if tls else 0)
                      for i in range(count)]

    @property
    def urls(self) -> list[str]:
        """redis:// URLs of every node (rediss:// of the TLS ports): what `--far` takes."""
        if self.tls:
            return [f"rediss://127.0.0.1:{n.tls_port}" for n in self.nodes]
        return [f"redis://{n.address}" for n in self.nodes]

    def _extra_args(self, node: ClusterNode) -> list[str]:
        args = []
        if self.tls:
            args += ["--tls-port", str(node.tls_port), "--tls-cert-file", self.tls.cert,
                     "--tls-key-file", self.tls.key, "--tls-ca-cert-file", self.tls.ca,
                     "--tls-cluster", "yes", "--tls-replication", "yes",
                     "--tls-auth-clients", "no"]
        for rule in self.users:
            args += ["--user", *rule.split()]
        return args

    def start(self, wait: float = 30.0) -> ClusterProcess:
        try:
            for node in self.nodes:
                self._spawn(node)
            for node in self.nodes:
                self._wait_ping(node, wait)
            subprocess.run(
                [self.cli, "--cluster", "create", *(n.address for n in self.nodes),
                 "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                check=True, capture_output=True, timeout=wait)
            self.wait_ok(wait)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, node: ClusterNode) -> None:
        d = os.path.join(self.dir, str(node.port))
        os.makedirs(d, exist_ok=True)
        log = open(os.path.join(d, "server.log"), "ab")  # noqa: SIM115 - the node's; closed once it has it
        node.proc = subprocess.Popen(
            [self.server, "--port", str(node.port), "--cluster-port", str(node.bus_port),
             "--bind", "127.0.0.1", "--dir", d, "--cluster-enabled", "yes",
             "--cluster-config-file", "nodes.conf",
             "--cluster-node-timeout", str(self.node_timeout_ms),
             "--save", "", "--appendonly", "no", "--daemonize", "no",
             "--protected-mode", "no", "--logfile", "",
             # replicas sync at once (not after the 5 s diskless delay), and a replica
             # may take over whatever its lag: a test kills masters on purpose
             "--repl-diskless-sync-delay", "0", "--cluster-replica-validity-factor", "0",
             # as docs/far.md advises for a cache: the shards still up keep serving
             # while one is failing over, instead of the whole cluster refusing
             "--cluster-require-full-coverage", "no", *self._extra_args(node)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()

    def cli_call(self, node: ClusterNode, *args: str, timeout: float = 5.0) -> str:
        """One command through the cli on one node; its reply as text."""
        out = subprocess.run([self.cli, "-h", "127.0.0.1", "-p", str(node.port), *args],
                             capture_output=True, text=True, timeout=timeout)
        return out.stdout

    def _wait_ping(self, node: ClusterNode, wait: float) -> None:
        deadline = time.monotonic() + wait
        while True:
            if node.proc.poll() is not None:
                raise RuntimeError(f"{self.server} on port {node.port} exited with "
                                   f"{node.proc.returncode}: {self.log(node)}")
            try:
                with socket.create_connection(("127.0.0.1", node.port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"node on port {node.port} did not answer PING")
            time.sleep(0.05)

    def wait_ok(self, wait: float = 30.0) -> None:
        """Until every live node says cluster_state:ok (slots all served, maps agree)
        and every live replica has finished its sync (else it cannot take over)."""
        deadline = time.monotonic() + wait
        while True:
            live = [n for n in self.nodes if n.alive]
            if (all("cluster_state:ok" in self.cli_call(n, "cluster", "info") for n in live)
                    and all("master_link_status:down" not in
                            self.cli_call(n, "info", "replication") for n in live)):
                return
            if time.monotonic() > deadline:
                raise RuntimeError("cluster did not reach cluster_state:ok")
            time.sleep(0.1)

    def master_nodes(self) -> list[ClusterNode]:
        """The live nodes that are masters now (roles change on failover)."""
        return [n for n in self.nodes
                if n.alive and self.cli_call(n, "role").startswith("master")]

    def slots_of(self, node: ClusterNode) -> set[int]:
        """The hash slots the node serves now (none for a replica)."""
        for line in self.cli_call(node, "cluster", "nodes").splitlines():
            fields = line.split()
            if len(fields) > 8 and "myself" in fields[2]:
                slots: set[int] = set()
                for part in fields[8:]:
                    if not part.startswith("["):        # [slot->-node]: migrating
                        lo, _, hi = part.partition("-")
                        slots.update(range(int(lo), int(hi or lo) + 1))
                return slots
        return set()

    def kill(self, node: ClusterNode, sig: int = signal.SIGKILL) -> None:
        if node.alive:
            node.proc.send_signal(sig)
            node.proc.wait(10)

    def restart(self, node: ClusterNode) -> None:
        """Start a killed node again; it rejoins from its nodes.conf (empty of data)."""
        self._spawn(node)
        self._wait_ping(node, 30)

    def log(self, node: ClusterNode) -> str:
        try:
            with open(os.path.join(self.dir, str(node.port), "server.log"),
                      errors="replace") as f:
                return f.read()[-4000:]
        except OSError:
            return ""

    def stop(self) -> None:
        for node in self.nodes:
            if node.alive:
                node.proc.terminate()
        for node in self.nodes:
            if node.proc is not None:
                try:
                    node.proc.wait(10)
                except subprocess.TimeoutExpired:
                    node.proc.kill()
                    node.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> ClusterProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
