"""scripts/torch-index: which index torch comes from (TORCH_INDEX_URL, README "Set-up")."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "torch-index"
CPU = "--index-url https://download.pytorch.org/whl/cpu"


def options(pip_config: str | None = None, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith(("PIP_", "TORCH_INDEX_URL"))}
    environ["PIP_CONFIG_FILE"] = pip_config or os.devnull     # no config files at all
    environ.update(env)
    return subprocess.run([str(SCRIPT), sys.executable], capture_output=True, text=True,
                          env=environ, check=True, timeout=60).stdout.strip()


def test_public_index_gets_the_cpu_build():
    assert options() == CPU


def test_a_configured_mirror_is_trusted(tmp_path):
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nextra-index-url = file:///srv/mirror/simple\n")
    assert options(str(conf)) == ""
    assert options(PIP_INDEX_URL="https://mirror.example/simple") == ""


def test_the_variable_overrides_both(tmp_path):
    assert options(TORCH_INDEX_URL="https://example/whl/cpu") == \
        "--index-url https://example/whl/cpu"
    assert options(TORCH_INDEX_URL="") == ""
