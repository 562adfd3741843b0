"""worker-vllm's import path for its two engines: ``from engine import vLLMEngine, OpenAIvLLMEngine``."""

from worker.engine.vllm_engine import vLLMEngine
from worker.routes.serving import OpenAIvLLMEngine

__all__ = ["OpenAIvLLMEngine", "vLLMEngine"]
