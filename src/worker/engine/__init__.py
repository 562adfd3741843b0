"""vLLM's engine on its own event loop, the gate before it (admission), and the raw job path (sampling, tokenizer)."""
