"""A disk tier whose writes failed is shown as failed where operators look: the `stats`
table and the `disk` health service; the server as a whole stays SERVING (degraded)."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys

import numpy as np
import xxhash

from kvstore_client import KVStoreClient, PageLayout
from kvstore_testing.serverproc import ServerProcess
from tests.waiting import wait_for, wait_value

LAYOUT = PageLayout(model="failed-tier", num_layers=32, page_tokens=16, num_kv_heads=8,
                    head_size=64)                                   # 1 MiB pages
ADMIN = shutil.which("kvstore-admin", path=os.path.dirname(sys.executable)) or "kvstore-admin"


def admin(address: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([ADMIN, "--server", address, *args], capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)


def test_failed_disk_tier_in_stats_and_health(tmp_path):
    with ServerProcess(dram="32MiB", disk="512MiB", disk_dir=str(tmp_path / "disk")) as srv, \
            KVStoreClient(srv.address) as c:
        assert admin(srv.address, "health", "--service", "disk").stdout.strip() == "SERVING"
        assert "FAILED" not in admin(srv.address, "stats").stdout
        # From now on no file of the server grows past 16 MiB: the next spills fail.
        _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.prlimit(srv.proc.pid, resource.RLIMIT_FSIZE, (16 << 20, hard))
        ns = c.register_layout(LAYOUT)
        ks = [xxhash.xxh3_128_digest(f"k{i}".encode()) for i in range(80)]
        data = np.zeros((8, LAYOUT.page_bytes), dtype=np.uint8)
        for i in range(0, 80, 8):
            c.put(ns, ks[i:i + 8], data)
        wait_for(lambda: {t.name: t for t in c.stats().tiers}["disk"].failed,
                 "the disk tier to fail", timeout=20, interval=0.05)
        stats = admin(srv.address, "stats")
        assert stats.returncode == 0, stats.stderr
        row = next(line for line in stats.stdout.splitlines() if line.startswith("disk "))
        assert row.split()[1] == "FAILED", stats.stdout
        assert "disk tier FAILED" in stats.stdout
        disk = wait_value(lambda: admin(srv.address, "health", "--service", "disk"),
                          lambda disk: disk.returncode != 0, "the disk service NOT_SERVING",
                          timeout=5, interval=0.1)
        assert disk.returncode == 1 and disk.stdout.strip() == "NOT_SERVING"
        whole = admin(srv.address, "health")
        assert whole.returncode == 0 and whole.stdout.strip() == "SERVING"


def test_admin_version():
    from importlib.metadata import version
    out = subprocess.run([ADMIN, "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"kvstore-admin {version('kvstore')}"
