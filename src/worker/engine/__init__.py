"""vLLM's engine on its own event loop, and the raw job path (sampling, tokenizer)."""
