"""``--gpu-memory-utilization`` as vLLM means it: a fraction of the device's *total* memory.

JAX's GPU allocator takes a fixed share of the card when its backend starts (75 % unless
``XLA_PYTHON_CLIENT_MEM_FRACTION`` says otherwise), and ``memory_stats()["bytes_limit"]`` is that
share, not the card. So the engine-core process sets the allocator's fraction to the utilization
before JAX starts, and the KV budget is ``total * utilization`` minus what the weights and the
activations take, where ``total`` is recovered from the limit and the fraction in effect. The
arithmetic is pure (no jax) so a faked device size can test it.
"""
from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger(__name__)

ALLOCATOR_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
JAX_DEFAULT_FRACTION = 0.75  # what JAX's GPU allocator takes when the variable is unset


def _backends_started() -> bool:
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - a JAX without the module: assume it has started
        return True
    return bool(xla_bridge.backends_are_initialized())


def set_allocator_fraction(gpu_memory_utilization: float) -> float:
    """Make JAX's allocator take ``gpu_memory_utilization`` of the device's total memory, unless
    the user set ``XLA_PYTHON_CLIENT_MEM_FRACTION`` or JAX's backend already started (an
    in-process ``LLM`` after other JAX work). Returns the fraction the allocator uses."""
    if ALLOCATOR_FRACTION_ENV not in os.environ and not _backends_started():
        os.environ[ALLOCATOR_FRACTION_ENV] = f"{gpu_memory_utilization:.4f}"
    return allocator_fraction()


def allocator_fraction() -> float:
    """The share of the device JAX's allocator takes (the variable, else JAX's default)."""
    raw = os.environ.get(ALLOCATOR_FRACTION_ENV)
    try:
        x = float(raw) if raw is not None else JAX_DEFAULT_FRACTION
    except ValueError:
        return JAX_DEFAULT_FRACTION
    return x if 0.0 < x <= 1.0 else JAX_DEFAULT_FRACTION


def device_total_bytes(bytes_limit: int, fraction: float) -> int:
    """The device's total memory, from the allocator's limit and the share it took."""
    return int(bytes_limit / fraction)


def kv_cache_budget(total_bytes: int, gpu_memory_utilization: float, bytes_limit: int,
                    in_use_bytes: int, reserve_bytes: int) -> float:
    """Bytes left for KV pages: ``total * utilization`` (never more than the allocator holds)
    minus what is in use (weights) and the activations' reserve."""
    usable = min(total_bytes * gpu_memory_utilization, bytes_limit)
    return usable - in_use_bytes - reserve_bytes
