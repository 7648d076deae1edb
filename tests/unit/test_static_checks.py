"""The checks that keep the code as it is meant to read: ruff with the rules the code's noqa
comments assume, and mypy over the three packages (pyproject.toml configures both). Each
runs as a subprocess and fails with what it printed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tool(name: str) -> list[str]:
    """The tool of this interpreter's environment (the test extras install both)."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    if os.path.exists(here):
        return [here]
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[test]')")
    return [found]


def _run(argv: list[str]) -> None:
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(argv)}\n{proc.stdout}{proc.stderr}"


def test_ruff_passes():
    _run(_tool("ruff") + ["check", "--no-cache", "."])


@pytest.mark.slow
def test_mypy_passes_on_the_server_the_client_and_the_connector():
    _run(_tool("mypy") + ["--cache-dir", os.devnull])     # files: pyproject.toml
