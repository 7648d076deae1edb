"""The connector installs as `kvstore_connector`; the old `connector.vllm` and
`connector.sglang` module paths still resolve, with a DeprecationWarning that names the
new path. Run from a folder other than the repository's root, as an engine is: there the
repository's own `connector/` folder is not on sys.path."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def run(tmp_path, code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)


def test_installed_as_kvstore_connector(tmp_path):
    out = run(tmp_path, "import kvstore_connector.config as c; print(c.__file__)")
    assert out.returncode == 0, out.stderr
    assert pathlib.Path(out.stdout.strip()) == REPO / "connector" / "config.py"


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_old_module_path_warns(tmp_path, engine):
    # The engines themselves are not in this venv: the warning comes before their import,
    # so turning it into an error shows it without them (tests/vllm and tests/sglang
    # import the old path with the engine installed).
    out = run(tmp_path, f"import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
                        f"import connector.{engine}")
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("DeprecationWarning: the module path connector."
                           f"{engine} is deprecated") and f"kvstore_connector.{engine}" in last


def test_old_package_has_no_internals(tmp_path):
    """Only the two engine entry points are kept: the internals were never an API."""
    out = run(tmp_path, "import connector.config")
    assert out.returncode == 1 and "ModuleNotFoundError" in out.stderr
