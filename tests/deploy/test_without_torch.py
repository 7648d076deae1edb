"""The suite without torch, as `pip install -e .[test]` leaves it (torch is not a dependency:
README says why). Every file collects; one that needs torch skips with a reason at
collection, never an ImportError; and the connector's scheduler half, which needs no torch,
is tested, not skipped. A bare `import torch` in a test file, or in a module the scheduler
half imports, fails here."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FOLDERS = ["tests/unit", "tests/integration", "tests/fuzz", "tests/deploy"]
# Test files of the scheduler half (and what it is built from): no torch in their imports.
TORCH_FREE = ["tests/integration/test_prefetch.py", "tests/integration/test_auth.py",
              "tests/unit/test_groups.py", "tests/unit/test_scheduler_prefetch.py"]

# `import torch` raises ImportError in the child, as where torch is not installed.
BLOCK_TORCH = ("import sys; sys.modules['torch'] = None; import pytest; "
               "raise SystemExit(pytest.main(sys.argv[1:]))")

pytestmark = pytest.mark.slow


def _collect() -> str:
    proc = subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH, "--collect-only", "-q", "-rs",
         "-p", "no:cacheprovider", *FOLDERS],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    return proc.stdout


def test_every_file_collects_and_torch_skips_say_why():
    out = _collect()
    skips = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert skips, "no file skipped: is torch really blocked in the child?"
    for line in skips:
        assert "torch" in line, line
    for path in TORCH_FREE:
        assert f"{path}::" in out, f"{path} is not collected without torch"
        assert not any(path in line for line in skips), f"{path} skips without torch"
