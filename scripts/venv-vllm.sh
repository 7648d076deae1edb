#!/usr/bin/env bash
# Build .venv-vllm: vLLM 0.33.0 on a CPU-only machine, without a CUDA stack.
#
# A plain `pip install vllm` pulls torch 2.14 with 6-9 GB of CUDA libraries. Instead:
# the local CPU torch 2.13.0 first, vLLM with
# --no-deps, then only what vLLM's imports need, with torch pinned by a constraints
# file so nothing upgrades it. Then this repository, editable, with its runtime deps.
#
# Idempotent; see scripts/engine-venv.sh (also for VENV and PYTHON).
#
# Usage: scripts/venv-vllm.sh [--force | --recreate]
set -euo pipefail

ENGINE=vllm
STEPS=5
TORCH="torch==2.13.0"
VLLM="vllm==0.33.0"
# What vLLM 0.33's imports need for the scheduler, the connector factory and the
# forward context (docs/dev/engines-on-cpu.md). Nothing here may pull a CUDA build of torch.
VLLM_DEPS=(
  packaging msgspec numpy pydantic regex cbor2 psutil pyzmq urllib3
  "transformers>=5.16.1,<5.21" aiohttp requests openai_harmony "openai>=2.25"
  cloudpickle "pillow>=13" pybase64 cachetools uvloop py-cpuinfo prometheus_client
  "fastapi>=0.133,<0.137" partial_json_parser "llguidance>=1.7,<1.8" einops
)
# xgrammar's declared deps pull a 1 GB triton that its import does not need.
NO_DEPS_EXTRAS=(xgrammar==0.2.8 apache-tvm-ffi==0.1.11)

source "$(dirname "${BASH_SOURCE[0]}")/engine-venv.sh"
venv_start "$@"
say "[2/5] $VLLM --no-deps"
"${PIP[@]}" --no-deps "$VLLM"
say "[3/5] vLLM's import-time dependencies (torch pinned)"
say "      (pip's resolver then lists vLLM's other declared deps as missing: expected)"
"${PIP[@]}" -c "$CONSTRAINTS" "${VLLM_DEPS[@]}"
say "[4/5] ${NO_DEPS_EXTRAS[*]} --no-deps"
"${PIP[@]}" --no-deps "${NO_DEPS_EXTRAS[@]}"
venv_repo

# Fail here, not in a test, if the install is incomplete or torch was replaced.
"$VENV/bin/python" - <<'EOF'
import torch, vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: F401
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert not torch.version.cuda, f"a CUDA torch was installed: {torch.version.cuda}"
print(f"venv-vllm: torch {torch.__version__}, vllm {vllm.__version__}")
EOF

venv_done
