"""systemd's readiness protocol (sd_notify): a few datagrams to $NOTIFY_SOCKET.

Under a `Type=notify` unit, systemd considers the server started only when it sends
READY=1, which it does once its port serves, after the pool is allocated and pre-faulted
(minutes for a large pool): units ordered after it wait for that, and `systemctl start`
reports a failed start-up as failed. STATUS= lines show in `systemctl status`; while the
pool is pre-faulted, EXTEND_TIMEOUT_USEC= keeps TimeoutStartSec from cutting a start-up
that is making progress. Outside systemd ($NOTIFY_SOCKET unset) every call does nothing.

The protocol is one AF_UNIX datagram of newline-separated KEY=VALUE lines to the path in
$NOTIFY_SOCKET ("@name" is an abstract socket); see sd_notify(3). Twenty lines of our own
instead of a dependency on libsystemd or a Python binding of it.
"""

from __future__ import annotations

import os
import socket

__all__ = ["Notifier"]


class Notifier:
    """Sends sd_notify messages to the socket named in `environ` (default os.environ)."""

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        address = (os.environ if environ is None else environ).get("NOTIFY_SOCKET", "")
        if address.startswith("@"):
            address = "\0" + address[1:]
        self._address = address

    @property
    def enabled(self) -> bool:
        return bool(self._address)

    def notify(self, **fields: object) -> None:
        """notify(READY=1, STATUS="serving"): one datagram; errors are ignored, as
        sd_notify does, since a lost status line must never stop the server."""
        if not self._address:
            return
        message = "\n".join(f"{key}={value}" for key, value in fields.items())
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.sendto(message.encode(), self._address)
        except OSError:
            pass
