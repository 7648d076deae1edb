"""The eviction tests, unit and integration (real servers), pass with a second eviction
policy (tests/fifo_policy.py) named by KVSTORE_EVICTION_POLICY, which reaches DRAM and the
disk tier of every store and server they make (tests/unit/test_eviction_policy.py checks
the policy itself). One pytest run of those files, in a subprocess: minutes, so here and
not in tests/unit."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIFO = "tests.fifo_policy"

# The eviction tests: DRAM's (allocation, watermarks, leases, admin, quotas), the disk
# tier's, and the servers' under pressure and admin eviction. Those that assert LRU's own
# order are marked lru_order and skip themselves under another policy.
EVICTION_TESTS = [
    "tests/unit/test_store.py", "tests/unit/test_store_tiers.py", "tests/unit/test_disk.py",
    "tests/unit/test_disk_recovery.py", "tests/unit/test_auth.py",
    "tests/integration/test_roundtrip.py::test_lease_protects_pages_from_eviction",
    "tests/integration/test_roundtrip.py::test_eviction_under_pressure_keeps_prefixes_whole",
    "tests/integration/test_admin_cli.py", "tests/integration/test_disk_tier.py",
    "tests/integration/test_quota_disk.py",
]


@pytest.mark.slow
def test_the_eviction_tests_pass_under_fifo():
    env = {**os.environ, "KVSTORE_EVICTION_POLICY": FIFO,
           "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *EVICTION_TESTS], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    tail = proc.stdout[-3000:]
    assert proc.returncode == 0, tail
    assert " passed" in tail and "skipped" in tail      # the lru_order tests stood aside
