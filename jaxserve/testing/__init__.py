"""Tiny models and presets for tests and benchmarks."""
