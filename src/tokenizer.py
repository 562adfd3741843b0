"""worker-vllm's import path for ``TokenizerWrapper``."""

from worker.engine.tokenizer import TokenizerWrapper

__all__ = ["TokenizerWrapper"]
