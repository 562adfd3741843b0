"""Benchmarks of the worker against raw vLLM: ``scripts/bench.sh [--quick]`` (see docs/benchmarks.md)."""
