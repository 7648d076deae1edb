# Steps shared by scripts/venv-vllm.sh and scripts/venv-sglang.sh; sourced, not run.
#
# The caller sets ENGINE (the venv's name: .venv-$ENGINE), STEPS (its log's step count)
# and TORCH, calls `venv_start "$@"` (arguments, the up-to-date check, the venv, torch),
# installs its engine with "${PIP[@]}" (torch pinned by "$CONSTRAINTS"), then calls
# `venv_repo` and, after its own import check, `venv_done`.
#
# Idempotent: a marker in the venv holds the hash of the calling script, this file and
# pyproject.toml (the editable install maps the packages it lists); when it matches,
# venv_start exits with nothing to do. Editing any of them (or --force) re-runs every
# step; pip skips what is already satisfied. --recreate deletes the venv first.
#   VENV   where to build it (default: <repo>/.venv-$ENGINE)
#   PYTHON interpreter to build it from (default: python3)

# This repository's runtime deps (pyproject.toml) plus the test runner.
REPO_DEPS=(grpcio grpcio-health-checking grpcio-reflection protobuf numpy xxhash
           prometheus-client tabulate pytest)

say() { echo "venv-$ENGINE: $*"; }

venv_start() {
  REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  VENV="${VENV:-$REPO/.venv-$ENGINE}"
  PYTHON="${PYTHON:-python3}"
  MARKER="$VENV/.kvstore-venv-$ENGINE"
  SCRIPT_HASH="$(cat "${BASH_SOURCE[1]}" "${BASH_SOURCE[0]}" "$REPO/pyproject.toml" |
                 sha256sum | cut -d' ' -f1)"
  case "${1:-}" in
    "") ;;
    --force) rm -f "$MARKER" ;;
    --recreate) rm -rf "$VENV" ;;
    *) echo "usage: ${BASH_SOURCE[1]} [--force | --recreate]" >&2; exit 2 ;;
  esac
  if [[ -f "$MARKER" && "$(cat "$MARKER")" == "$SCRIPT_HASH" ]]; then
    say "$VENV is complete (marker matches); nothing to do"
    exit 0
  fi
  [[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
  PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
  CONSTRAINTS="$VENV/kvstore-constraints.txt"
  echo "$TORCH" > "$CONSTRAINTS"
  say "[1/$STEPS] $TORCH (local CPU build)"
  "${PIP[@]}" "$TORCH"
}

venv_repo() {
  say "[$STEPS/$STEPS] this repository (editable) and its runtime deps"
  "${PIP[@]}" -c "$CONSTRAINTS" "${REPO_DEPS[@]}"
  if ! "${PIP[@]}" --no-deps -e "$REPO"; then
    # pyproject.toml may name packages that are not written yet; the engine's tests put
    # the repository root on sys.path themselves, so the venv is still usable.
    say "WARNING: editable install of $REPO failed; tests/$ENGINE adds the" \
        "repository root to sys.path instead" >&2
  fi
}

venv_done() {
  echo "$SCRIPT_HASH" > "$MARKER"
  say "done ($(du -sh "$VENV" | cut -f1) in $VENV)"
}
