"""Fixtures for the tests that run vLLM 0.33's real scheduler (needs .venv-vllm).

These tests need vLLM, which the main suite runs without: every test module here starts
with ``pytest.importorskip("vllm")``, and this file must not import vLLM itself. Build the
environment with ``scripts/venv-vllm.sh`` and run ``.venv-vllm/bin/python -m pytest
tests/vllm``.

Keep this folder free of ``__init__.py``: pytest then puts tests/vllm itself on
``sys.path``, which is how ``harness`` and ``kv_connector_module_path="toy_connector"``
are found.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A config-only 2-layer OPT folder, shared by the session."""
    harness = pytest.importorskip("harness", reason="needs vLLM (scripts/venv-vllm.sh)")
    return harness.write_model_dir(tmp_path_factory.mktemp("opt-2layer"))
