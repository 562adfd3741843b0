#!/usr/bin/env bash
# Regenerates both CPU locks, each installed with --no-deps:
#   requirements-cpu.lock          from requirements-cpu.in: the development and test environment
#                                  (scripts/setup.sh);
#   requirements-cpu-runtime.lock  from requirements-cpu-runtime.in, with the first as constraints:
#                                  the CPU image's packages (builder/cpu-base.Dockerfile), only what
#                                  the worker runs, at exactly the tested versions.
# The development lock keeps its versions (uv prefers those of the file it rewrites); pass uv's
# --upgrade or --upgrade-package NAME to move them: scripts/lock.sh --upgrade-package openai
# The CUDA-linked torchvision/torchaudio/torchcodec break `import vllm` on the CPU build and triton is
# useless there, so both locks leave them out.
set -euo pipefail
cd "$(dirname "$0")"

# compile IN LOCK HEADER [uv options...]: LOCK from IN, with HEADER as its first line.
compile() {
  local in=$1 lock=$2 header=$3
  shift 3
  if [[ -f $lock ]]; then cp "$lock" "$lock.tmp"; fi  # its versions are uv's preferences
  uv pip compile "$in" --python-version 3.11 --find-links /opt/wheels \
    --index-strategy unsafe-best-match --no-header \
    --no-emit-package torchvision --no-emit-package torchaudio \
    --no-emit-package torchcodec --no-emit-package triton --quiet -o "$lock.tmp" "$@"
  # The runtime lock's "via -c requirements-cpu.lock" on every package says nothing: left out.
  { echo "$header"; sed 's/-c requirements-cpu\.lock, //; s/, -c requirements-cpu\.lock$//' "$lock.tmp"; } > "$lock"
  rm "$lock.tmp"
}

compile requirements-cpu.in requirements-cpu.lock \
  "# CPU development lock: install with --no-deps (scripts/setup.sh). Regenerate with scripts/lock.sh." "$@"
compile requirements-cpu-runtime.in requirements-cpu-runtime.lock \
  "# CPU runtime lock, the CPU image's: install with --no-deps. Regenerate with scripts/lock.sh." \
  -c requirements-cpu.lock --annotation-style line
