"""Getting the model and its LoRA adapters: baked into the image at build time, or fetched from the hub (at start, or at an adapter's first use)."""
