#!/usr/bin/env bash
# Runs a local RunPod endpoint (http://127.0.0.1:8000/v2/local/...) with the worker on the
# SmolLM2-135M-Instruct model built by setup.sh, or on $MODEL_NAME. Arguments go to
# `python -m endpoint` (--workers N, --port P, --api-key K).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$REPO/scripts/setup.sh"
while IFS='=' read -r key value; do  # defaults from cpu-dev.env; the environment wins
  [[ -z "$key" || "$key" == \#* || -n "${!key:-}" ]] || export "$key=$value"
done <"$REPO/scripts/cpu-dev.env"
if [[ -z "${MODEL_NAME:-}" ]]; then
  export MODEL_NAME="$REPO/.cache/models/smollm2-135m-instruct"
  # The dequantised SmolLM2 answers noticeably worse in bfloat16 on the CPU.
  export DTYPE="${DTYPE:-float32}"
fi
export VLLM_RPC_BASE_PATH="${VLLM_RPC_BASE_PATH:-$(mktemp -d)}"
cd "$REPO"
exec .venv/bin/python -m endpoint "$@"
