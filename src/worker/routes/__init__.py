"""The OpenAI and Anthropic routes, answered in-process by vLLM's own app."""
