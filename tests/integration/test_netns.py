"""The "store on another host" bench's network namespaces (bench/netns.py): made, usable,
and gone afterwards, also after Ctrl-C and SIGTERM; netem either delays or says why not.

Needs root and iproute2 (as in CI); skipped with the reason elsewhere.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest

from kvstore_bench import netns_bench
from kvstore_bench.netns import NetPair, NetUnavailable
from kvstore_bench.rawpeer import RawClient
from tests.waiting import wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                                reason="network namespaces need root and iproute2")


def namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def links() -> str:
    return subprocess.run(["ip", "link"], capture_output=True, text=True).stdout


def gone(net: NetPair) -> bool:
    return net.ns not in namespaces() and net.near_dev not in links()


def test_a_pair_carries_bytes_and_is_removed():
    with NetPair(tag=os.getpid() + 1) as net:
        assert net.ns in namespaces()
        peer = subprocess.Popen([*net.exec_prefix, sys.executable, "-m",
                                 "kvstore_bench.rawpeer", net.far_ip],
                                stdout=subprocess.PIPE, text=True)
        try:
            port = int(peer.stdout.readline())
            raw = RawClient(net.far_ip, port, connections=2)
            out = memoryview(bytearray(3 << 20))
            raw.get(out)                              # striped over both connections
            assert out.tobytes() == b"\1" * (3 << 20)
            raw.put(memoryview(bytes(1 << 20)))
            raw.close()
        finally:
            peer.kill()
            peer.wait(10)
        try:
            net.set_delay(0.5)
        except NetUnavailable as exc:                 # a kernel without sch_netem
            assert "netem" in str(exc)
            assert "netem" not in subprocess.run(["tc", "qdisc", "show", "dev", net.near_dev],
                                                 capture_output=True, text=True).stdout
        else:
            assert net.delay_ms == 0.5
    assert gone(net)


def test_an_exception_inside_removes_the_pair():
    with pytest.raises(KeyboardInterrupt):
        with NetPair(tag=os.getpid() + 2) as net:
            raise KeyboardInterrupt
    assert gone(net)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signalled_run_removes_the_pair(sig):
    tag = os.getpid() + 3 + int(sig)
    code = ("import time; from kvstore_bench.netns import NetPair\n"
            f"with NetPair(tag={tag}):\n    print('up', flush=True); time.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "up"
    net = NetPair(tag=tag)
    assert net.ns in namespaces()
    child.send_signal(sig)
    child.wait(30)
    wait_for(lambda: gone(net), "the namespaces removed", timeout=10, interval=0.1)


def test_the_bench_runs_across_namespaces_and_names_what_it_skipped(capsys):
    assert netns_bench.main(["--runs", "1", "--mib", "16", "--iters", "20",
                             "--delay-ms", "0.5", "--connections", "2"]) == 0
    out = capsys.readouterr().out
    assert "### no added delay" in out and "get 1 MiB pages, 2 connections" in out
    # The delayed condition either ran or says why it did not.
    assert "### +0.5 ms each way" in out or "SKIPPED: +0.5 ms each way" in out
    assert f"kvstore-bench-{os.getpid()}" not in namespaces().split()
