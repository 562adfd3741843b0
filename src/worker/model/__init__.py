"""Getting the model: baked into the image at build time, or fetched from the hub at start."""
