#!/usr/bin/env bash
# Sets up the CPU environment (idempotent) plus the bench-only tools (bench/requirements.txt), then
# runs every benchmark and prints one table; writes bench/RESULTS.md and its chart.
#   scripts/bench.sh [--quick] [--parts stub,engine,openai] [--models M1,M2] [--out DIR]
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$REPO/scripts/setup.sh"
cd "$REPO"
.venv/bin/uv pip install --quiet --python .venv/bin/python --compile-bytecode -r bench/requirements.txt
exec .venv/bin/python -m bench "$@"
