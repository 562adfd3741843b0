# syntax=docker/dockerfile:1
# The RunPod serverless worker on the official vLLM OpenAI image, of the vLLM release the CPU test
# suite runs (scripts/requirements-cpu.lock), so the tested code is the shipped code. Build it with
# `docker buildx bake` (docker-bake.hcl); see docs/image.md.
# BASE_IMAGE picks the flavour, and nothing else differs: the official image (GPU), or the CPU base
# of builder/cpu-base.Dockerfile (bake target worker-cpu), which the image test tier builds and runs.
ARG VLLM_VERSION=0.32.0
ARG BASE_IMAGE=vllm/vllm-openai:v${VLLM_VERSION}
FROM ${BASE_IMAGE}

# The worker's own dependencies, pinned to the tested versions, with the base image's uv (as vLLM's
# docs extend the image); uv keeps no cache. Copied rather than bind-mounted: a copied file is part
# of the layer's cache key with every builder (buildah ignores a bind mount's content).
COPY builder/requirements.txt /opt/worker/requirements.txt
RUN uv pip install --system --no-cache -r /opt/worker/requirements.txt

# Opt-in and untested: the latest vLLM nightly wheel instead of the tested release.
ARG VLLM_NIGHTLY=false
RUN if [ "$VLLM_NIGHTLY" = "true" ]; then \
        uv pip install --system --no-cache --pre --upgrade vllm \
            --extra-index-url https://wheels.vllm.ai/nightly; \
    fi

# Hugging Face caches on RunPod's network volume (mounted at BASE_PATH): models that are not baked
# in are downloaded there at start-up and shared by the endpoint's workers. The worker keeps vLLM's
# compile cache there too ($BASE_PATH/vllm-cache; see docs/cold-start.md).
ARG BASE_PATH=/runpod-volume
ENV BASE_PATH=${BASE_PATH} \
    HF_HOME=${BASE_PATH}/huggingface-cache \
    HUGGINGFACE_HUB_CACHE=${BASE_PATH}/huggingface-cache/hub \
    HF_DATASETS_CACHE=${BASE_PATH}/huggingface-cache/datasets \
    PYTHONUNBUFFERED=1 \
    RUNPOD_DEBUG_LEVEL=INFO \
    PYTHONPATH=/src

# Optional baked model and LoRA adapters (nothing is baked when MODEL_NAME and LORA_ADAPTERS are
# empty). The script is copied on its own so that code changes do not invalidate the large model
# layer. The Hugging Face token is a BuildKit secret file, read through HF_TOKEN_PATH: it never
# enters a build arg, an env var or a layer.
# HF_HOME points at a temporary folder for this step so that hub/xet caches are not kept.
ARG MODEL_NAME=""
ARG MODEL_REVISION=""
ARG QUANTIZATION=""
# DL3064 reads "TOKEN" in these names as a secret; they name a tokenizer repo and its revision.
# hadolint ignore=DL3064
ARG TOKENIZER_NAME="" TOKENIZER_REVISION=""
# LoRA adapters, comma-separated `org/repo`, `org/repo/sub/folder` or `name=source`: in /models/loras.
ARG LORA_ADAPTERS=""
# The hub to bake from: huggingface.co, or a mirror or private hub speaking its API.
ARG HF_ENDPOINT=https://huggingface.co
# Only what the bake step imports, so that a change to other code does not bake again.
COPY src/download_model.py /src/
COPY src/worker/__init__.py src/worker/env_text.py /src/worker/
COPY src/worker/model/__init__.py src/worker/model/adapter_files.py src/worker/model/baked_args.py \
     src/worker/model/download_model.py /src/worker/model/
RUN --mount=type=secret,id=HF_TOKEN \
    HF_TOKEN_PATH=/run/secrets/HF_TOKEN HF_HOME=/tmp/hf-home python3 /src/download_model.py \
    && rm -rf /tmp/hf-home
# A baked image serves its own copy with no hub access (`${MODEL_NAME:+1}` is "1" when a model was
# baked, empty otherwise); set HF_HUB_OFFLINE=0 at run time to serve another model from the hub.
# Adapters baked alone leave the hub on: the model they serve with is downloaded at start-up.
ENV HF_HUB_OFFLINE=${MODEL_NAME:+1}

WORKDIR /src
COPY src/ /src/
# The base image's entrypoint is `vllm serve`; this worker runs its own start-up instead.
ENTRYPOINT []
CMD ["python3", "/src/handler.py"]
