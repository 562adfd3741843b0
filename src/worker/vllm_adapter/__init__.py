"""The vLLM boundary: the one package that imports vLLM (and torch), a module per concern, where a
name vLLM moved between releases is resolved in its concern's module."""
