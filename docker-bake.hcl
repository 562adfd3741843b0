# docker buildx bake                                  the worker image, no model baked in
# MODEL_NAME=org/name docker buildx bake worker-baked  the worker with org/name baked in
# docker buildx bake worker-next                      the worker on NEXT_VLLM_VERSION (contract-checked)
# docker buildx bake worker-cpu                       the worker on a CPU base (vLLM's CPU build)
# MODEL_NAME=org/name docker buildx bake worker-cpu-baked  the same with org/name baked in
# LORA_ADAPTERS=org/adapter,name=org/repo/sub with a -baked target bakes those LoRA adapters too.
# Every variable can be set the same way (from the environment) or with --set. The Hugging Face
# token for gated or private models is read from the HF_TOKEN environment variable as a BuildKit
# secret: it never becomes a build arg or part of a layer.

variable "DOCKERHUB_REPO" {
  default = "runpod"
}

variable "DOCKERHUB_IMG" {
  default = "worker-v1-vllm"
}

variable "RELEASE_VERSION" {
  default = "v0.1.0"
}

# The vLLM release of the base image: the one the CPU test suite runs.
variable "VLLM_VERSION" {
  default = "0.32.0"
}

# The newest vLLM release: no CPU build of it exists, so the test suite cannot run it; only
# scripts/contract.sh checks the worker against it (its default version, read from here: the one
# place that names it). Built by `worker-next`.
variable "NEXT_VLLM_VERSION" {
  default = "0.34.0"
}

variable "VLLM_NIGHTLY" {
  default = "false"
}

variable "BASE_PATH" {
  default = "/runpod-volume"
}

variable "MODEL_NAME" {
  default = ""
}

variable "MODEL_REVISION" {
  default = ""
}

variable "TOKENIZER_NAME" {
  default = ""
}

variable "TOKENIZER_REVISION" {
  default = ""
}

variable "QUANTIZATION" {
  default = ""
}

variable "LORA_ADAPTERS" {
  default = ""
}

variable "HF_ENDPOINT" {
  default = "https://huggingface.co"
}

group "default" {
  targets = ["worker"]
}

target "worker" {
  context    = "."
  dockerfile = "Dockerfile"
  platforms  = ["linux/amd64"]
  tags       = ["${DOCKERHUB_REPO}/${DOCKERHUB_IMG}:${RELEASE_VERSION}"]
  args = {
    VLLM_VERSION = VLLM_VERSION
    VLLM_NIGHTLY = VLLM_NIGHTLY
    BASE_PATH    = BASE_PATH
  }
}

# The worker with a model (and LoRA adapters) baked in; tagged with the model's name.
target "worker-baked" {
  inherits = ["worker"]
  tags     = ["${DOCKERHUB_REPO}/${DOCKERHUB_IMG}:${RELEASE_VERSION}-${regex_replace(lower(MODEL_NAME), "[^a-z0-9_.-]+", "-")}"]
  secret   = ["id=HF_TOKEN,env=HF_TOKEN"]
  args = {
    MODEL_NAME         = MODEL_NAME
    MODEL_REVISION     = MODEL_REVISION
    TOKENIZER_NAME     = TOKENIZER_NAME
    TOKENIZER_REVISION = TOKENIZER_REVISION
    QUANTIZATION       = QUANTIZATION
    LORA_ADAPTERS      = LORA_ADAPTERS
    HF_ENDPOINT        = HF_ENDPOINT
  }
}

# The worker on the newest vLLM release (contract-checked, not fully tested); tagged with it.
target "worker-next" {
  inherits = ["worker"]
  tags     = ["${DOCKERHUB_REPO}/${DOCKERHUB_IMG}:${RELEASE_VERSION}-vllm${NEXT_VLLM_VERSION}"]
  args = {
    VLLM_VERSION = NEXT_VLLM_VERSION
  }
}

# The CPU flavour's base (builder/cpu-base.Dockerfile): Debian 12, its python3 and the CPU runtime
# lock (vLLM's CPU build of VLLM_VERSION, at the test lock's versions), in the official image's
# layout. Built by the worker-cpu targets.
target "cpu-base" {
  context    = "."
  dockerfile = "builder/cpu-base.Dockerfile"
  platforms  = ["linux/amd64"]
  tags       = ["${DOCKERHUB_REPO}/${DOCKERHUB_IMG}:${RELEASE_VERSION}-cpu-base"]
  args = {
    DEBIAN_IMAGE = "debian:bookworm-slim"
  }
}

# The worker on the CPU base, for machines without a GPU (and the image the test suite builds and
# runs): the same Dockerfile and steps as `worker`, only BASE_IMAGE differs.
target "worker-cpu" {
  inherits = ["worker"]
  tags     = ["${DOCKERHUB_REPO}/${DOCKERHUB_IMG}:${RELEASE_VERSION}-cpu"]
  contexts = {
    "vllm-cpu-base" = "target:cpu-base"
  }
  args = {
    BASE_IMAGE = "vllm-cpu-base"
  }
}

# The CPU worker with a model baked in, as worker-baked.
target "worker-cpu-baked" {
  inherits = ["worker-baked", "worker-cpu"]
  tags     = ["${DOCKERHUB_REPO}/${DOCKERHUB_IMG}:${RELEASE_VERSION}-cpu-${regex_replace(lower(MODEL_NAME), "[^a-z0-9_.-]+", "-")}"]
}
