#!/usr/bin/env bash
# Sets up the CPU environment (idempotent), then runs the whole test suite on the real engine.
#   scripts/test.sh [pytest args]
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$REPO/scripts/setup.sh"
cd "$REPO"
exec .venv/bin/python -m pytest "$@"
