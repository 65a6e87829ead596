"""The step's jitted device functions, pure and cached on the model graph: the model half
(``forward_fn``), the sampler half (``sample_fn``), prompt logprobs, the MTP head's drafts and
the recurrent state's rollback after verification.

Each takes its step inputs as one packed buffer (``worker.step_inputs``) and counts its traces in
``TRACES``: a trace is a compile, and a compile after warm-up is a bug the runner reports.
"""
from __future__ import annotations

import threading
from contextlib import nullcontext
from functools import lru_cache

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve import sharding
from jaxserve.core.sampling_metadata import SAMPLING_FIELDS
from jaxserve.core.sampling_params import DEFAULT_MAX_LOGPROBS
from jaxserve.core.step_plan import TRASH_PAGE
from jaxserve.models import batch_invariant
from jaxserve.models.contract import capture_hidden
from jaxserve.models.layers import AttentionMetadata
from jaxserve.models.lora import LoRABatch
from jaxserve.worker import forward_hooks, rejection_sampler
from jaxserve.worker import sampler as sampler_lib
from jaxserve.worker.step_inputs import SamplerInputs, StepInputs, unpack


class _TraceCount(threading.local):
    """Traces of the step's jitted functions (a trace is a compile), per thread: a runner
    traces in the thread that drives it, so another engine in another thread (an ``LLM`` next
    to a serving ``AsyncLLM``) never shows up in this runner's count."""

    n = 0


TRACES = _TraceCount()


@lru_cache(maxsize=None)
def forward_fn(graphdef, state_treedef, mesh=None, state_layers: tuple[int, ...] = (),
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
        TRACES.n += 1
        model = nnx.merge(graphdef, jax.tree_util.tree_unflatten(state_treedef, state_leaves))
        with batch_invariant.mode(invariant):
            return run_stage(model, kv_pages, unpack(buf, layout), lora, None, prev_tokens,
                             lo=0, hi=model.num_layers, first=True, last=True,
                             state_layers=state_layers, snapshots=snapshots, embeds=embeds,
                             mm=mm)

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


def run_stage(model, kv_pages, inputs: StepInputs, lora, x, prev_tokens, *, lo: int, hi: int,
              first: bool, last: bool, state_layers: tuple[int, ...] = (),
              snapshots: tuple[int, int] | None = None, embeds=None, mm=None):
    """Model layers ``[lo, hi)`` of one step, the one forward both programs trace: the single
    program is the one stage over every layer (``first`` and ``last``), a pipeline stage its
    range (``worker.stages``). ``kv_pages``: the range's caches (after them, passed through:
    the MTP head's); ``x``: the previous stage's hidden carry (the first stage embeds the
    step's tokens instead: placeholders read ``prev_tokens``, ``embeds`` are
    ``--enable-prompt-embeds``' ``[T, H]``); ``mm``: a vision-language step's
    ``StepImages`` (every stage reads its positions and ``kv_limit``; the first stage merges
    the image embeddings, later stages get them as None: ``stages.stage_images``);
    ``lora``: (scale, the range's per-layer adapter weights) or None; ``state_layers``: the LinearState layers among ``kv_pages``.

    Returns ``(x, caches, captured)``; the last stage ``(logits, caches, hidden, captured)``
    (logits of ``inputs.logits_indices``: ``[S, V]``, or ``[S, k+1, V]`` when verifying).
    ``captured``: ``[T, K, H]`` float32 of the hidden-state layers the rows ask for that this
    range produces, zeros elsewhere (None when the engine captures none:
    ``worker.forward_hooks``)."""
    T = inputs.token_ids.shape[0]
    md = attention_metadata(
        inputs, state_slots=trash_state_slots(inputs.state_slots, kv_pages, state_layers),
        snapshot_slots=(None if snapshots is None or not state_layers
                        else snapshot_slots(inputs.num_draft, *snapshots)))
    capture = (forward_hooks.token_layers(inputs.hidden_layers, inputs.query_start, T)
               if inputs.hidden_layers.shape[1] else None)  # return_hidden_states: K a token
    positions = inputs.positions
    if mm is not None:  # a vision-language model (worker.mm_step.EncoderRunner): per-token
        positions = mm.positions  # inputs every stage's layers read: M-RoPE positions,
        if mm.kv_limit is not None:  # and image tokens that see their whole image run
            md = md._replace(kv_limit=mm.kv_limit)
    if first:
        ref = inputs.prev_ref
        token_ids = jnp.where(ref >= 0, prev_tokens[jnp.maximum(ref, 0)], inputs.token_ids)
        with (forward_hooks.prompt_embeds(model, inputs.embed_mask, embeds)
              if embeds is not None else nullcontext()):
            if mm is None:
                x = model.embed(token_ids)
            else:  # the image embeddings at their placeholders
                x = model.embed_multimodal(token_ids, (mm.embeds, mm.rows))
    if lora is not None:  # (scale, the range's layers) -> indexed by model layer
        if not model.supports_lora:
            raise ValueError(f"{type(model).__name__} does not support LoRA adapters")
        scale, layers = lora
        lora = LoRABatch(inputs.lora_slots, scale, (None,) * lo + tuple(layers))
    out = model.run_layers(x, model.layer_inputs(positions, md, T), kv_pages[:hi - lo], md,
                           lora, lo, hi, capture=capture)
    x, caches = out[0], out[1] + list(kv_pages[hi - lo:])
    captured = out[2] if capture is not None else None
    if not last:
        return x, caches, captured  # the hidden carry (with PLE: and the per-layer inputs)
    hidden = model.final_hidden(x)
    if capture is not None:  # the last layer's output is read after the final norm
        captured = capture_hidden(captured, capture, model.num_layers, hidden)
    # hidden stays on device; only prompt_logprobs reads it (see prompt_logprobs_fn).
    # logits_indices is [S], or [S, k+1] with speculative decoding (every verified position)
    idx = inputs.logits_indices
    if idx.size > hidden.shape[0]:
        # more positions than tokens (the verify shapes of a small bucket: S rows of k+1,
        # mostly padding): the vocabulary projection runs once per token, then is gathered
        return model.compute_logits(hidden)[idx], caches, hidden, captured
    logits = model.compute_logits(hidden[idx.reshape(-1)])
    return logits.reshape(idx.shape + logits.shape[-1:]), caches, hidden, captured


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
def rollback_fn(base: int, k: int, mesh=None):
    """Speculative decoding's rollback of the recurrent state, after the verifier: a row that
    kept ``a < num_draft`` drafts copies its snapshot after token ``a`` (the last accepted
    one, :func:`snapshot_slots`) into its own slot, which the verify step left holding the
    state after every draft. Rows that kept all their drafts, and rows without, are untouched.
    Per-position snapshots rather than snapshot + recompute: k small copies per row in the
    verify step and one copy here, never a second forward. ``state_pools``: the LinearState
    layers' arrays (donated)."""

    def rollback(state_pools, slots, num_draft, num_emitted):
        TRACES.n += 1
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
def mtp_fn(graphdef, state_treedef, k: int, block_size: int, mesh=None, group: int = 0):
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

    ``mm`` (a vision-language step, as the forward gets it: positions, image row of each
    token, image embeddings): the head embeds token ``t + 1`` as the model does (its image
    embedding where it is an image token of this step) and rotates at the model's positions
    (M-RoPE); a row's later drafts are text at the row's last position plus ``j``.

    Returns (drafts ``[S, k]``, the head's pages)."""

    def propose(state_leaves, mtp_kv, buf, hidden, prev_tokens, emitted, num_emitted, layout,
                mm=None):
        TRACES.n += 1
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
        positions, nxt_mm = inputs.positions, None
        if mm is not None:  # StepImages: token t + 1's image row (a chunk's next prompt
            positions = mm.positions  # token's from next_rows; sampled tokens are text)
            at_src = jnp.where(inputs.next_token_ids >= 0, mm.next_rows, -1)
            nxt_rows = jnp.concatenate([mm.rows[1:], jnp.full((1,), -1, mm.rows.dtype)])
            nxt_rows = nxt_rows.at[jnp.where(real, src, T)].set(at_src, mode="drop")
            nxt_mm = (mm.embeds, nxt_rows)
        h, mtp_kv = model.mtp_forward(nxt, positions, hidden, mtp_kv,
                                      attention_metadata(inputs, group=group), mm=nxt_mm)
        h = h[src]
        draft = jnp.argmax(model.compute_logits(h), axis=-1).astype(jnp.int32)
        drafts = [draft]
        pos = inputs.positions[src]
        rot = positions[..., src]  # the rotary position of each row's last token
        bt = inputs.block_tables[group:group + 1]  # the head's pool's row
        max_pos = bt.shape[2] * block_size - 1
        for j in range(1, k):  # one position a row: the row's own single-token step
            p = jnp.minimum(pos + j, max_pos)
            page = bt[0, rows, p // block_size]
            one = inputs.replace(
                slot_mapping=jnp.where(real, page * block_size + p % block_size,
                                       TRASH_PAGE * block_size)[None],
                query_start=jnp.arange(S + 1, dtype=jnp.int32),
                seq_lens=jnp.where(real, p + 1, 1), block_tables=bt, num_seqs=jnp.int32(S))
            h, mtp_kv = model.mtp_forward(draft, p if mm is None else rot + j, h, mtp_kv,
                                          attention_metadata(one, group=0))
            draft = jnp.argmax(model.compute_logits(h), axis=-1).astype(jnp.int32)
            drafts.append(draft)
        return jnp.stack(drafts, axis=1), mtp_kv

    if mesh is None:
        return jax.jit(propose, donate_argnums=(1,), static_argnums=(7,))
    return jax.jit(propose, donate_argnums=(1,), static_argnums=(7,), out_shardings=(
        sharding.replicated(mesh), sharding.kv_pool_sharding(mesh)))


def trash_state_slots(slots, kv_pages, state_layers: tuple[int, ...]):
    """The plan's slots with -1 (no slot: padding and warm-up rows) sent to the trash slot,
    the last one of the state pool; None for a model without LinearState layers."""
    if not state_layers:
        return None
    trash = kv_pages[state_layers[0]][0].shape[0] - 1
    return jnp.where(slots < 0, trash, slots)


PROMPT_LOGPROBS_CHUNK = 256  # tokens per chunk: bounds the [chunk, V] logits in memory


@lru_cache(maxsize=None)
def prompt_logprobs_fn(graphdef, state_treedef, num_top_logprobs: int,
                        invariant: bool = False):
    """Logprobs of each prompt token under the step's hidden states (``prompt_logprobs``),
    with the top ``num_top_logprobs`` of each position.

    A separate jit per token bucket, run only in steps that carry such a request; logits are
    made ``PROMPT_LOGPROBS_CHUNK`` tokens at a time so a long bucket never holds ``[T, V]``.
    """

    def prompt_logprobs(state_leaves, hidden, next_ids):
        TRACES.n += 1
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
def sample_fn(mesh=None, num_top_logprobs: int = DEFAULT_MAX_LOGPROBS,
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
        TRACES.n += 1
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


def top_logprobs_width(max_logprobs: int, vocab_size: int) -> int:
    """The static top-k width of the sampler's logprobs: ``max_logprobs`` (-1: the vocabulary),
    at most the vocabulary, at least 1."""
    k = vocab_size if max_logprobs == -1 else min(max_logprobs, vocab_size)
    return max(1, k)
