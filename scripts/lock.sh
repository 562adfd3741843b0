#!/usr/bin/env bash
# Regenerates requirements-cpu.lock from requirements-cpu.in.
# The CUDA-linked torchvision/torchaudio/torchcodec break `import vllm` on the CPU build and triton is
# useless there, so they are left out; the lock is installed with --no-deps (see setup.sh).
set -euo pipefail
cd "$(dirname "$0")"
uv pip compile requirements-cpu.in --python-version 3.11 --find-links /opt/wheels \
  --index-strategy unsafe-best-match --no-header \
  --no-emit-package torchvision --no-emit-package torchaudio \
  --no-emit-package torchcodec --no-emit-package triton -o requirements-cpu.lock.tmp
{ echo "# CPU development lock: install with --no-deps (scripts/setup.sh). Regenerate with scripts/lock.sh."
  cat requirements-cpu.lock.tmp; } > requirements-cpu.lock
rm requirements-cpu.lock.tmp
