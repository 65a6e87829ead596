"""Tiny random checkpoints for tests and benchmarks: the demo model's builder (which lives in
``jaxserve.loaders.demo_model``, since serving ``demo-random`` needs it) under its test-side name."""
from jaxserve.loaders.demo_model import (ARCH_CONFIG, ARCH_DEFAULTS, ARCHS, CHAT_TEMPLATE,  # noqa: F401
                                         DEFAULTS, ROPE_PRESETS, SPECIAL_TOKENS,
                                         hf_tensor_shapes, make_tiny_model, train_tokenizer)
