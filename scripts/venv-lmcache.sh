#!/usr/bin/env bash
# Build .venv-lmcache: LMCache 0.5.6's standalone server on a CPU-only machine, the peer
# that `kvstore-bench peers` and tests/integration/test_lmcache_peer.py run beside ours.
#
# A plain `pip install lmcache` pulls cupy, cuda-python and cufile (about 1.9 GB with
# torch). The server (`python -m lmcache.v1.server HOST PORT cpu`) needs none of them:
# the local CPU torch 2.13.0 first, lmcache with --no-deps, then only what the server's
# imports need, with torch pinned by a constraints file. This repository is not
# installed here: the bench and the tests run in .venv and only start the server with
# this venv's Python (bench/lmcache_peer.py speaks its wire format without lmcache).
#
# Idempotent; see scripts/engine-venv.sh (also for VENV and PYTHON).
#
# Usage: scripts/venv-lmcache.sh [--force | --recreate]
set -euo pipefail

ENGINE=lmcache
STEPS=3
TORCH="torch==2.13.0"
LMCACHE="lmcache==0.5.6"
# What lmcache.v1.server and the modules it imports need at import time, found by
# starting it in a venv of torch and lmcache alone and adding what each failure named.
LMCACHE_DEPS=(numpy numba sortedcontainers prometheus-client py-cpuinfo psutil aiohttp
              requests cachetools pyyaml)

source "$(dirname "${BASH_SOURCE[0]}")/engine-venv.sh"
venv_start "$@"
say "[2/3] $LMCACHE --no-deps"
"${PIP[@]}" --no-deps "$LMCACHE"
say "[3/3] the server's import-time dependencies (torch pinned)"
"${PIP[@]}" -c "$CONSTRAINTS" "${LMCACHE_DEPS[@]}"

# Fail here, not in a test, if the server cannot start or torch was replaced.
"$VENV/bin/python" - <<'PY'
import importlib
import torch
importlib.import_module("lmcache.v1.server.__main__")
from importlib.metadata import version
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert not torch.version.cuda, f"a CUDA torch was installed: {torch.version.cuda}"
print(f"venv-lmcache: torch {torch.__version__}, lmcache {version('lmcache')}")
PY

venv_done
