"""A LoRA adapter's folder as PEFT saves it, and the names adapters are served under: shared by the
worker (``model/lora_adapters``) and the image's bake step (``model/download_model``), which runs with
only the plain modules copied before it."""

from __future__ import annotations

import re

__all__ = ["ADAPTER_FILES", "CONFIG_FILE", "NAME"]

CONFIG_FILE = "adapter_config.json"
# The config and the weights PEFT saves beside it (vLLM reads the first weights it finds).
ADAPTER_FILES = (CONFIG_FILE, "adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")
# A name is one to three path segments (``name``, ``org/repo``, ``org/repo/sub``), never ``..``.
NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*){0,2}")
