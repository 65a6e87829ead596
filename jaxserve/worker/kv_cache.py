"""The KV page pool: one ``(k_pages, v_pages)`` per layer, each ``[Hkv, num_pages, block_size, D]``
(each layer at its own cache spec's KV heads and head dim; a ``SharedKV`` layer gets ``()``).

Allocated once at start-up (zeros). Page 0 is the trash page that padded tokens write to. The
layout is the one of ``pallas_kernels/reference.py``: a page of one KV head is contiguous, and
under tensor parallelism the pool is sharded over its first (KV head) axis.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.sharding import default_mesh, pool_kv_heads, replicated
from jaxserve.worker.host_memory import release_pages


_FP8_KV = {"fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn,
           "fp8_e5m2": jnp.float8_e5m2}


def kv_cache_dtype(cache_dtype: str, serving_dtype):
    """The pool's dtype: the serving dtype ("auto"), bfloat16 / float32 as named, or a float8.
    Float8 pages hold K/V divided by the layer's scales (``jaxserve.models.kv_scales``; 1.0
    without any), saturated at the format's maximum; every attention backend (reference, xla,
    pallas, triton, mosaic) upcasts pages narrower than the serving dtype when it reads them."""
    if cache_dtype == "auto":
        return jnp.dtype(serving_dtype)
    if cache_dtype in ("bfloat16", "float32"):
        return jnp.dtype(cache_dtype)
    if cache_dtype not in _FP8_KV:
        raise ValueError(f"kv_cache_dtype {cache_dtype!r} is not one of auto, bfloat16, "
                         f"float32, {', '.join(_FP8_KV)}")
    return jnp.dtype(_FP8_KV[cache_dtype])


def kv_page_shape(model_config: ModelConfig, num_pages: int, block_size: int, tp: int = 1
                  ) -> tuple[int, ...]:
    """``tp`` > KV heads repeats each KV head so every device holds one (``parallel``)."""
    heads = pool_kv_heads(model_config.num_kv_heads, tp)
    return (heads, num_pages, block_size, model_config.head_dim)


def page_bytes(model_config: ModelConfig, block_size: int, dtype, tp: int = 1) -> int:
    """Bytes of one page across all layers, K and V (all devices together)."""
    per_layer = pool_kv_heads(model_config.num_kv_heads, tp) * block_size * model_config.head_dim
    return 2 * model_config.num_layers * per_layer * np.dtype(jnp.dtype(dtype)).itemsize


def allocate_kv_pages(model_config: ModelConfig, num_pages: int, block_size: int, dtype,
                      sharding=None, tp: int = 1) -> list[tuple[jax.Array, jax.Array]]:
    """Zeroed pages for every layer, created on device.

    ``sharding`` defaults to replication on the parameters' default 1-device mesh: a jitted step
    returns its pages with that same NamedSharding, so the first and every later step see the
    same input sharding and share one compiled program.
    """
    if sharding is None:
        sharding = replicated(default_mesh())
    if num_pages < 2:
        raise ValueError(f"num_pages must be >= 2 (page 0 is the trash page), got {num_pages}")
    shape = kv_page_shape(model_config, num_pages, block_size, tp)
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    return [(zeros(), zeros()) for _ in range(model_config.num_layers)]


def layer_page_shape(spec, num_pages: int, block_size: int, tp: int = 1) -> tuple[int, ...]:
    """The ``[Hkv, pages, block, D]`` of one layer of ``spec`` (KV heads repeated when ``tp``
    exceeds them)."""
    return (pool_kv_heads(spec.kv_heads, tp), num_pages, block_size, spec.head_dim)


def _zeros(dtype, sharding):
    """``shape -> zeroed array``, one compiled program per distinct shape (not one per layer:
    start-up stays one compile per page shape however many layers share it)."""
    if sharding is None:
        sharding = replicated(default_mesh())
    programs = {}

    def zeros(shape):
        if shape not in programs:
            programs[shape] = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
        out = programs[shape]()
        if out.sharding.device_set and next(iter(out.sharding.device_set)).platform == "cpu":
            # host memory: a page becomes resident when a step first writes it
            release_pages(out.block_until_ready())
        return out
    return zeros


def _check_num_pages(num_pages: int) -> None:
    if num_pages < 2:
        raise ValueError(f"num_pages must be >= 2 (page 0 is the trash page), got {num_pages}")


def _layer_pages(spec, num_pages: int, block_size: int, tp: int, zeros) -> tuple:
    """``(k, v)`` of one layer at its spec's shape; ``()`` for a ``SharedKV`` layer."""
    from jaxserve.core.kv_cache_spec import SharedKV

    if isinstance(spec, SharedKV):
        return ()
    shape = layer_page_shape(spec, num_pages, block_size, tp)
    return (zeros(shape), zeros(shape))


def allocate_layer_pages(specs, num_pages: int, block_size: int, dtype, sharding=None,
                         tp: int = 1) -> list[tuple]:
    """Zeroed pages for every layer at its own spec's shape, all indexed by the same page ids;
    ``()`` for a layer that reads another's pages (``SharedKV``)."""
    _check_num_pages(num_pages)
    zeros = _zeros(dtype, sharding)
    return [_layer_pages(spec, num_pages, block_size, tp, zeros) for spec in specs]


# -- the state pool (LinearState layers) ---------------------------------------------------------

def allocate_state_pool(spec, num_slots: int, sharding=None) -> tuple[jax.Array, ...]:
    """One LinearState layer's arrays, zeroed: ``[num_slots + 1, *shape]`` each, the last slot
    the trash slot (rows without a slot, e.g. warm-up rows, write there). Replicated."""
    if sharding is None:
        sharding = replicated(default_mesh())
    dtype = jnp.dtype(spec.dtype)
    return tuple(jax.jit(lambda s=s: jnp.zeros((num_slots + 1,) + tuple(s), dtype),
                         out_shardings=sharding)() for s in spec.shapes)


def allocate_hybrid_caches(model_config: ModelConfig, cache_groups, num_pages: int,
                           num_slots: int, block_size: int, dtype, kv_sharding=None,
                           state_sharding=None, tp: int = 1, scratch_slots: int = 0
                           ) -> list[tuple[jax.Array, ...]]:
    """Per cache layer (the model's, then e.g. an MTP head's): ``(k_pages, v_pages)`` for an
    attention layer, its state-pool arrays (:func:`allocate_state_pool`) for a LinearState
    layer, with ``scratch_slots`` more slots after the ``num_slots`` requests' ones (the
    snapshots of speculative verify rows)."""
    from jaxserve.core.kv_cache_spec import LinearState

    _check_num_pages(num_pages)
    zeros = _zeros(dtype, kv_sharding)
    caches: list = [None] * (1 + max(i for g in cache_groups for i in g.layers))
    for g in cache_groups:
        for i in g.layers:
            caches[i] = (allocate_state_pool(g.spec, num_slots + scratch_slots, state_sharding)
                         if isinstance(g.spec, LinearState)
                         else _layer_pages(g.spec, num_pages, block_size, tp, zeros))
    return caches


def _fork_copy(pool, paged: tuple[int, ...], state: tuple[int, ...], src, dst, ssrc, sdst):
    """Pages ``src`` -> ``dst`` of every paged layer and state slots ``ssrc`` -> ``sdst`` of
    every LinearState layer (pad pairs copy the trash page / slot onto itself)."""
    pool = list(pool)
    for i in paged:
        pool[i] = tuple(a.at[:, dst].set(a[:, src]) for a in pool[i])
    for i in state:
        pool[i] = tuple(a.at[sdst].set(a[ssrc]) for a in pool[i])
    return pool


# the pool is donated: the copy is made in place, never beside a second pool
fork_copy = jax.jit(_fork_copy, static_argnums=(1, 2), donate_argnums=(0,))


def fork_pairs(pairs: list[tuple[int, int]], trash: int) -> tuple[np.ndarray, np.ndarray]:
    """(sources, destinations) padded to a power of two (one compile per width) with
    ``trash`` -> ``trash`` copies."""
    width = max(8, 1 << max(0, len(pairs) - 1).bit_length())
    idx = np.full((2, width), trash, np.int32)
    if pairs:
        idx[:, :len(pairs)] = np.asarray(pairs, np.int32).T
    return idx[0], idx[1]


# -- the one allocation --------------------------------------------------------------------------

def allocate_kv_cache(config, dtype, kv_sharding=None, state_sharding=None, tp: int = 1
                      ) -> list[tuple]:
    """Every cache layer's arrays from a ``core.kv_cache_config.KVCacheConfig``: a paged
    layer's ``(k, v)`` at its spec's shape with its pool's pages, ``()`` for a layer reading
    another's pages (``SharedKV``), a LinearState layer's state arrays with the requests' slots,
    the scratch slots and the trash slot."""
    from jaxserve.core.kv_cache_spec import LinearState

    for p in config.pools:
        _check_num_pages(p.num_pages)
    zeros = _zeros(dtype, kv_sharding)
    out: list = []
    for spec, name in zip(config.specs, config.pool_of_layer):
        if isinstance(spec, LinearState):
            out.append(allocate_state_pool(spec, config.num_state_slots + config.scratch_slots,
                                           state_sharding))
        else:
            pages = 0 if name is None else config.pool(name).num_pages
            out.append(_layer_pages(spec, pages, config.block_size, tp, zeros))
    return out
