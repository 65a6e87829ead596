"""Checkpoints (safetensors, GGUF, orbax) to params placed with their shardings."""
