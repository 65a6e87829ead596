"""The KV page pool: one ``(k_pages, v_pages)`` per layer, each ``[Hkv, num_pages, block_size, D]``.

Allocated once at start-up (zeros). Page 0 is the trash page that padded tokens write to. The
layout is the one of ``pallas_kernels/reference.py``: a page of one KV head is contiguous, and
under tensor parallelism the pool is sharded over its first (KV head) axis.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig


def kv_page_shape(model_config: ModelConfig, num_pages: int, block_size: int) -> tuple[int, ...]:
    return (model_config.num_kv_heads, num_pages, block_size, model_config.head_dim)


def page_bytes(model_config: ModelConfig, block_size: int, dtype) -> int:
    """Bytes of one page across all layers, K and V."""
    per_layer = model_config.num_kv_heads * block_size * model_config.head_dim
    return 2 * model_config.num_layers * per_layer * np.dtype(jnp.dtype(dtype)).itemsize


def allocate_kv_pages(model_config: ModelConfig, num_pages: int, block_size: int, dtype,
                      sharding=None) -> list[tuple[jax.Array, jax.Array]]:
    """Zeroed pages for every layer, created on device.

    ``sharding`` defaults to replication on the parameters' default 1-device mesh: a jitted step
    returns its pages with that same NamedSharding, so the first and every later step see the
    same input sharding and share one compiled program.
    """
    if sharding is None:
        from jax.sharding import NamedSharding, PartitionSpec

        from jaxserve.loader import default_mesh

        sharding = NamedSharding(default_mesh(), PartitionSpec())
    if num_pages < 2:
        raise ValueError(f"num_pages must be >= 2 (page 0 is the trash page), got {num_pages}")
    shape = kv_page_shape(model_config, num_pages, block_size)
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    return [(zeros(), zeros()) for _ in range(model_config.num_layers)]
