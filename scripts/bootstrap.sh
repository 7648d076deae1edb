# Sourced by the scripts here: make .venv (once, and again when pyproject.toml changes)
# with the project and its test tools, on a machine that has nothing but python3.
# WITH_TORCH=1 also installs torch, pinned (TORCH_VERSION, default 2.13.0) and first, from
# a CPU build's index: see scripts/torch-index for TORCH_INDEX_URL, which overrides it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
stamp="$VENV/.ready-$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/bootstrap.sh" | sha256sum | cut -c1-12)${WITH_TORCH:+-torch}"
if [ ! -f "$stamp" ]; then
  echo "bootstrap: preparing $VENV" >&2
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip >&2
  if [ -n "${WITH_TORCH:-}" ]; then
    # shellcheck disable=SC2046 # the options are words on purpose
    "$VENV/bin/python" -m pip install -q $("$ROOT/scripts/torch-index" "$VENV/bin/python") \
      "torch==${TORCH_VERSION:-2.13.0}" >&2
  fi
  "$VENV/bin/python" -m pip install -q -e "$ROOT[test]" >&2
  rm -f "$VENV"/.ready-*
  touch "$stamp"
fi
export PATH="$VENV/bin:$PATH"
