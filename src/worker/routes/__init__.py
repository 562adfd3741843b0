"""The OpenAI and Anthropic routes, served in-process by vLLM's app; raw jobs in worker-vllm 2.24's format."""
