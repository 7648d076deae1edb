#!/usr/bin/env bash
# Build .venv-vllm: vLLM 0.33.0 on a CPU-only machine, without a CUDA stack.
#
# A plain `pip install vllm` pulls torch 2.14 with 6-9 GB of CUDA libraries. Instead
# (shared/ENGINES.md, "vLLM 0.33.0"): the local CPU torch 2.13.0 first, vLLM with
# --no-deps, then only what vLLM's imports need, with torch pinned by a constraints
# file so nothing upgrades it. Then this repository, editable, with its runtime deps.
#
# Idempotent: a marker in the venv holds the hash of this script and of pyproject.toml
# (the editable install maps the packages it lists); when it matches, the script does
# nothing. Editing either (or --force) re-runs every step; pip skips what is already
# satisfied. --recreate deletes the venv first.
#
# Usage: scripts/venv-vllm.sh [--force | --recreate]
#   VENV   where to build it (default: <repo>/.venv-vllm)
#   PYTHON interpreter to build it from (default: python3)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$REPO/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
MARKER="$VENV/.kvstore-venv-vllm"
SCRIPT_HASH="$(cat "${BASH_SOURCE[0]}" "$REPO/pyproject.toml" | sha256sum | cut -d' ' -f1)"

case "${1:-}" in
  "") ;;
  --force) rm -f "$MARKER" ;;
  --recreate) rm -rf "$VENV" ;;
  *) echo "usage: $0 [--force | --recreate]" >&2; exit 2 ;;
esac

if [[ -f "$MARKER" && "$(cat "$MARKER")" == "$SCRIPT_HASH" ]]; then
  echo "venv-vllm: $VENV is complete (marker matches); nothing to do"
  exit 0
fi

TORCH="torch==2.13.0"
VLLM="vllm==0.33.0"
# What vLLM 0.33's imports need for the scheduler, the connector factory and the
# forward context (ENGINES.md). Nothing here may pull a CUDA build of torch.
VLLM_DEPS=(
  packaging msgspec numpy pydantic regex cbor2 psutil pyzmq urllib3
  "transformers>=5.16.1,<5.21" aiohttp requests openai_harmony "openai>=2.25"
  cloudpickle "pillow>=13" pybase64 cachetools uvloop py-cpuinfo prometheus_client
  "fastapi>=0.133,<0.137" partial_json_parser "llguidance>=1.7,<1.8" einops
)
# xgrammar's declared deps pull a 1 GB triton that its import does not need.
NO_DEPS_EXTRAS=(xgrammar==0.2.8 apache-tvm-ffi==0.1.11)
# This repository's runtime deps (pyproject.toml) plus the test runner.
REPO_DEPS=(grpcio grpcio-health-checking grpcio-reflection protobuf numpy xxhash
           prometheus-client tabulate pytest)

[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

CONSTRAINTS="$VENV/kvstore-constraints.txt"
echo "$TORCH" > "$CONSTRAINTS"

echo "venv-vllm: [1/5] $TORCH (local CPU build)"
"${PIP[@]}" "$TORCH"
echo "venv-vllm: [2/5] $VLLM --no-deps"
"${PIP[@]}" --no-deps "$VLLM"
echo "venv-vllm: [3/5] vLLM's import-time dependencies (torch pinned)"
echo "venv-vllm:       (pip's resolver then lists vLLM's other declared deps as missing: expected)"
"${PIP[@]}" -c "$CONSTRAINTS" "${VLLM_DEPS[@]}"
echo "venv-vllm: [4/5] ${NO_DEPS_EXTRAS[*]} --no-deps"
"${PIP[@]}" --no-deps "${NO_DEPS_EXTRAS[@]}"
echo "venv-vllm: [5/5] this repository (editable) and its runtime deps"
"${PIP[@]}" -c "$CONSTRAINTS" "${REPO_DEPS[@]}"
if ! "${PIP[@]}" --no-deps -e "$REPO"; then
  # pyproject.toml may name packages that are not written yet; tests/vllm puts the
  # repository root on sys.path itself, so the venv is still usable.
  echo "venv-vllm: WARNING: editable install of $REPO failed; tests/vllm adds the" \
       "repository root to sys.path instead" >&2
fi

# Fail here, not in a test, if the install is incomplete or torch was replaced.
"$VENV/bin/python" - <<'EOF'
import torch, vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: F401
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert not torch.version.cuda, f"a CUDA torch was installed: {torch.version.cuda}"
print(f"venv-vllm: torch {torch.__version__}, vllm {vllm.__version__}")
EOF

echo "$SCRIPT_HASH" > "$MARKER"
echo "venv-vllm: done ($(du -sh "$VENV" | cut -f1) in $VENV)"
