"""The configuration layers (vLLM defaults < worker defaults < baked < YAML < env < aliases)."""
