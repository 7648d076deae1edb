#!/usr/bin/env bash
# Build .venv-sglang: SGLang 0.5.23 on a CPU-only machine, without a CUDA stack.
#
# A plain `pip install sglang` pulls a CUDA torch and gigabytes of kernels. Instead:
# the local CPU torch 2.13.0 first, sglang and the
# real triton with --no-deps, then only what the HiCache storage and host-pool modules
# import, with torch pinned by a constraints file so nothing upgrades it. Then this
# repository, editable, with its runtime deps.
#
# Idempotent; see scripts/engine-venv.sh (also for VENV and PYTHON).
#
# Usage: scripts/venv-sglang.sh [--force | --recreate]
set -euo pipefail

ENGINE=sglang
STEPS=4
TORCH="torch==2.13.0"
# The real triton: sglang's modules import it at top level and a stub fails (docs/dev/engines-on-cpu.md).
SGLANG_NO_DEPS=(sglang==0.5.23 triton==3.8.0)
# What sglang 0.5.23's hicache_storage, storage backend factory and host pools import.
# Nothing here may pull a CUDA build of torch.
SGLANG_DEPS=(
  numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq
  tqdm IPython aiohttp dill gguf "transformers==5.19.0" "apache-tvm-ffi==0.1.11"
  "sentencepiece==0.2.1" "compressed-tensors==0.18.0"
)

source "$(dirname "${BASH_SOURCE[0]}")/engine-venv.sh"
venv_start "$@"
say "[2/4] ${SGLANG_NO_DEPS[*]} --no-deps"
"${PIP[@]}" --no-deps "${SGLANG_NO_DEPS[@]}"
say "[3/4] sglang's import-time dependencies (torch pinned)"
say "      (pip then lists sglang's other declared deps as missing: expected)"
"${PIP[@]}" -c "$CONSTRAINTS" "${SGLANG_DEPS[@]}"
venv_repo

# Fail here, not in a test, if the install is incomplete or torch was replaced. The
# torchvision stand-in is the one tests/sglang and the bench use (docs/dev/engines-on-cpu.md: the
# registry's torchvision does not import beside a CPU torch).
cd "$REPO"   # so the check finds this checkout even if the editable install failed
"$VENV/bin/python" - <<'PY'
from kvstore_bench.sglang_bench import install_torchvision_stub
install_torchvision_stub()
import torch
import sglang
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage  # noqa: F401
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: F401
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: F401
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: F401
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert not torch.version.cuda, f"a CUDA torch was installed: {torch.version.cuda}"
print(f"venv-sglang: torch {torch.__version__}, sglang {sglang.__version__}")
PY

venv_done
