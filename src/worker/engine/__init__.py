"""vLLM's engine on its own event loop, the gate before it (admission), the LoRA adapters it serves by name, and the raw job path (sampling, tokenizer)."""
