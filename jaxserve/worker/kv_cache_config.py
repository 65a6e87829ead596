"""KV cache sizing: how many pages each pool gets (and state slots) from one device budget
after the weights, or on CPU from what ``max_num_seqs`` full-length requests can use, capped by
the host budget (``worker.host_memory``)."""
from __future__ import annotations

from functools import partial

import jax
import numpy as np

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.core.kv_cache_spec import (attention_spec, group_layers, page_pools, split_budget,
                                         split_budget_with_state, state_bytes_per_slot)
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


def pool_sizes(pools, model_config: ModelConfig, engine_config: EngineConfig, max_model_len,
               param_bytes: int, tp: int = 1, extra_page_bytes: int = 0) -> tuple[int, ...]:
    """Pages of each pool from one budget: free device memory (or the override), after the
    weights. ``extra_page_bytes``: what a page costs elsewhere too (a draft model's pool
    shares the ids)."""
    cache = engine_config.cache
    block = cache.block_size
    if cache.num_gpu_blocks_override is not None:
        return (int(cache.num_gpu_blocks_override),) * len(pools)
    stats = jax.local_devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    sched = engine_config.scheduler
    split = partial(split_budget, pools, block_size=block, max_model_len=max_model_len, tp=tp,
                    extra_page_bytes=extra_page_bytes)
    if not limit:
        # CPU: enough for every sequence at full length, capped by host_memory's budget.
        full = -(-max_model_len // block)
        want = sched.max_num_seqs * full + 1
        return tuple(int(max(2, min(want, max(n, 2 * full + 1))))
                     for n in split(cpu_kv_cache_bytes()))
    t_max = sched.max_num_batched_tokens
    act = 4 * t_max * (4 * model_config.hidden_size + 3 * model_config.intermediate_size)
    act += 4 * 3 * min(t_max, sched.max_num_seqs) * model_config.vocab_size
    reserve = 2 * act + (256 << 20)
    free, total, in_use = memory_budget.kv_cache_budget_from_stats(
        stats, cache.gpu_memory_utilization, reserve, param_bytes)
    sizes = split(free)
    if min(sizes) < 2:
        raise ValueError(
            f"no room for the KV cache: {total / 2**30:.1f} GiB device, "
            f"gpu_memory_utilization {cache.gpu_memory_utilization}, {in_use / 2**30:.1f} GiB in "
            f"use; raise gpu_memory_utilization or lower max_num_batched_tokens"
        )
    return sizes


def use_group_pools(model, groups, engine_config: EngineConfig, extra_page_bytes: int) -> bool:
    """A page pool per cache group when the model reads per-group block tables and the groups
    differ; one pool (every layer's array indexed by the same page ids) when
    ``--disable-hybrid-kv-cache-manager``, swap preemption or a draft model's pool (which
    shares the target's page ids) needs it."""
    return (model.cache_groups_supported
            and sum(g.paged for g in groups) > 1
            and not engine_config.scheduler.disable_hybrid_kv_cache_manager
            and engine_config.scheduler.preemption_mode != "swap"
            and not extra_page_bytes)


def group_pool_sizes(pools, model_config: ModelConfig, engine_config: EngineConfig,
                     max_model_len, param_bytes: int, tp: int = 1) -> tuple[int, ...]:
    """Pages of each group's pool from one budget, in proportion to what a full-length request
    holds in each; a sliding group also gets the pages one step's prefill chunks span past the
    windows (``max_num_batched_tokens / block_size + max_num_seqs``)."""
    cache, sched = engine_config.cache, engine_config.scheduler
    block = cache.block_size
    if cache.num_gpu_blocks_override is not None:
        return (int(cache.num_gpu_blocks_override),) * len(pools)
    headroom = [(-(-sched.max_num_batched_tokens // block) + sched.max_num_seqs)
                if p.window is not None else 0 for p in pools]
    per_page = [p.page_bytes(block, tp) // tp for p in pools]
    stats = jax.local_devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:  # CPU: every sequence at full length, capped by host_memory's budget
        want = [sched.max_num_seqs * p.max_pages(max_model_len, block) + h + 1
                for p, h in zip(pools, headroom)]
        fit = split_budget(pools, cpu_kv_cache_bytes(), block_size=block,
                           max_model_len=max_model_len, tp=tp)
        return tuple(int(max(2, min(w, f + h))) for w, f, h in zip(want, fit, headroom))
    t_max = sched.max_num_batched_tokens
    act = 4 * t_max * (4 * model_config.hidden_size + 3 * model_config.intermediate_size)
    act += 4 * 3 * min(t_max, sched.max_num_seqs) * model_config.vocab_size
    free, total, in_use = memory_budget.kv_cache_budget_from_stats(
        stats, cache.gpu_memory_utilization, 2 * act + (256 << 20), param_bytes)
    free -= sum(h * b for h, b in zip(headroom, per_page))
    sizes = tuple(n + h for n, h in zip(
        split_budget(pools, max(free, 0), block_size=block, max_model_len=max_model_len,
                     tp=tp), headroom))
    if min(sizes) < 2 or free <= 0:
        raise ValueError(
            f"no room for the KV cache: {total / 2**30:.1f} GiB device, "
            f"gpu_memory_utilization {cache.gpu_memory_utilization}, {in_use / 2**30:.1f} GiB in "
            f"use; raise gpu_memory_utilization or lower max_num_batched_tokens")
    return sizes


def state_pool_sizes(pools, cache_groups, model_config: ModelConfig,
                     engine_config: EngineConfig, max_model_len, param_bytes: int, tp: int = 1,
                     scratch_slots: int = 0, extra_page_bytes: int = 0
                     ) -> tuple[int, tuple[int, ...]]:
    """(state slots, pages of each pool) of a model with LinearState layers, from the same
    budget as :func:`pool_sizes`: a slot and a full-length request's pages per request, at most
    ``max_num_seqs`` slots, after ``scratch_slots`` fixed slots (speculative snapshots). With
    ``num_gpu_blocks_override`` or on CPU (no memory limit) every ``max_num_seqs`` request gets
    a slot and the pages are sized as for any model. ``extra_page_bytes`` (a draft model's
    pool on the same page ids): the budget re-split is the target's share of the pages
    :func:`pool_sizes` leaves room for beside the draft's."""
    max_num_seqs = engine_config.scheduler.max_num_seqs
    stats = jax.local_devices()[0].memory_stats() or {}
    if engine_config.cache.num_gpu_blocks_override is not None or not stats.get("bytes_limit"):
        return max_num_seqs, pool_sizes(pools, model_config, engine_config, max_model_len,
                                        param_bytes, tp, extra_page_bytes)
    # the page budget pool_sizes would give, re-split between slots and pages
    sizes = pool_sizes(pools, model_config, engine_config, max_model_len, param_bytes, tp,
                       extra_page_bytes)
    budget = sum(n * p.page_bytes(engine_config.cache.block_size, tp) // tp
                 for n, p in zip(sizes, pools))
    budget -= scratch_slots * state_bytes_per_slot(cache_groups) // tp
    slots, sizes = split_budget_with_state(
        pools, state_bytes_per_slot(cache_groups) // tp, budget,
        block_size=engine_config.cache.block_size, max_model_len=max_model_len,
        max_num_seqs=max_num_seqs, tp=tp)
    if slots < 1 or min(sizes) < 2:
        raise ValueError("no room for the state pool and the KV cache: raise "
                         "--gpu-memory-utilization or lower --max-model-len")
    return slots, sizes


def num_pages_for(model_config: ModelConfig, engine_config: EngineConfig, dtype, max_model_len,
                  param_bytes: int, tp: int = 1, extra_page_bytes: int = 0) -> int:
    """Pages of the one pool of a model whose layers are all attention over ``model_config``'s
    KV heads (see :func:`pool_sizes`)."""
    pools = page_pools(group_layers(model_cache_specs(None, model_config, dtype)))
    return pool_sizes(pools, model_config, engine_config, max_model_len, param_bytes, tp,
                      extra_page_bytes)[0]
