"""A second network namespace joined to this one by a veth pair: a store "on another host"
on one machine, with added latency where the kernel has netem.

    with NetPair(tag) as net:                  # NetUnavailable says why it cannot be made
        ServerProcess(..., prefix=net.exec_prefix, host=net.far_ip)
        net.set_delay(0.5)                     # ms each way; NetUnavailable without netem

Why a namespace and not loopback: loopback has no link, a 64 KiB MTU and no qdisc, so
neither its latency nor its segment sizes are a network's. A veth pair has a 1500-byte
MTU, goes through the kernel's full TCP path on both ends, and takes `tc netem` to add
a delay; the traffic still never leaves the machine, so it measures the software, not a
NIC. Made with iproute2 (`ip netns`, `ip link ... type veth`, `tc`), which needs root.

Everything made is removed on exit, also on Ctrl-C and SIGTERM (the signal becomes
KeyboardInterrupt while the pair exists), and the names carry the pid so that two runs
never meet. Deleting the namespace deletes its veth end, and with it the pair.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess

__all__ = ["NetPair", "NetUnavailable"]


class NetUnavailable(RuntimeError):
    """The machine does not allow this (no root, no iproute2, no netns, no netem)."""


def _ip(*args: str) -> None:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=30, check=False)
    except OSError as exc:
        raise NetUnavailable(f"{' '.join(args)}: {exc}") from None
    if done.returncode:
        raise NetUnavailable(f"`{' '.join(args)}` failed: "
                             f"{(done.stderr or done.stdout).strip() or done.returncode}")


class NetPair:
    """This namespace (the client's, address near_ip) and a new one (the server's,
    far_ip), joined by a veth pair."""

    def __init__(self, tag: int | None = None) -> None:
        tag = os.getpid() if tag is None else tag
        octet = tag % 250 + 1                     # one /30 per run: 10.251.<octet>.0/30
        self.ns = f"kvstore-bench-{tag}"
        self.near_dev = f"kvb{tag % 100000}a"     # interface names: at most 15 bytes
        self.far_dev = f"kvb{tag % 100000}b"
        self.near_ip = f"10.251.{octet}.1"
        self.far_ip = f"10.251.{octet}.2"
        self.delay_ms = 0.0
        self._made = False
        self._old_term = None

    @property
    def exec_prefix(self) -> list[str]:
        """Run a command inside the server's namespace: prefix + command."""
        return ["ip", "netns", "exec", self.ns]

    def __enter__(self) -> NetPair:
        if os.geteuid() != 0:
            raise NetUnavailable("network namespaces need root (run as root, or in CI)")
        if shutil.which("ip") is None:
            raise NetUnavailable("the `ip` command (iproute2) is not installed: "
                                 "apt-get install iproute2")
        self._old_term = signal.signal(signal.SIGTERM, _interrupt)
        try:
            _ip("ip", "netns", "add", self.ns)
            self._made = True
            _ip("ip", "link", "add", self.near_dev, "type", "veth", "peer", "name",
                self.far_dev)
            _ip("ip", "link", "set", self.far_dev, "netns", self.ns)
            _ip("ip", "addr", "add", f"{self.near_ip}/30", "dev", self.near_dev)
            _ip("ip", "link", "set", self.near_dev, "up")
            _ip("ip", "-n", self.ns, "addr", "add", f"{self.far_ip}/30", "dev", self.far_dev)
            _ip("ip", "-n", self.ns, "link", "set", self.far_dev, "up")
            _ip("ip", "-n", self.ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def set_delay(self, ms: float) -> None:
        """Add ms of delay to each direction (netem on both veth ends: the round trip
        grows by 2 x ms); 0 removes it. NetUnavailable when the kernel has no netem."""
        ends = (((), self.near_dev), (("-n", self.ns), self.far_dev))
        try:
            for ns_args, dev in ends:
                if self.delay_ms:
                    _ip("tc", *ns_args, "qdisc", "del", "dev", dev, "root")
                if ms:
                    _ip("tc", *ns_args, "qdisc", "add", "dev", dev, "root", "netem",
                        "delay", f"{ms}ms")
        except NetUnavailable as exc:
            for ns_args, dev in ends:           # never half a delay
                subprocess.run(["tc", *ns_args, "qdisc", "del", "dev", dev, "root"],
                               capture_output=True, timeout=30, check=False)
            self.delay_ms = 0.0
            if "qdisc kind is unknown" in str(exc):
                raise NetUnavailable(f"{exc} (this kernel has no netem qdisc: sch_netem is "
                                     "not built or not loaded; `modprobe sch_netem` where "
                                     "the kernel ships it)") from None
            raise
        self.delay_ms = ms

    def close(self) -> None:
        if self._made:
            self._made = False
            for args in (("ip", "netns", "del", self.ns), ("ip", "link", "del", self.near_dev)):
                with contextlib.suppress(OSError, subprocess.SubprocessError):
                    subprocess.run(args, capture_output=True, timeout=30, check=False)
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None

    def __exit__(self, *exc) -> None:
        self.close()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
