#!/usr/bin/env bash
# Runs the worker on this machine behind runpod's local API server (http://127.0.0.1:8000),
# on the SmolLM2-135M-Instruct model built by setup.sh, or on $MODEL_NAME.
#   scripts/serve.sh            then: curl -s localhost:8000/runsync -d '{"input": {...}}'
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
exec "$REPO/.venv/bin/python" "$REPO/src/handler.py" --rp_serve_api \
  --rp_api_host "${HOST:-127.0.0.1}" --rp_api_port "${PORT:-8000}"
