"""The TCP congestion control a fast-path connection sends under, as asked by either end:
the server's data port (--data-congestion: set on the listener, which every accepted
connection takes, so a Get's answer is sent under it) and a client's connections
(KVStoreClient(data_congestion=...): a Put's pages).

Why either end may want to choose it: some hosts default to bbr, which paces what a
connection sends at the rate it has measured, in state of each connection's own. A
store's answers and a remote engine's saves are bursts after idle gaps, and pacing
spreads them out. Across a veth pair (1500-byte MTU, the full TCP path at both ends) on
the dev VM, our server's 1 MiB answer, one a call, took 281-288 µs under reno against
642-658 under bbr, and a raw client's 1 MiB put 219 µs against 556 (docs/fastpath.md).
Neither is right everywhere: bbr is the better choice across a lossy or long path, which
is why the default is the host's own.
"""

from __future__ import annotations

import errno
import socket

__all__ = ["CongestionRefused", "check_congestion", "congestion_of", "set_congestion"]

_NAME_MAX = 16          # TCP_CA_NAME_MAX: the name and its NUL


class CongestionRefused(ValueError):
    """The kernel would not give the socket that congestion control; says why."""


def _sysctl(name: str) -> str:
    try:
        with open(f"/proc/sys/net/ipv4/{name}") as f:
            return f.read().strip()
    except OSError:
        return "?"


def set_congestion(sock: socket.socket, name: str) -> None:
    """Give sock (a TCP listener, whose accepted connections take it, or a connection)
    the congestion control `name`; CongestionRefused, saying which names the kernel
    offers or allows, when it cannot."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            why = (f"this kernel has no TCP congestion control {name!r} (it has: "
                   f"{_sysctl('tcp_available_congestion_control')}; one built as a module "
                   f"loads with `modprobe tcp_{name}`)")
        elif exc.errno == errno.EPERM:
            why = (f"TCP congestion control {name!r} is not allowed for this user (allowed: "
                   f"{_sysctl('tcp_allowed_congestion_control')}; root can add it to "
                   "net.ipv4.tcp_allowed_congestion_control)")
        else:
            why = f"TCP congestion control {name!r}: {exc.strerror or exc}"
        raise CongestionRefused(why) from None


def check_congestion(name: str) -> None:
    """CongestionRefused unless this host gives `name` to this user's sockets: tried on a
    socket of its own, so that a name set in a config or an argument is an error where it
    is read, not a connection that fails or falls back later."""
    with socket.socket() as probe:
        set_congestion(probe, name)


def congestion_of(sock: socket.socket) -> str:
    """The congestion control sock has (its own, or the host's default)."""
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, _NAME_MAX)
    except OSError:
        return "?"
    return raw.split(b"\0", 1)[0].decode(errors="replace")
