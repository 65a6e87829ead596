"""The KV cache of a runner: its :class:`~jaxserve.core.kv_cache_config.KVCacheConfig` from one
device budget after the weights (or, on CPU, the host budget of ``worker.host_memory``), and
the one allocation from it. The arithmetic is ``core.kv_cache_config.size_kv_cache``; this
module only measures what it divides."""
from __future__ import annotations

import jax
import numpy as np

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.core.kv_cache_config import Budget, KVCacheConfig, size_kv_cache
from jaxserve.core.kv_cache_spec import attention_spec, group_layers
from jaxserve.worker import memory_budget
from jaxserve.worker.host_memory import cpu_kv_cache_bytes


def model_cache_specs(model, model_config: ModelConfig, kv_dtype) -> list:
    """Each layer's cache spec: the family declares them (``model=None``: attention layers
    over ``model_config``'s KV heads, full or sliding as its config says)."""
    name = np.dtype(kv_dtype).name
    if model is not None:
        return model.cache_specs(name)
    return [attention_spec(model_config.num_kv_heads, model_config.head_dim, name,
                           model_config.layer_sliding_window(i))
            for i in range(model_config.num_layers)]


def activation_reserve(model_config: ModelConfig, engine_config: EngineConfig) -> int:
    """Device bytes kept beside the KV cache for one step's activations and logits."""
    sched = engine_config.scheduler
    t_max = sched.max_num_batched_tokens
    act = 4 * t_max * (4 * model_config.hidden_size + 3 * model_config.intermediate_size)
    act += 4 * 3 * min(t_max, sched.max_num_seqs) * model_config.vocab_size
    return 2 * act + (256 << 20)


def kv_budget(model_config: ModelConfig, engine_config: EngineConfig, param_bytes: int
              ) -> tuple[Budget, str]:
    """One device's bytes for pages and state slots, and how they were found (for errors)."""
    cache = engine_config.cache
    if cache.num_gpu_blocks_override is not None:
        return Budget(0, num_pages_override=int(cache.num_gpu_blocks_override)), ""
    stats = jax.local_devices()[0].memory_stats() or {}
    if not stats.get("bytes_limit"):  # CPU
        return Budget(cpu_kv_cache_bytes(), host=True), ""
    free, total, in_use = memory_budget.kv_cache_budget_from_stats(
        stats, cache.gpu_memory_utilization, activation_reserve(model_config, engine_config),
        param_bytes)
    return Budget(int(free)), (
        f"{total / 2**30:.1f} GiB device, gpu_memory_utilization "
        f"{cache.gpu_memory_utilization}, {in_use / 2**30:.1f} GiB in use; raise "
        f"gpu_memory_utilization or lower max_num_batched_tokens / max_model_len")


def use_group_pools(model, groups, engine_config: EngineConfig, extra_page_bytes: int
                    ) -> bool:
    """A page pool per cache group when the model reads per-group block tables and its paged
    groups differ (swap preemption copies each pool's pages); one pool (every layer's array
    indexed by the same page ids) under ``--disable-hybrid-kv-cache-manager`` or beside a
    draft model's pool (which shares the target's page ids)."""
    return (model is not None and model.cache_groups_supported
            and sum(g.paged for g in groups) > 1
            and not engine_config.scheduler.disable_hybrid_kv_cache_manager
            and not extra_page_bytes)


def kv_cache_config(model, model_config: ModelConfig, engine_config: EngineConfig,
                    max_model_len: int, kv_dtype, param_bytes: int, tp: int = 1,
                    extra_page_bytes: int = 0, specs=None, stages=()) -> KVCacheConfig:
    """The runner's KV cache: pools, pages and state slots from the model's cache specs (or
    ``specs``) and one budget. ``param_bytes``: one device's weights; ``stages``: pipeline
    stages' layer ranges (each on devices of its own: pages and slots every one holds)."""
    specs = model_cache_specs(model, model_config, kv_dtype) if specs is None else specs
    sched = engine_config.scheduler
    spec = engine_config.speculative
    k = spec.num_speculative_tokens if spec is not None else 0
    budget, why = kv_budget(model_config, engine_config, param_bytes)
    mtp = model is not None and model.mtp is not None
    try:
        return size_kv_cache(
            specs, budget, block_size=engine_config.cache.block_size,
            max_model_len=max_model_len, max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            per_group_pools=use_group_pools(model, group_layers(specs), engine_config,
                                            extra_page_bytes),
            tp=tp, extra_page_bytes=extra_page_bytes, scratch_slots=sched.max_num_seqs * k,
            mtp_layer=len(specs) - 1 if mtp else None, stages=stages)
    except ValueError as e:
        raise ValueError(f"{e}: {why}" if why else str(e)) from None


def agree_across_hosts(config: KVCacheConfig) -> KVCacheConfig:
    """The same pages and slots on every host of a multi-host engine (the fewest)."""
    import dataclasses

    from jaxserve import sharding

    pools = tuple(dataclasses.replace(p, num_pages=sharding.agree_across_hosts(p.num_pages))
                  for p in config.pools)
    slots = (None if config.num_state_slots is None
             else sharding.agree_across_hosts(config.num_state_slots))
    return dataclasses.replace(config, pools=pools, num_state_slots=slots)


def num_pages_for(model_config: ModelConfig, engine_config: EngineConfig, dtype, max_model_len,
                  param_bytes: int, tp: int = 1, extra_page_bytes: int = 0) -> int:
    """Pages of the one pool of a model whose layers are all attention over ``model_config``'s
    KV heads (a draft model's, or a capacity estimate)."""
    return kv_cache_config(None, model_config, engine_config, max_model_len, dtype,
                           param_bytes, tp, extra_page_bytes).pools[0].num_pages
