"""The README's module path (kvstore_connector.vllm) and the deprecated one (connector.vllm)
give vLLM the same class; the old one warns. Run from outside the repository, as vLLM is,
where the repository's connector/ folder is not on sys.path."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("vllm")

CHECK = """
import warnings
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa
from kvstore_connector.vllm import KVStoreConnector
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import connector.vllm as old
assert old.KVStoreConnector is KVStoreConnector
assert [str(w.message) for w in caught if w.category is DeprecationWarning] == [
    "the module path connector.vllm is deprecated and goes in the next release: "
    "use kvstore_connector.vllm"], [str(w.message) for w in caught]
print("ok")
"""


def test_old_and_new_module_paths(tmp_path):
    out = subprocess.run([sys.executable, "-c", CHECK], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
