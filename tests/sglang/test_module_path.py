"""The README's module path (kvstore_connector.sglang) and the deprecated one
(connector.sglang) give SGLang the same class; the old one warns. Run from outside the
repository, as SGLang is, where the repository's connector/ folder is not on sys.path."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("sglang")

CHECK = """
import warnings
from kvstore_bench.sglang_bench import install_torchvision_stub
install_torchvision_stub()
from kvstore_connector.sglang import KVStoreHiCacheStorage
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import connector.sglang as old
assert old.KVStoreHiCacheStorage is KVStoreHiCacheStorage
assert [str(w.message) for w in caught if w.category is DeprecationWarning] == [
    "the module path connector.sglang is deprecated and goes in the next release: "
    "use kvstore_connector.sglang"], [str(w.message) for w in caught]
print("ok")
"""


def test_old_and_new_module_paths(tmp_path):
    out = subprocess.run([sys.executable, "-c", CHECK], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
