"""iperf3 over loopback: what one TCP stream carries on this machine for a program in C.

The fast-path benchmark's raw socket is Python (sendall, recv_into); iperf3 is the
usual ceiling for one TCP stream, written in C, sending 1 MiB writes from one buffer
and reading into another. Where it is installed, `kvstore-bench fastpath` prints its
figure beside the others of the same run, so a ratio against gRPC can be read against
what the machine's loopback itself moves. It is not a dependency: absent, the column
stays empty.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time

__all__ = ["iperf3_gbps"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def iperf3_gbps(seconds: int = 2) -> float | None:
    """GB/s received over one loopback TCP stream by iperf3 (1 MiB writes), or None
    where iperf3 is not installed or did not answer."""
    exe = shutil.which("iperf3")
    if exe is None:
        return None
    port = _free_port()
    server = subprocess.Popen([exe, "-s", "-1", "-B", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        out = None
        for _ in range(50):                 # the server needs a moment to listen
            done = subprocess.run(
                [exe, "-c", "127.0.0.1", "-p", str(port), "-t", str(seconds), "-l", "1M",
                 "-J"], capture_output=True, text=True, timeout=seconds + 30)
            answer = json.loads(done.stdout or "{}")
            if done.returncode == 0 and "sum_received" in answer.get("end", {}):
                out = answer
                break
            time.sleep(0.05)
        if out is None:
            return None
        return out["end"]["sum_received"]["bits_per_second"] / 8e9
    finally:
        server.kill()
        server.wait()
