"""The model runner: one jitted step per token bucket, KV pool donated, compile counter.

    step(state, kv_pages, plan arrays, sampling arrays) -> (sampler output, kv_pages)

The model is split into a static graph and a state pytree once (``nnx.split``); the step merges
them inside ``jit``, so params are ordinary jit arguments and the graph is a closure. Every new
trace of the step is a compile: the counter counts traces, and anything after warm-up is a bug.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve import sampler as sampler_lib
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.kv_cache import allocate_kv_pages, page_bytes
from jaxserve.models.layers import AttentionMetadata
from jaxserve.sampling_metadata import build_sampling_arrays
from jaxserve.step_plan import ScheduledSeq, StepPlan, build_step_plan, seq_bucket, token_ladder

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30  # like vLLM's CPU KV space: a fixed budget when memory is unknown


@dataclass
class StepOutput:
    """Host copies of what the step sampled, one entry per plan row."""

    token_ids: np.ndarray  # [S] int32
    logprobs: np.ndarray  # [S] float32
    topk_ids: np.ndarray | None = None  # [S, K]
    topk_logprobs: np.ndarray | None = None
    ranks: np.ndarray | None = None


def default_attention_backend() -> str:
    """Pallas on GPU; the XLA (jnp) path on CPU, never interpret-mode Pallas outside tests."""
    return "pallas" if jax.default_backend() == "gpu" else "xla"


def num_pages_for(model_config: ModelConfig, engine_config: EngineConfig, dtype, max_model_len,
                  param_bytes: int) -> int:
    """Size the page pool from free device memory (or the override), after the weights."""
    cache = engine_config.cache
    block = cache.block_size
    per_page = page_bytes(model_config, block, dtype)
    if cache.num_gpu_blocks_override is not None:
        return int(cache.num_gpu_blocks_override)
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    sched = engine_config.scheduler
    if not limit:
        # CPU: enough for every sequence at full length, capped by a fixed budget.
        want = sched.max_num_seqs * (-(-max_model_len // block)) + 1
        cap = max(CPU_KV_CACHE_BYTES // per_page, 2 * (-(-max_model_len // block)) + 1)
        return int(max(2, min(want, cap)))
    in_use = stats.get("bytes_in_use", param_bytes)
    t_max = sched.max_num_batched_tokens
    act = 4 * t_max * (4 * model_config.hidden_size + 3 * model_config.intermediate_size)
    act += 4 * 3 * min(t_max, sched.max_num_seqs) * model_config.vocab_size
    reserve = 2 * act + (256 << 20)
    free = limit * cache.gpu_memory_utilization - in_use - reserve
    n = int(free // per_page)
    if n < 2:
        raise ValueError(
            f"no room for the KV cache: {limit / 2**30:.1f} GiB limit, {in_use / 2**30:.1f} GiB in "
            f"use; raise gpu_memory_utilization or lower max_num_batched_tokens"
        )
    return n


class ModelRunner:
    def __init__(self, model, model_config: ModelConfig, engine_config: EngineConfig,
                 max_model_len: int, dtype, param_bytes: int = 0, kv_sharding=None):
        self.model_config = model_config
        self.config = engine_config
        self.max_model_len = max_model_len
        self.block_size = engine_config.cache.block_size
        self.max_pages_per_seq = -(-max_model_len // self.block_size)
        sched = engine_config.scheduler
        self.max_num_seqs = sched.max_num_seqs
        self.ladder = token_ladder(sched.max_num_batched_tokens, sched.min_token_bucket)
        self.num_pages = num_pages_for(model_config, engine_config, dtype, max_model_len,
                                       param_bytes)
        self.kv_dtype = dtype
        self.kv_pages = allocate_kv_pages(model_config, self.num_pages, self.block_size, dtype,
                                          sharding=kv_sharding)
        self.graphdef, self.state = nnx.split(model)
        self.num_compiles = 0
        self.warmed_up = False
        self._rng = jax.random.key(engine_config.seed)
        self._step_count = 0
        self._step = jax.jit(self._step_fn, donate_argnums=(1,))
        logger.info("KV cache: %d pages of %d tokens (%.1f MiB)", self.num_pages, self.block_size,
                    self.num_pages * page_bytes(model_config, self.block_size, dtype) / 2**20)

    # ---- device side -------------------------------------------------------------------
    def _step_fn(self, state, kv_pages, arrays, sampling, rng):
        self.num_compiles += 1  # runs once per trace, i.e. once per compiled shape
        if self.warmed_up:
            logger.warning("compile after warm-up (token bucket %d): this is a bug",
                           arrays["token_ids"].shape[0])
        model = nnx.merge(self.graphdef, state)
        md = AttentionMetadata(
            slot_mapping=arrays["slot_mapping"],
            query_start=arrays["query_start"],
            seq_lens=arrays["seq_lens"],
            block_tables=arrays["block_tables"],
            num_seqs=arrays["num_seqs"],
        )
        hidden, kv_pages = model(arrays["token_ids"], arrays["positions"], kv_pages, md)
        logits = model.compute_logits(hidden[arrays["logits_indices"]])
        out = sampler_lib.sample(logits, sampler_lib.make_sampling_metadata(sampling, rng))
        return out, kv_pages

    # ---- host side ---------------------------------------------------------------------
    def build_plan(self, rows: list[ScheduledSeq], sampling_inputs: list) -> StepPlan:
        plan = build_step_plan(rows, block_size=self.block_size,
                               max_pages_per_seq=self.max_pages_per_seq, ladder=self.ladder,
                               max_num_seqs=self.max_num_seqs)
        plan.sampling = build_sampling_arrays(sampling_inputs, plan.seq_bucket)
        return plan

    def execute(self, plan: StepPlan) -> StepOutput:
        self._step_count += 1
        rng = jax.random.fold_in(self._rng, self._step_count)
        out, self.kv_pages = self._step(self.state, self.kv_pages, plan.device_arrays(),
                                        plan.sampling, rng)
        want_topk = bool(plan.sampling.get("_wants_topk", False))
        token_ids, logprobs = jax.device_get((out.token_ids, out.logprobs))
        res = StepOutput(token_ids=np.asarray(token_ids), logprobs=np.asarray(logprobs))
        if want_topk:
            ti, tl, rk = jax.device_get((out.topk_ids, out.topk_logprobs, out.ranks))
            res.topk_ids, res.topk_logprobs, res.ranks = map(np.asarray, (ti, tl, rk))
        return res

    def warmup(self) -> float:
        """Compile every token bucket with an all-padding plan (writes go to the trash page)."""
        t0 = time.perf_counter()
        for t in self.ladder:
            s = seq_bucket(t, self.max_num_seqs)
            plan = self._padding_plan(t, s)
            out, self.kv_pages = self._step(self.state, self.kv_pages, plan.device_arrays(),
                                            plan.sampling, self._rng)
            jax.block_until_ready(out.token_ids)
        self.warmed_up = True
        dt = time.perf_counter() - t0
        logger.info("warm-up: %d compiles for token buckets %s in %.1f s", self.num_compiles,
                    list(self.ladder), dt)
        return dt

    def _padding_plan(self, t: int, s: int) -> StepPlan:
        z = lambda *shape: np.zeros(shape, dtype=np.int32)  # noqa: E731
        plan = StepPlan(token_ids=z(t), positions=z(t), slot_mapping=z(t), query_start=z(s + 1),
                        seq_lens=z(s), block_tables=z(s, self.max_pages_per_seq),
                        logits_indices=z(s), num_seqs=0, num_tokens=0,
                        sample_mask=np.zeros(s, dtype=bool))
        plan.sampling = build_sampling_arrays([], s)
        return plan

    # ---- swap (preemption to host memory) ------------------------------------------------
    def swap_out(self, page_ids: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Copy pages to host memory, one (k, v) pair of ``[Hkv, n, block, D]`` per layer."""
        idx = jnp.asarray(np.asarray(page_ids, dtype=np.int32))
        return jax.device_get([(k[:, idx], v[:, idx]) for k, v in self.kv_pages])

    def swap_in(self, page_ids: list[int], saved) -> None:
        idx = jnp.asarray(np.asarray(page_ids, dtype=np.int32))
        self.kv_pages = _write_pages(self.kv_pages, idx, saved)


@jax.jit
def _scatter_pages(kv_pages, idx, saved):
    return [(k.at[:, idx].set(sk), v.at[:, idx].set(sv)) for (k, v), (sk, sv) in
            zip(kv_pages, saved)]


def _write_pages(kv_pages, idx, saved):
    saved = [(jnp.asarray(k), jnp.asarray(v)) for k, v in saved]
    return _scatter_pages(kv_pages, idx, saved)


def default_scheduler_limits() -> tuple[int, int, int]:
    """(max_num_seqs, max_num_batched_tokens, min_token_bucket) for the current backend.

    vLLM's defaults on a GPU; on CPU a smaller batch so single-request decode stays fast (the
    token bucket ladder starts at 1 there).
    """
    if jax.default_backend() == "gpu":
        return 256, 2048, 16
    return 16, 512, 1
