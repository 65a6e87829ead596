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


# who decided the allocator's fraction, as the last set_allocator_fraction found it: "engine"
# (set to the utilization), "env" (the user's variable), "started" (JAX's backend had started,
# e.g. a trainer in the same process), None (never asked: the builder called directly)
_fraction_source: str | None = None


def set_allocator_fraction(gpu_memory_utilization: float) -> float:
    """Make JAX's allocator take ``gpu_memory_utilization`` of the device's total memory, unless
    the user set ``XLA_PYTHON_CLIENT_MEM_FRACTION`` or JAX's backend already started (an
    in-process ``LLM`` after other JAX work). Returns the fraction the allocator uses."""
    global _fraction_source
    if ALLOCATOR_FRACTION_ENV in os.environ:
        _fraction_source = "env"
    elif _backends_started():
        _fraction_source = "started"
    else:
        os.environ[ALLOCATOR_FRACTION_ENV] = f"{gpu_memory_utilization:.4f}"
        _fraction_source = "engine"
    return allocator_fraction()


def fraction_source() -> str | None:
    return _fraction_source


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


def kv_cache_budget_from_stats(stats: dict, gpu_memory_utilization: float, reserve_bytes: int,
                               in_use_default: int, *, fraction: float | None = None,
                               source: str | None = None) -> tuple[float, int, int]:
    """(KV budget, device total, bytes in use) from a device's ``memory_stats()``: ``F x
    total - in use - reserve``, never past the allocator's limit. When the engine could not set
    the allocator's fraction (JAX started first, e.g. beside a trainer; or the variable is the
    user's), one log line says which budget that gives, and when the limit cuts it."""
    fraction = allocator_fraction() if fraction is None else fraction
    source = _fraction_source if source is None else source
    limit = int(stats["bytes_limit"])
    in_use = int(stats.get("bytes_in_use", in_use_default))
    total = device_total_bytes(limit, fraction)
    budget = kv_cache_budget(total, gpu_memory_utilization, limit, in_use, reserve_bytes)
    if source in ("started", "env") and abs(fraction - gpu_memory_utilization) > 1e-4:
        why = ("JAX started before the engine" if source == "started"
               else f"{ALLOCATOR_FRACTION_ENV}={os.environ.get(ALLOCATOR_FRACTION_ENV)}")
        want = total * gpu_memory_utilization
        line = (f"KV budget: {why}, so the allocator holds {fraction:.2f} of the device "
                f"({limit / 2**30:.2f} of {total / 2**30:.2f} GiB); the KV pool is sized from "
                f"gpu_memory_utilization {gpu_memory_utilization:.2f} x {total / 2**30:.2f} GiB "
                f"- {in_use / 2**30:.2f} GiB in use - {reserve_bytes / 2**30:.2f} GiB reserve"
                f" = {budget / 2**30:.2f} GiB")
        if want > limit:
            line += (f", capped by the allocator's limit ({want / 2**30:.2f} GiB asked); set "
                     f"{ALLOCATOR_FRACTION_ENV}={gpu_memory_utilization:.2f} before JAX starts "
                     "to get it")
        logger.warning(line) if want > limit else logger.info(line)
    return budget, total, in_use
