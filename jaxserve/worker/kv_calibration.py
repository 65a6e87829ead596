"""The float8 KV cache's scales before serving: the checkpoint's, 1.0, or computed on text.

``--calculate-kv-scales`` runs the model once over calibration text (``jaxserve/data/
tiny_corpus.txt``) with a serving-dtype page pool of its own, and one jitted pass returns every
layer's ``amax(|k|)`` and ``amax(|v|)`` per KV head from the pages it wrote (post-RoPE K, as
attention stores it). The scales are ``amax / fp8_max``. This runs before the step buckets are
compiled and is its own graph, so the serving steps never recompile for it; the scales then
enter the steps as constants (:mod:`jaxserve.models.kv_scales`).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import CacheConfig, ModelConfig
from jaxserve.models import kv_scales
from jaxserve import sharding
from jaxserve.core.kv_cache_config import Budget, size_kv_cache
from jaxserve.core.kv_cache_spec import LinearState
from jaxserve.worker.kv_cache import allocate_kv_cache
from jaxserve.core.batch_diff import BatchDiff, NewRequestData
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.worker.input_batch import InputBatch
from jaxserve.worker.kv_cache_config import model_cache_specs
from jaxserve.worker.step_functions import attention_metadata
from jaxserve.worker.step_inputs import StepInputs
from pallas_kernels.reference import is_fp8

logger = logging.getLogger(__name__)

CALIBRATION_TEXT = Path(__file__).parents[1] / "data" / "tiny_corpus.txt"
CALIBRATION_TOKENS = 1024  # at most this many tokens (and at most max_model_len)


def kv_amax(model, model_config: ModelConfig, token_ids, *, block_size: int, dtype,
            mesh=None) -> np.ndarray:
    """``[L, Hkv, 2]`` float32: the largest ``|k|`` and ``|v|`` each layer's attention writes
    for ``token_ids`` (one prefill, one jitted pass). A LinearState layer (no pages) gets 0,
    which :func:`scales_from_amax` turns into an unused 1.0."""
    n = len(token_ids)
    tp = sharding.tp_size(mesh)
    pages = -(-n // block_size)
    pool_sharding = sharding.kv_pool_sharding(mesh) if mesh is not None else None
    specs = model_cache_specs(model, model_config, dtype)
    # one pool of the prompt's pages (and one state slot), every layer at its spec's shape
    config = size_kv_cache(specs, Budget(0, num_pages_override=pages + 1),
                           block_size=block_size, max_model_len=n, max_num_seqs=1,
                           max_num_batched_tokens=n, per_group_pools=False, tp=tp)
    pool = allocate_kv_cache(
        config, dtype, kv_sharding=pool_sharding, tp=tp,
        state_sharding=sharding.state_pool_sharding(mesh) if mesh is not None else None)
    paged = [i in config.paged_layers for i in range(len(specs))]
    # the prefill is built as the engine builds its steps: a one-row batch, one diff
    batch = InputBatch(max_rows=1, num_groups=1, max_pages=pages, block_size=block_size,
                       max_model_len=n, max_num_seqs=1)
    ids = [int(t) for t in token_ids]
    batch.apply(BatchDiff(new_reqs=[NewRequestData(
        "calibration", ids, n, SamplingParams(), [list(range(1, pages + 1))],  # 0: trash
        state_slot=0)]))
    plan = batch.prepare_inputs(BatchDiff(
        req_ids=["calibration"], num_tokens=[n], token_ids=ids, start_pos=[0], sample=[False],
        num_draft=[0], num_output=[0]), ladder=(n,))
    inputs = jax.tree_util.tree_map(jnp.asarray, StepInputs.from_plan(plan))
    md = attention_metadata(inputs, state_slots=inputs.state_slots)
    graphdef, state = nnx.split(model)
    heads = sharding.pool_kv_heads(model_config.num_kv_heads, tp)

    @jax.jit
    def amax(state, pool, ids, md):
        m = nnx.merge(graphdef, state)
        _, pool = m(ids, jnp.arange(ids.shape[0], dtype=jnp.int32), pool, md)
        return jnp.stack([
            jnp.stack([jnp.max(jnp.abs(kv[0].astype(jnp.float32)), axis=(1, 2, 3)),
                       jnp.max(jnp.abs(kv[1].astype(jnp.float32)), axis=(1, 2, 3))], axis=-1)
            if is_paged else jnp.zeros((heads, 2), jnp.float32)
            for kv, is_paged in zip(pool, paged)])

    out = np.asarray(jax.device_get(amax(state, pool, jnp.asarray(token_ids, jnp.int32), md)))
    hkv = model_config.num_kv_heads
    # a pool that repeats KV heads (tp > Hkv) holds each head's values rep times
    return out.reshape(out.shape[0], hkv, out.shape[1] // hkv, 2).max(axis=2)


def calibration_ids(tokenizer, max_tokens: int) -> list[int]:
    ids = tokenizer(CALIBRATION_TEXT.read_text())["input_ids"]
    return list(ids[:max_tokens])


def scales_from_amax(amax: np.ndarray, kv_dtype) -> np.ndarray:
    """``amax / fp8_max``; a head that saw only zeros keeps 1.0."""
    fmax = float(jnp.finfo(kv_dtype).max)
    return np.where(amax > 0, amax / fmax, 1.0).astype(np.float32)


def prepare_kv_scales(model, model_config: ModelConfig, cache: CacheConfig, kv_dtype, *,
                      serving_dtype, tokenizer, max_model_len: int, mesh=None) -> None:
    """Settle the model's KV scales before its runner is built: ignored (and dropped) with a
    serving-dtype pool, computed with ``calculate_kv_scales``, else the checkpoint's or 1.0."""
    loaded = kv_scales.get_kv_scales(model)
    if not is_fp8(kv_dtype):
        if loaded is not None:
            logger.warning("the checkpoint has KV cache scales (k_scale/v_scale) but "
                           "kv_cache_dtype is %r: the scales are not used", cache.cache_dtype)
            kv_scales.set_kv_scales(model, None)
        return
    if (cache.calculate_kv_scales or loaded is not None) and not _uniform_kv(model):
        raise ValueError("KV cache scales (calculate_kv_scales, or k_scale/v_scale in the "
                         "checkpoint) are per layer of one KV shape; this model's layers differ "
                         "in KV heads/head_dim or share KV: use kv_cache_dtype fp8 without them")
    if cache.calculate_kv_scales:
        t0 = time.perf_counter()
        ids = calibration_ids(tokenizer, min(max_model_len, CALIBRATION_TOKENS))
        amax = kv_amax(model, model_config, ids, block_size=cache.block_size,
                       dtype=serving_dtype, mesh=mesh)
        scales = scales_from_amax(amax, kv_dtype)
        if loaded is not None:
            logger.info("calculate_kv_scales: replacing the checkpoint's KV cache scales")
        kv_scales.set_kv_scales(model, scales)
        logger.info("KV cache scales calculated on %d tokens in %.1f s: %s", len(ids),
                    time.perf_counter() - t0, kv_scales.describe(scales))
    elif loaded is not None:
        logger.info("KV cache scales from the checkpoint: %s", kv_scales.describe(loaded))
    else:
        logger.warning("KV cache dtype %s with scale 1.0 (the checkpoint has no k_scale/v_scale;"
                       " --calculate-kv-scales computes them)", jnp.dtype(kv_dtype).name)


def _uniform_kv(model) -> bool:
    """Every paged layer owns KV of one shape (what ``[L, Hkv, 2]`` scales describe); a
    LinearState layer holds an unused scale."""
    specs = [s for s in model.cache_specs("float32") if not isinstance(s, LinearState)]
    return (all(hasattr(s, "kv_heads") for s in specs)
            and len({(s.kv_heads, s.head_dim) for s in specs}) == 1)
