#!/usr/bin/env bash
# Builds the worker's images here with buildah (no Docker daemon, no registry): sets up the Python
# environment (as scripts/test.sh does), then runs scripts/image.py, which installs buildah and
# debootstrap from Debian when missing and reads docker-bake.hcl as `docker buildx bake` does.
#   scripts/image.sh build [TARGET] [--set NAME=VALUE ...] [--tag TAG]   (default target: worker-cpu)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$REPO/scripts/setup.sh" >&2
exec "$REPO/.venv/bin/python" "$REPO/scripts/image.py" "$@"
