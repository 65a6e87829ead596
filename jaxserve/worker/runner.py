"""The model runner: one jitted step per token bucket, KV pool donated, compile counter.

    step(state, kv_pages, StepInputs, SamplerInputs) -> (sampler output, kv_pages)

Each half takes its inputs as one packed buffer (``worker.step_inputs``).

The model is split into a static graph and a state pytree once (``nnx.split``); the step merges
them inside ``jit``, so params are ordinary jit arguments and the graph is a closure. Every new
trace of the step is a compile: the counter counts traces, and anything after warm-up is a bug.

One entry, two halves: ``dispatch(plan)`` enqueues the step on the device and returns at once
(JAX dispatches asynchronously) with the host copy of its results under way; ``fetch(handle)``
waits for that copy. The sampled ids also stay on the device in a fixed ``[max_num_seqs]``
buffer, which the next step reads for its placeholder tokens (``plan.prev_ref``), so an engine
can build and dispatch step N+1 before it has seen step N's ids.
"""
from __future__ import annotations

import logging
import os
import threading
from contextlib import nullcontext
from dataclasses import dataclass
from functools import lru_cache, partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve import sharding
from jaxserve.worker import forward_hooks, memory_budget
from jaxserve.worker import rejection_sampler
from jaxserve.worker import sampler as sampler_lib
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.worker.compile_pool import CompilePool
from jaxserve.worker.host_memory import cpu_kv_cache_bytes
from jaxserve.worker.warmup import BucketWarmup, freeze_startup_heap
from jaxserve.worker.kv_cache import (allocate_group_pages, allocate_hybrid_caches,
                                      allocate_layer_pages, fork_copy, fork_pairs,
                                      kv_cache_dtype)
from jaxserve.models import batch_invariant
from jaxserve.models.layers import AttentionMetadata
from jaxserve.models.lora import LoRABatch
from jaxserve.core.sampling_metadata import SAMPLING_FIELDS
from jaxserve.core.sampling_params import DEFAULT_MAX_LOGPROBS
from jaxserve.core.kv_cache_spec import (attention_spec, group_layers, group_pools,
                                         kv_bytes_per_token, page_pools,
                                         pooled_kv_bytes_per_token, split_budget,
                                         split_budget_with_state, state_bytes_per_slot,
                                         state_groups)
from jaxserve.core.step_plan import ARRAY_FIELDS, TRASH_PAGE, StepPlan, seq_bucket, token_ladder
from jaxserve.worker.step_inputs import SamplerInputs, StepInputs, pack, unpack

logger = logging.getLogger(__name__)

# the StepPlan is a pytree: its arrays are leaves, its counts static (core/ imports no jax)
jax.tree_util.register_dataclass(StepPlan, data_fields=list(ARRAY_FIELDS),
                                 meta_fields=["num_seqs", "num_tokens"])



class _TraceCount(threading.local):
    """Traces of the step's jitted functions (a trace is a compile), per thread: a runner
    traces in the thread that drives it, so another engine in another thread (an ``LLM`` next
    to a serving ``AsyncLLM``) never shows up in this runner's count."""

    n = 0


_TRACES = _TraceCount()


@lru_cache(maxsize=None)
def _forward_fn(graphdef, state_treedef, mesh=None, state_layers: tuple[int, ...] = (),
                num_layers: int = 0, snapshots: tuple[int, int] | None = None,
                invariant: bool = False):
    """The model half of the step (write K/V, attend, logits of each row's last token), jitted
    for one model graph. ``snapshots`` (first scratch slot, k): the state pool keeps each
    verify row's state after each of its tokens (:func:`snapshot_slots`).

    Cached on the graph, so runners of the same model shape share executables; the graph is
    hashed once here rather than on every call (a static jit argument is hashed per dispatch,
    which cost milliseconds per step), and params travel as a flat list of leaves.
    """

    def forward(state_leaves, kv_pages, buf, prev_tokens, lora, layout, embeds=None, mm=None):
        _TRACES.n += 1
        model = nnx.merge(graphdef, jax.tree_util.tree_unflatten(state_treedef, state_leaves))
        with (forward_hooks.prompt_embeds(model, unpack(buf, layout).embed_mask, embeds)
              if embeds is not None else nullcontext()), batch_invariant.mode(invariant):
            return model_half(model, buf, prev_tokens, kv_pages, lora, layout, mm)

    def model_half(model, buf, prev_tokens, kv_pages, lora, layout, mm):
        inputs: StepInputs = unpack(buf, layout)
        ref = inputs.prev_ref
        token_ids = jnp.where(ref >= 0, prev_tokens[jnp.maximum(ref, 0)], inputs.token_ids)
        md = attention_metadata(
            inputs, state_slots=_state_slots(inputs.state_slots, kv_pages, state_layers),
            snapshot_slots=(None if snapshots is None
                            else snapshot_slots(inputs.num_draft, *snapshots)))
        kwargs = {} if lora is None else {  # (scale [L], per-layer A/B) of the device slots
            "lora": LoRABatch(inputs.lora_slots, *lora)}
        positions = inputs.positions
        if mm is not None:  # a vision-language model (worker.mm_step.EncoderRunner)
            positions, mm_rows, mm_embeds = mm
            kwargs["mm"] = (mm_embeds, mm_rows)
        captured = None
        if inputs.hidden_layers.shape[1]:  # return_hidden_states: K layers a token
            hidden, kv_pages, captured = forward_hooks.forward_with_capture(
                model, inputs.hidden_layers, inputs.query_start, token_ids, positions,
                kv_pages, md, **kwargs)
        else:
            hidden, kv_pages = model(token_ids, positions, kv_pages, md, **kwargs)
        # hidden stays on device; only prompt_logprobs reads it (see _prompt_logprobs_fn).
        # logits_indices is [S], or [S, k+1] with speculative decoding (every verified position)
        idx = inputs.logits_indices
        if idx.size > hidden.shape[0]:
            # more positions than tokens (the verify shapes of a small bucket: S rows of k+1,
            # mostly padding): the vocabulary projection runs once per token, then is gathered
            return model.compute_logits(hidden)[idx], kv_pages, hidden, captured
        logits = model.compute_logits(hidden[idx.reshape(-1)])
        return logits.reshape(idx.shape + logits.shape[-1:]), kv_pages, hidden, captured

    if mesh is None:
        return jax.jit(forward, donate_argnums=(1,), static_argnums=(5,))
    # Tensor parallel: logits leave replicated (an on-device all-gather over the vocabulary
    # shards) and the donated pool keeps its head sharding, so every step reuses one program.
    pool = sharding.kv_pool_sharding(mesh)
    if state_layers:  # the state pools split over their channel/head axis, the pages over heads
        pool = [sharding.state_pool_sharding(mesh) if i in state_layers else pool
                for i in range(num_layers)]
    return jax.jit(forward, donate_argnums=(1,), static_argnums=(5,), out_shardings=(
        sharding.replicated(mesh), pool, sharding.replicated(mesh), sharding.replicated(mesh)))


def attention_metadata(inputs: StepInputs, state_slots=None, snapshot_slots=None,
                       group: int | None = None) -> AttentionMetadata:
    """What the attention kernels read of a step's inputs, the one place that makes it: with
    one page pool (or ``group`` named), that group's slot mapping and block tables; with a
    pool per cache group, every group's (``[G, ...]``), and the model picks each layer's
    (``cache_groups_supported``)."""
    grouped = group is None and inputs.block_tables.shape[0] > 1
    g = group or 0
    return AttentionMetadata(
        slot_mapping=inputs.slot_mapping if grouped else inputs.slot_mapping[g],
        query_start=inputs.query_start, seq_lens=inputs.seq_lens,
        block_tables=inputs.block_tables if grouped else inputs.block_tables[g],
        num_seqs=inputs.num_seqs, state_slots=state_slots, snapshot_slots=snapshot_slots)


def snapshot_slots(num_draft, base: int, k: int):
    """``[S, k+1]``: where row ``b`` keeps its state after its token ``i`` (``i < num_draft``,
    the tokens a rejection may roll back to): scratch slot ``base + b * k + i``; -1 elsewhere.
    The state after a row's last token is its own slot's, as for any row."""
    S = num_draft.shape[0]
    i = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    b = jnp.arange(S, dtype=jnp.int32)[:, None]
    return jnp.where(i < num_draft[:, None], base + b * k + i, -1).astype(jnp.int32)


@lru_cache(maxsize=None)
def _rollback_fn(base: int, k: int, mesh=None):
    """Speculative decoding's rollback of the recurrent state, after the verifier: a row that
    kept ``a < num_draft`` drafts copies its snapshot after token ``a`` (the last accepted
    one, :func:`snapshot_slots`) into its own slot, which the verify step left holding the
    state after every draft. Rows that kept all their drafts, and rows without, are untouched.
    Per-position snapshots rather than snapshot + recompute: k small copies per row in the
    verify step and one copy here, never a second forward. ``state_pools``: the LinearState
    layers' arrays (donated)."""

    def rollback(state_pools, slots, num_draft, num_emitted):
        _TRACES.n += 1
        a = num_emitted - 1
        rows = jnp.arange(slots.shape[0], dtype=jnp.int32)
        src = base + rows * k + jnp.clip(a, 0, k - 1)
        trash = state_pools[0][0].shape[0] - 1
        dst = jnp.where((a < num_draft) & (slots >= 0), slots, trash)
        return [tuple(p.at[dst].set(p[src]) for p in layer) for layer in state_pools]

    if mesh is None:
        return jax.jit(rollback, donate_argnums=(0,))
    return jax.jit(rollback, donate_argnums=(0,),
                   out_shardings=sharding.state_pool_sharding(mesh))


@lru_cache(maxsize=None)
def _mtp_fn(graphdef, state_treedef, k: int, block_size: int, mesh=None):
    """The MTP head's drafts for the next step, run right after the verifier (vLLM's
    ``qwen3_5_mtp`` flow), jitted per token bucket.

    1. Over every token of the step: the head at position ``t`` reads the target's hidden
       state of ``t`` and token ``t + 1`` (the next token of the row; for the position a row
       samples from, the token it emitted there: the sampled one, or a verify row's token
       after its last accepted draft; for a prefill chunk's last token the next prompt token,
       ``next_token_ids``), writing its K/V for every position the target wrote (rejected
       positions are rewritten by the next step). Its logits at each row's sampling position
       are draft 1.
    2. ``k - 1`` more single-token steps per row, one position on each, on the head's own
       hidden state and the draft just made. Their K/V lands where the next step's pass 1
       rewrites it, or on the trash page past the row's pages.

    Returns (drafts ``[S, k]``, the head's pages)."""

    def propose(state_leaves, mtp_kv, buf, hidden, prev_tokens, emitted, num_emitted, layout):
        _TRACES.n += 1
        model = nnx.merge(graphdef, jax.tree_util.tree_unflatten(state_treedef, state_leaves))
        inputs: StepInputs = unpack(buf, layout)
        T = hidden.shape[0]
        ref = inputs.prev_ref
        tok = jnp.where(ref >= 0, prev_tokens[jnp.maximum(ref, 0)], inputs.token_ids)
        qs, seq_lens, nd = inputs.query_start, inputs.seq_lens, inputs.num_draft
        S = seq_lens.shape[0]
        rows = jnp.arange(S, dtype=jnp.int32)
        real = seq_lens > 0
        a = num_emitted - 1
        src = jnp.clip(qs[1:] - 1 - nd + a, 0, T - 1)  # each row's sampling position
        nxt_row = jnp.where(inputs.next_token_ids >= 0, inputs.next_token_ids,
                            emitted[rows, jnp.clip(a, 0, k)])
        nxt = jnp.concatenate([tok[1:], jnp.zeros((1,), tok.dtype)])
        nxt = nxt.at[jnp.where(real, src, T)].set(nxt_row, mode="drop")
        h, mtp_kv = model.mtp_forward(nxt, inputs.positions, hidden, mtp_kv,
                                      attention_metadata(inputs, group=0))
        h = h[src]
        draft = jnp.argmax(model.compute_logits(h), axis=-1).astype(jnp.int32)
        drafts = [draft]
        pos = inputs.positions[src]
        bt = inputs.block_tables[:1]
        max_pos = bt.shape[2] * block_size - 1
        for j in range(1, k):  # one position a row: the row's own single-token step
            p = jnp.minimum(pos + j, max_pos)
            page = bt[0, rows, p // block_size]
            one = inputs.replace(
                slot_mapping=jnp.where(real, page * block_size + p % block_size,
                                       TRASH_PAGE * block_size)[None],
                query_start=jnp.arange(S + 1, dtype=jnp.int32),
                seq_lens=jnp.where(real, p + 1, 1), block_tables=bt, num_seqs=jnp.int32(S))
            h, mtp_kv = model.mtp_forward(draft, p, h, mtp_kv, attention_metadata(one, group=0))
            draft = jnp.argmax(model.compute_logits(h), axis=-1).astype(jnp.int32)
            drafts.append(draft)
        return jnp.stack(drafts, axis=1), mtp_kv

    if mesh is None:
        return jax.jit(propose, donate_argnums=(1,), static_argnums=(7,))
    return jax.jit(propose, donate_argnums=(1,), static_argnums=(7,), out_shardings=(
        sharding.replicated(mesh), sharding.kv_pool_sharding(mesh)))


def _state_slots(slots, kv_pages, state_layers: tuple[int, ...]):
    """The plan's slots with -1 (no slot: padding and warm-up rows) sent to the trash slot,
    the last one of the state pool; None for a model without LinearState layers."""
    if not state_layers:
        return None
    trash = kv_pages[state_layers[0]][0].shape[0] - 1
    return jnp.where(slots < 0, trash, slots)


PROMPT_LOGPROBS_CHUNK = 256  # tokens per chunk: bounds the [chunk, V] logits in memory


@lru_cache(maxsize=None)
def _prompt_logprobs_fn(graphdef, state_treedef, num_top_logprobs: int,
                        invariant: bool = False):
    """Logprobs of each prompt token under the step's hidden states (``prompt_logprobs``),
    with the top ``num_top_logprobs`` of each position.

    A separate jit per token bucket, run only in steps that carry such a request; logits are
    made ``PROMPT_LOGPROBS_CHUNK`` tokens at a time so a long bucket never holds ``[T, V]``.
    """

    def prompt_logprobs(state_leaves, hidden, next_ids):
        _TRACES.n += 1
        model = nnx.merge(graphdef, jax.tree_util.tree_unflatten(state_treedef, state_leaves))
        t = hidden.shape[0]
        c = max(d for d in range(1, min(t, PROMPT_LOGPROBS_CHUNK) + 1) if t % d == 0)

        def chunk(args):
            h, ids = args
            return sampler_lib.compute_prompt_logprobs(model.compute_logits(h), ids,
                                                       num_top_logprobs)

        with batch_invariant.mode(invariant):
            outs = jax.lax.map(chunk, (hidden.reshape(t // c, c, -1),
                                       next_ids.reshape(t // c, c)))
        return jax.tree_util.tree_map(lambda x: x.reshape((t,) + x.shape[2:]), outs)

    return jax.jit(prompt_logprobs)


@lru_cache(maxsize=None)
def _sample_fn(mesh=None, num_top_logprobs: int = DEFAULT_MAX_LOGPROBS,
               processors: tuple = (), invariant: bool = False):
    """The sampler half: its own jit, so the model graph compiles once per token bucket while
    the (cheap) sampler compiles once per sequence bucket and sampling-array layout. The top
    logprobs have the static width ``num_top_logprobs`` (see :func:`top_logprobs_width`).

    Takes a packed :class:`SamplerInputs`; its ``history_ref[S, 2]`` (buffer row, history
    index) fills a penalty row's pending token from ``prev_tokens``. Returns the sampler output and the ``[max_num_seqs]`` buffer of each row's
    last sampled id with this step's ids written at ``token_rows`` (-1: not kept), which later
    steps read; under a mesh everything
    leaves replicated (on the parameters' 1-device mesh without tensor parallelism), so the
    buffer keeps one sharding from step to step."""

    def sample(logits, buf, prev_tokens, token_bitmask, layout):
        with batch_invariant.mode(invariant):
            return sample_rows(logits, buf, prev_tokens, token_bitmask, layout)

    def sample_rows(logits, buf, prev_tokens, token_bitmask, layout):
        _TRACES.n += 1
        inputs: SamplerInputs = unpack(buf, layout)
        fields = {k: inputs.sampling[k] for k in SAMPLING_FIELDS}
        hist = fields["history"]
        rows = jnp.arange(hist.shape[0])
        history_ref = inputs.history_ref
        src, pos = history_ref[:, 0], jnp.clip(history_ref[:, 1], 0, hist.shape[1] - 1)
        pending = prev_tokens[jnp.maximum(src, 0)]
        fields["history"] = hist.at[rows, pos].set(jnp.where(src >= 0, pending, hist[rows, pos]))
        md = sampler_lib.SamplingMetadata(**fields)
        procs = tuple((fn, inv, st) for (fn, inv), st in zip(processors, inputs.processors))
        if not inputs.speculating:
            out = sampler_lib.sample(logits, md, num_top_logprobs, token_bitmask=token_bitmask,
                                     processors=procs)
            ids = out.token_ids
        else:  # [S, k+1, V]: column 0 is what a row without drafts samples
            out = sampler_lib.sample(logits[:, 0], md, num_top_logprobs,
                                     token_bitmask=token_bitmask)
            ids = out.token_ids
            out = (out, rejection_sampler.verify(logits, md, inputs.draft_token_ids,
                                                 inputs.num_draft, out.token_ids))
        R = prev_tokens.shape[0]
        token_rows = inputs.token_rows
        return out, prev_tokens.at[jnp.where(token_rows >= 0, token_rows, R)].set(
            ids, mode="drop")

    return jax.jit(sample, static_argnums=(4,),
                   out_shardings=sharding.replicated(mesh or sharding.default_mesh()))


def _captures(plan: StepPlan) -> bool:
    """Whether a row of the step asked for hidden states (only then are they copied back)."""
    return plan.hidden_layers is not None and bool((plan.hidden_layers[:plan.num_seqs] >= 0).any())


def top_logprobs_width(max_logprobs: int, vocab_size: int) -> int:
    """The static top-k width of the sampler's logprobs: ``max_logprobs`` (-1: the vocabulary),
    at most the vocabulary, at least 1."""
    k = vocab_size if max_logprobs == -1 else min(max_logprobs, vocab_size)
    return max(1, k)


@dataclass
class StepHandle:
    """A dispatched step: device arrays whose host copies are under way."""

    plan: StepPlan
    sampled: object  # SamplerOutput on device
    prompt_logprobs: tuple | None = None
    want_topk: bool = False
    verify: object = None  # rejection_sampler.VerifyOutput on device (speculative decoding)
    drafts: object = None  # [S, k] the MTP head's drafts for each row's next step, on device
    hidden_states: object = None  # [T, K, H] captured residual streams (a row asked), on device


@dataclass
class StepOutput:
    """Host copies of what the step sampled, one entry per plan row."""

    token_ids: np.ndarray  # [S] int32
    logprobs: np.ndarray  # [S] float32
    topk_ids: np.ndarray | None = None  # [S, K]
    topk_logprobs: np.ndarray | None = None
    ranks: np.ndarray | None = None
    # (logprob [T], top-k ids [T, K], top-k logprobs [T, K], rank [T]) of each next prompt token
    prompt_logprobs: tuple | None = None
    # speculative decoding: [S, k+1] emitted tokens (-1 padded) and [S] how many
    spec_token_ids: np.ndarray | None = None
    num_emitted: np.ndarray | None = None
    draft_ids: np.ndarray | None = None  # [S, k] the MTP head's drafts (method "mtp")
    # [num_tokens, K, H] float32 the residual stream at each token's row's asked layers
    hidden_states: np.ndarray | None = None


def enable_compilation_cache(path: str | None = None) -> None:
    """Persist compiled steps on disk so a restart (or a second engine) skips XLA compiles."""
    import os

    # the sampler's graphs compile in well under JAX's default 1 s floor: keep them too
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    if jax.config.jax_compilation_cache_dir:
        return
    path = path or os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                                "jaxserve", "xla-cache")
    jax.config.update("jax_compilation_cache_dir", path)


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


class ModelRunner:
    def __init__(self, model, model_config: ModelConfig, engine_config: EngineConfig,
                 max_model_len: int, dtype, param_bytes: int = 0, kv_sharding=None, mesh=None,
                 extra_page_bytes: int = 0):
        self.model_config = model_config
        self.config = engine_config
        self.max_model_len = max_model_len
        self.block_size = engine_config.cache.block_size
        self.max_pages_per_seq = -(-max_model_len // self.block_size)
        sched = engine_config.scheduler
        self.max_num_seqs = sched.max_num_seqs
        spec = engine_config.speculative
        self.num_spec_tokens = spec.num_speculative_tokens if spec is not None else 0
        # return_hidden_states: layers captured per token (the static width; 0 = none)
        self.max_hidden_state_layers = engine_config.max_hidden_state_layers
        # --enable-prompt-embeds: the forward takes [T, H] embeddings beside the token ids
        self.enable_prompt_embeds = engine_config.enable_prompt_embeds
        self._zero_embeds: dict[int, jax.Array] = {}
        # method "mtp": the model's MTP head drafts inside every step (its pages the last layer)
        self.mtp = spec is not None and spec.method == "mtp"
        if self.mtp and model.mtp is None:
            raise ValueError("speculative_config.method 'mtp' needs a model built with its "
                             "multi-token-prediction head (ModelConfig.load_mtp)")
        min_bucket = sched.min_token_bucket
        if engine_config.batch_invariant:  # below it XLA:CPU emits its dots another way
            min_bucket = max(min_bucket, batch_invariant.MIN_TOKEN_BUCKET)
        self.ladder = token_ladder(sched.max_num_batched_tokens, min_bucket,
                                   sched.token_bucket_growth)
        self.mesh = mesh  # tensor parallel (jaxserve.sharding); None: single device
        self.lora = None  # jaxserve.lora.slots.LoRASlots when LoRA is on (set before warm-up)
        self.mm = None  # worker.mm_step.EncoderRunner of a vision-language model (ditto)
        tp = sharding.tp_size(mesh)
        if mesh is not None:
            kv_sharding = sharding.kv_pool_sharding(mesh)
        self.kv_dtype = kv_cache_dtype(engine_config.cache.cache_dtype, dtype)
        # layers grouped by cache spec; one page pool today (core.kv_cache_spec.page_pools)
        self.cache_specs = model_cache_specs(model, model_config, self.kv_dtype)
        self.cache_groups = group_layers(self.cache_specs)
        self.state_layers = tuple(sorted(i for g in state_groups(self.cache_groups)
                                         for i in g.layers))
        self.num_state_slots = None  # slots of the state pool (None: no LinearState layers)
        # speculating with LinearState layers: k scratch slots per row after the requests'
        # slots hold the verify rows' per-token snapshots (rollback: _rollback_fn)
        self.snapshots = None  # (first scratch slot, k)
        self.grouped = not self.state_layers and use_group_pools(
            model, self.cache_groups, engine_config, extra_page_bytes)
        if self.grouped:  # a pool per group (core.kv_cache_groups)
            self.pools = group_pools(self.cache_groups)
            sizes = group_pool_sizes(self.pools, model_config, engine_config, max_model_len,
                                     param_bytes // tp, tp)
            self.pool_pages = tuple(sharding.agree_across_hosts(n) for n in sizes)
            self.kv_pages = allocate_group_pages(self.cache_specs, self.cache_groups,
                                                 self.pool_pages, self.block_size, self.kv_dtype,
                                                 sharding=kv_sharding, tp=tp)
        elif self.state_layers:  # one page pool beside the state pool
            self.pools = page_pools(self.cache_groups)
            scratch = self.max_num_seqs * self.num_spec_tokens
            slots, sizes = state_pool_sizes(self.pools, self.cache_groups, model_config,
                                            engine_config, max_model_len, param_bytes // tp, tp,
                                            scratch, extra_page_bytes)
            self.num_state_slots = sharding.agree_across_hosts(slots)
            self.pool_pages = (sharding.agree_across_hosts(sizes[0]),)
            if scratch:
                self.snapshots = (self.num_state_slots, self.num_spec_tokens)
            self.kv_pages = allocate_hybrid_caches(
                model_config, self.cache_groups, self.pool_pages[0], self.num_state_slots,
                self.block_size, self.kv_dtype, kv_sharding=kv_sharding,
                state_sharding=(sharding.state_pool_sharding(mesh) if mesh is not None
                                else None), tp=tp, scratch_slots=scratch)
        else:  # one pool: a page id indexes every layer's array (core.kv_cache_spec.page_pools)
            self.pools = page_pools(self.cache_groups)
            sizes = pool_sizes(self.pools, model_config, engine_config, max_model_len,
                               param_bytes // tp, tp, extra_page_bytes)
            self.pool_pages = (sharding.agree_across_hosts(sizes[0]),)
            # one (k, v) per layer at its spec's shape, () for a layer reading another's pages
            self.kv_pages = allocate_layer_pages(self.cache_specs, self.pool_pages[0],
                                                 self.block_size, self.kv_dtype,
                                                 sharding=kv_sharding, tp=tp)
        self.num_pages = self.pool_pages[0]
        self.num_cache_groups = len(self.pools)  # block tables per plan row
        self.page_bytes = sum(p.page_bytes(self.block_size) for p in self.pools)
        self.graphdef, self.state = nnx.split(model)
        self._state_leaves, treedef = jax.tree_util.tree_flatten(self.state)
        # --batch-invariant: reductions in a fixed order (models.batch_invariant)
        self.batch_invariant = engine_config.batch_invariant
        self._forward = _forward_fn(self.graphdef, treedef, mesh, self.state_layers,
                                    len(self.cache_specs), self.snapshots,
                                    self.batch_invariant)
        self._rollback = (None if self.snapshots is None
                          else _rollback_fn(*self.snapshots, mesh))
        self._mtp = (_mtp_fn(self.graphdef, treedef, self.num_spec_tokens, self.block_size, mesh)
                     if self.mtp else None)
        self.num_top_logprobs = top_logprobs_width(engine_config.max_logprobs,
                                                   model_config.vocab_size)
        self._prompt_logprobs = _prompt_logprobs_fn(self.graphdef, treedef,
                                                    self.num_top_logprobs, self.batch_invariant)
        # custom logits processors (worker.logits_processors; set before warm-up)
        self.logits_processors = None
        self._sample = _sample_fn(mesh, self.num_top_logprobs, (), self.batch_invariant)
        self.num_compiles = 0  # traces of the step this runner caused (each is a compile)
        # --enforce-eager: no warm-up; a bucket compiles on the first step that needs it
        self.enforce_eager = engine_config.enforce_eager
        # One step at a time touches the KV pool: the engine's steps and the warm-up runs of
        # buckets compiled in the background.
        self._pool_lock = threading.RLock()
        self._warmup: BucketWarmup | None = None  # the compile jobs, once started
        self._count_lock = threading.Lock()
        self._ones_bitmasks: dict[int, jax.Array] = {}  # all-ones masks per sequence bucket
        # the last step's sampled ids, on device: the next step's placeholder tokens read them
        self._last_tokens = self._device_zeros((self.max_num_seqs,), jnp.int32)
        self._captured = None  # the last step's hidden-state capture, when a row asked
        if self.state_layers:
            self._log_hybrid_cache(max_model_len, tp)
        else:
            self._log_kv_cache(max_model_len)

    def _log_kv_cache(self, max_model_len: int) -> None:
        """The pools and vLLM's figures: KV bytes a max_model_len request holds per context
        token, and how many such requests the pools hold at once."""
        per_token = kv_bytes_per_token if self.grouped else pooled_kv_bytes_per_token
        self.kv_bytes_per_token = per_token(self.cache_groups, block_size=self.block_size,
                                            max_model_len=max_model_len)
        self.max_concurrency = min(
            (n - 1) / p.max_pages(max_model_len, self.block_size)
            for n, p in zip(self.pool_pages, self.pools))
        total = sum(n * p.page_bytes(self.block_size) for n, p in zip(self.pool_pages,
                                                                       self.pools))
        logger.info("KV cache: %s pages of %d tokens in %d pool(s) (%.1f MiB, %s); KV bytes "
                    "per context token: %.0f; Maximum concurrency for %d tokens per request: "
                    "%.2fx", "+".join(map(str, self.pool_pages)), self.block_size,
                    len(self.pools), total / 2**20, np.dtype(self.kv_dtype).name,
                    self.kv_bytes_per_token, max_model_len, self.max_concurrency)

    def _log_hybrid_cache(self, max_model_len: int, tp: int) -> None:
        """What the page pool and the state pool hold: requests and context tokens."""
        page = self.pools[0].page_bytes(self.block_size, tp) // tp
        slot = state_bytes_per_slot(self.cache_groups) // tp
        tokens = (self.num_pages - 1) * self.block_size
        logger.info(
            "KV cache: %d pages of %d tokens (%.1f MiB, %d attention layers, %.0f bytes per "
            "context token); state pool: %d slots of %.2f MiB a device (%d LinearState layers, "
            "float32): %d requests at once, %d context tokens in all (%.1f requests at max_model_len %d)",
            self.num_pages, self.block_size, self.num_pages * page / 2**20,
            len(self.pools[0].layers), page / self.block_size, self.num_state_slots,
            slot / 2**20, len(self.state_layers), self.num_state_slots, tokens,
            min(self.num_state_slots, tokens / max_model_len), max_model_len)
        if self.snapshots is not None:
            n = self.max_num_seqs * self.num_spec_tokens
            logger.info("state pool: %d more slots (%.1f MiB) for the per-token snapshots of "
                        "speculative verify rows (%d per row)", n, n * slot / 2**20,
                        self.num_spec_tokens)

    def _device_zeros(self, shape: tuple, dtype):
        """Zeros placed as a step's outputs are (replicated under a mesh, made by a jit), so
        the steps that take them see the same input type as later and do not recompile."""
        mesh = self.mesh or sharding.default_mesh()
        return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding.replicated(mesh))()

    # ---- host side ---------------------------------------------------------------------
    def _run(self, plan: StepPlan, mm: dict | None = None, host_logits=None):
        prompt_next_ids = plan.prompt_next_ids
        if self._warmup is not None:  # a bucket still compiling: wait, never compile here
            self._warmup.wait(plan)
        with self._pool_lock:
            before = _TRACES.n
            inputs, sampler_inputs = self._step_inputs(plan)
            packed = pack(inputs)
            prev_tokens = self._last_tokens
            logits, self.kv_pages, hidden, captured = self._forward(
                self._state_leaves, self.kv_pages, packed[0], prev_tokens, self._lora_arrays(),
                packed[1], embeds=self.embeds_arg(plan),
                mm=self.mm_arrays(plan) if mm is None else mm)
            if host_logits is not None:  # host logits processors: a round trip of [S, V]
                logits = self._host_logits(logits, plan.num_seqs, host_logits)
            out, self._last_tokens = self.sample(logits, sampler_inputs, prev_tokens,
                                                 self._bitmask(plan))
            drafts = self.after_verify(inputs, packed, hidden, out, prev_tokens)
            if drafts is not None:
                out = (*out, drafts)
            if prompt_next_ids is not None:
                out = (out, self._prompt_logprobs(self._state_leaves, hidden, prompt_next_ids))
            self._captured = captured if _captures(plan) else None
            if _TRACES.n != before:
                self._add_compiles(_TRACES.n - before)
                if self._warmup is not None:
                    logger.warning("compile caused by a step (token bucket %d): this is a bug",
                                   plan.token_bucket)
        return out

    def set_logits_processors(self, procs) -> None:
        """The engine's custom processors (before warm-up): their jax halves become part of
        the sampler's trace, their state rows part of its inputs."""
        self.logits_processors = procs
        self._sample = _sample_fn(self.mesh, self.num_top_logprobs, procs.sampler_spec(),
                                  self.batch_invariant)

    def processor_template(self, s: int) -> tuple:
        return () if self.logits_processors is None else self.logits_processors.template(s)

    def embeds_arg(self, plan: StepPlan):
        """The forward's ``[T, H]`` prompt embeddings (``--enable-prompt-embeds``): the plan's
        when a row reads some, else zeros kept on the device per token bucket (nothing copied);
        None when the engine takes no prompt embeddings."""
        if not self.enable_prompt_embeds:
            return None
        if plan.prompt_embeds is not None:
            return jax.device_put(plan.prompt_embeds,
                                  sharding.replicated(self.mesh or sharding.default_mesh()))
        t = plan.token_bucket
        zeros = self._zero_embeds.get(t)
        if zeros is None:
            zeros = self._zero_embeds[t] = self._device_zeros(
                (t, self.model_config.hidden_size), jnp.float32)
        return zeros

    def _host_logits(self, logits, n: int, fn):
        """``fn`` on the real rows' logits, on the host; the result back where they were."""
        arr = np.array(jax.device_get(logits), dtype=np.float32)
        arr[:n] = fn(arr[:n])
        return jax.device_put(arr, logits.sharding)

    def sample(self, logits, inputs: SamplerInputs, prev_tokens, token_bitmask):
        """The sampler on a step's logits: ``(output, the last-token buffer with this step's
        ids)``, the inputs sent as one buffer."""
        buf, layout = pack(inputs)
        return self._sample(logits, buf, prev_tokens, token_bitmask, layout)

    def weight_leaves(self) -> list:
        """The model's parameter arrays (what the step reads as weights)."""
        return list(self._state_leaves)

    def _lora_arrays(self):
        """The adapter slots' device weights (None without LoRA): one graph for any mix."""
        return None if self.lora is None else self.lora.arrays

    def after_verify(self, inputs: StepInputs, packed, hidden, out, prev_tokens):
        """What a speculating step runs after its verifier (in the step's own dispatch, so
        nothing waits for the host): the recurrent state's rollback to each verify row's last
        accepted token, then the MTP head's drafts for the next step (None without it).
        ``packed``: the forward's ``pack(inputs)``."""
        if not self.num_spec_tokens:
            return None
        verify = out[1]
        pool = list(self.kv_pages)
        if self._rollback is not None:
            states = self._rollback([pool[i] for i in self.state_layers],
                                    inputs.state_slots, inputs.num_draft, verify.num_emitted)
            for i, st in zip(self.state_layers, states):
                pool[i] = st
        drafts = None
        if self._mtp is not None:
            drafts, pool[-1] = self._mtp(self._state_leaves, pool[-1], packed[0], hidden,
                                         prev_tokens, verify.token_ids, verify.num_emitted,
                                         packed[1])
        self.kv_pages = pool
        return drafts

    def _step_inputs(self, plan: StepPlan) -> tuple[StepInputs, SamplerInputs]:
        """The step's two device-side views (every step of a speculating engine has the
        verify shapes: logits at ``[S, k+1]`` positions)."""
        return StepInputs.from_plan(plan), SamplerInputs.from_plan(
            plan, self.num_spec_tokens, self.processor_template(plan.seq_bucket))

    def mm_arrays(self, plan: StepPlan):
        """A vision-language model's image inputs with their off values (no image in the
        step: the same trace); None for every other model."""
        return None if self.mm is None else self.mm.off_arrays(plan.positions)

    def make_lora_slots(self, targets, max_loras: int, max_rank: int, dtype):
        """The device slots of every layer's adapters, placed like the weights they adapt."""
        from jaxserve.lora.slots import LoRASlots

        return LoRASlots(targets, self.model_config.num_layers, max_loras, max_rank, dtype,
                         mesh=self.mesh, weight_specs=targets.specs)

    def write_lora(self, slot: int, adapter) -> None:
        """Lay an adapter into a device slot (between steps: the warm-up's runs read the slots
        too, and the update donates them)."""
        with self._pool_lock:
            self.lora.write(slot, adapter)

    def _add_compiles(self, n: int) -> None:
        with self._count_lock:
            self.num_compiles += n

    def bitmask_width(self) -> int:
        return (self.model_config.vocab_size + 31) // 32

    def _put_bitmask(self, mask: np.ndarray) -> jax.Array:
        """On the device, placed one way for every step (so no step compiles for it)."""
        return jax.device_put(mask, sharding.replicated(self.mesh or sharding.default_mesh()))

    def _bitmask(self, plan: StepPlan) -> jax.Array:
        """The plan's structured-output mask, or the all-ones mask kept on the device (per
        sequence bucket: unconstrained steps copy nothing for it)."""
        if plan.token_bitmask is not None:
            return self._put_bitmask(plan.token_bitmask)
        return self._ones_bitmask(plan.seq_bucket)

    def _ones_bitmask(self, s: int) -> jax.Array:
        ones = self._ones_bitmasks.get(s)
        if ones is None:  # made once per bucket (compile workers may race: same content)
            ones = self._ones_bitmasks[s] = self._put_bitmask(
                np.full((s, self.bitmask_width()), -1, np.int32))
        return ones

    def dispatch(self, plan: StepPlan, mm=None, host_logits=None) -> StepHandle:
        """Enqueue the step and start copying its results to the host; returns at once.
        A plan with ``prompt_next_ids`` also computes the prompt logprobs; ``mm``: the step's
        image arrays (``EncoderRunner.prepare``); ``host_logits``: the host logits processors'
        function on ``[num_seqs, V]`` numpy logits (the step then waits for its logits)."""
        out = self._run(plan, mm, host_logits)
        prompt_lp = verify = drafts = None
        if plan.prompt_next_ids is not None:
            out, prompt_lp = out
        if self.num_spec_tokens:
            out, verify, *rest = out
            drafts = rest[0] if rest else None
        h = StepHandle(plan, out, prompt_lp, bool(np.any(plan.sampling["num_logprobs"] >= 0)),
                       verify, drafts, self._captured)
        for x in self._handle_arrays(h):
            x.copy_to_host_async()
        return h

    @staticmethod
    def _handle_arrays(h: StepHandle) -> list:
        xs = [h.sampled.token_ids, h.sampled.logprobs]
        if h.want_topk:
            xs += [h.sampled.topk_ids, h.sampled.topk_logprobs, h.sampled.ranks]
        if h.prompt_logprobs is not None:
            xs += list(h.prompt_logprobs)
        if h.verify is not None:
            xs += list(h.verify)
        if h.drafts is not None:
            xs.append(h.drafts)
        if h.hidden_states is not None:
            xs.append(h.hidden_states)
        return xs

    def fetch(self, h: StepHandle) -> StepOutput:
        """Wait for a dispatched step's results on the host."""
        out = h.sampled
        token_ids, logprobs = jax.device_get((out.token_ids, out.logprobs))
        res = StepOutput(token_ids=np.asarray(token_ids), logprobs=np.asarray(logprobs))
        if h.want_topk:
            ti, tl, rk = jax.device_get((out.topk_ids, out.topk_logprobs, out.ranks))
            res.topk_ids, res.topk_logprobs, res.ranks = map(np.asarray, (ti, tl, rk))
        if h.prompt_logprobs is not None:
            res.prompt_logprobs = tuple(map(np.asarray, jax.device_get(h.prompt_logprobs)))
        if h.verify is not None:
            res.spec_token_ids, res.num_emitted = map(np.asarray, jax.device_get(tuple(h.verify)))
        if h.drafts is not None:
            res.draft_ids = np.asarray(jax.device_get(h.drafts))
        if h.hidden_states is not None:
            res.hidden_states = np.asarray(jax.device_get(h.hidden_states))[:h.plan.num_tokens]
        return res

    def execute(self, plan: StepPlan) -> StepOutput:
        """Run the step and wait for it (``dispatch`` then ``fetch``)."""
        return self.fetch(self.dispatch(plan))

    @property
    def num_graphs(self) -> int:
        """One model graph and one prompt-logprobs graph per token bucket, two sampler layouts
        (compact, and full for penalties) per sequence bucket."""
        seqs = {seq_bucket(t, self.max_num_seqs) for t in self.ladder}
        return 2 * len(self.ladder) + 2 * len(seqs)

    # ---- warm-up (jaxserve.worker.warmup) ----------------------------------------------
    def warmup(self) -> float:
        """Compile and run every bucket on every core (nothing else runs meanwhile) and wait
        for all of them."""
        if self.enforce_eager:
            self._skip_warmup()
            return 0.0
        self.start_warmup(workers=max(1, min(4, os.cpu_count() or 1)))
        self._warmup.pool.wait_all()
        return self._warmup.seconds

    def start_warmup(self, workers: int | None = None, on_token_limit=None) -> None:
        """Compile the buckets ahead of time on a thread pool and return at once;
        ``on_token_limit(n)`` hears the largest compiled bucket as it grows (None at the end)."""
        if self.enforce_eager:
            self._skip_warmup()
        elif self._warmup is None:
            self._warmup = BucketWarmup(self, workers, on_token_limit).start()

    @property
    def warmed_up(self) -> bool:
        return self._warmup is not None and self._warmup.done

    @property
    def _compiles(self) -> CompilePool | None:
        return None if self._warmup is None else self._warmup.pool

    def _skip_warmup(self) -> None:
        logger.info("enforce_eager: no ahead-of-time warm-up; each of the token buckets %s "
                    "compiles on the first step that needs it, so the zero-compiles-after-"
                    "warm-up check is off", list(self.ladder))
        freeze_startup_heap()

    def _plan_ladder(self) -> tuple[int, ...]:
        return self.ladder if self._warmup is None else self._warmup.plan_ladder()

    def stop_warmup(self) -> None:
        """An engine that shuts down leaves no thread tracing or compiling behind it."""
        if self._warmup is not None:
            self._warmup.stop()

    def step_token_limit(self) -> int | None:
        """While buckets compile, the largest compiled token bucket (what the scheduler hears
        through ``on_token_limit``). None once every bucket is compiled."""
        return None if self._warmup is None else self._warmup.token_limit()

    def startup_progress(self) -> tuple[bool, int, int]:
        """(ready to serve, buckets compiled, buckets)."""
        if self.enforce_eager:  # ready at once: steps compile what they need
            return True, 0, len(self.ladder)
        if self._warmup is None:
            return False, 0, len(self.ladder)
        return self._warmup.progress()

    @staticmethod
    def trace_counter() -> _TraceCount:
        """This thread's count of traces of the step's jitted functions."""
        return _TRACES

    # ---- swap (preemption to host memory) ------------------------------------------------
    def _paged_layers(self) -> list[int]:
        return [i for i in range(len(self.kv_pages)) if i not in self.state_layers]

    def swap_out(self, page_ids: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Copy pages to host memory, one (k, v) pair of ``[Hkv, n, block, D]`` per paged
        layer (LinearState layers hold slots, not pages: ``swap_out_state``)."""
        idx = jnp.asarray(np.asarray(page_ids, dtype=np.int32))
        with self._pool_lock:
            return jax.device_get([tuple(a[:, idx] for a in self.kv_pages[i])
                                   for i in self._paged_layers()])

    def swap_in(self, page_ids: list[int], saved) -> None:
        idx = jnp.asarray(np.asarray(page_ids, dtype=np.int32))
        with self._pool_lock:
            layers = self._paged_layers()
            written = _write_pages([self.kv_pages[i] for i in layers], idx, saved)
            pool = list(self.kv_pages)
            for i, kv in zip(layers, written):
                pool[i] = kv
            self._set_pool(pool)

    def swap_out_state(self, slot: int) -> list[tuple[np.ndarray, ...]]:
        """Copy one request's recurrent state (every LinearState layer's arrays at ``slot``)
        to host memory."""
        with self._pool_lock:
            return jax.device_get([tuple(a[slot] for a in self.kv_pages[i])
                                   for i in self.state_layers])

    def swap_in_state(self, slot: int, saved) -> None:
        """Write a swapped request's state into its (new) ``slot``."""
        with self._pool_lock:
            written = _write_slot([self.kv_pages[i] for i in self.state_layers],
                                  jnp.int32(slot),
                                  [tuple(jnp.asarray(a) for a in arrs) for arrs in saved])
            pool = list(self.kv_pages)
            for i, arrs in zip(self.state_layers, written):
                pool[i] = arrs
            self._set_pool(pool)

    def fork(self, pages: list[tuple[int, int]], slots: list[tuple[int, int]]) -> None:
        """n > 1 siblings start from their first child's computed prompt: its pages and
        recurrent state copied into theirs, on the device, in step order."""
        src, dst = fork_pairs(pages, 0)  # page 0: the trash page
        trash_slot = self.kv_pages[self.state_layers[0]][0].shape[0] - 1 if self.state_layers \
            else 0
        ssrc, sdst = fork_pairs(slots, trash_slot)
        with self._pool_lock:
            self._set_pool(fork_copy(list(self.kv_pages), tuple(self._paged_layers()),
                                     tuple(self.state_layers), src, dst, ssrc, sdst))

    # ---- weights in place, sleep (jaxserve.worker.weight_update, jaxserve.worker.sleep) ----
    def param_names(self) -> list[str]:
        """The state path (HF name) of each param leaf, in leaf order."""
        names = getattr(self, "_param_names", None)
        if names is None:  # the state's structure never changes
            from jaxserve.worker.weight_update import state_names

            names = self._param_names = state_names(self.state)
        return names

    def set_params(self, leaves: list) -> None:
        """Swap every param leaf between steps. Each has its old leaf's shape, dtype and
        sharding (``weight_update.prepare_leaves``), so no step recompiles."""
        treedef = getattr(self, "_state_treedef", None)
        if treedef is None:
            treedef = self._state_treedef = jax.tree_util.tree_structure(self.state)
        with self._pool_lock:
            self._state_leaves = list(leaves)
            self.state = jax.tree_util.tree_unflatten(treedef, self._state_leaves)

    def _set_pool(self, pool) -> None:
        """Keep the step's input sharding (no recompile under tp): page pools split over KV
        heads, state pools over their channel/head axis."""
        if self.mesh is not None:
            kv = sharding.kv_pool_sharding(self.mesh)
            state = sharding.state_pool_sharding(self.mesh)
            pool = jax.device_put(pool, [state if i in self.state_layers else kv
                                         for i in range(len(pool))])
        self.kv_pages = pool


@jax.jit
def _write_slot(state_pools, slot, saved):
    return [tuple(a.at[slot].set(sa) for a, sa in zip(arrs, s)) for arrs, s in
            zip(state_pools, saved)]


@jax.jit
def _scatter_pages(kv_pages, idx, saved):
    return [tuple(a.at[:, idx].set(sa) for a, sa in zip(kv, s)) for kv, s in
            zip(kv_pages, saved)]


def _write_pages(kv_pages, idx, saved):
    saved = [tuple(jnp.asarray(a) for a in kv) for kv in saved]
    return _scatter_pages(kv_pages, idx, saved)
