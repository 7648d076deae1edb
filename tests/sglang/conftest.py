"""Fixtures for the tests that drive our HiCache backend with SGLang 0.5.23's own code.

These tests need SGLang, which the main suite runs without: every test module here starts
with ``pytest.importorskip("sglang")`` (after this file installs the torchvision stand-in
SGLang needs beside a CPU torch), and this file must not import SGLang itself. Build the
environment with ``scripts/venv-sglang.sh`` and run ``scripts/test-sglang``.

Keep this folder free of ``__init__.py``, like tests/vllm.
"""

from __future__ import annotations

import importlib.util

import pytest

from kvstore_testing.serverproc import ServerProcess

if importlib.util.find_spec("sglang") is not None:
    from kvstore_bench.sglang_bench import install_torchvision_stub

    install_torchvision_stub()


@pytest.fixture(scope="module")
def store():
    """A kvstore-server with 256 MiB of DRAM, shared by the tests of one module."""
    with ServerProcess(dram="256MiB") as srv:
        yield srv
