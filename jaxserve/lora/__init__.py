"""Multi-LoRA serving: adapter requests, the host cache and the device slots.

``request`` and ``cache`` are host side (no jax); ``slots`` holds the stacked device weights.
"""
from jaxserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]
