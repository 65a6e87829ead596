"""Batched on-device sampling: a pure jnp function that runs inside the jitted step.

Order of operations follows vLLM V1's Sampler:
  1. raw logprobs (log_softmax of the model's logits, before anything below) — the logprobs we
     return, vLLM V1's default ``logprobs_mode="raw_logprobs"``;
  2. logit_bias, then min_tokens masking of the row's stop ids (EOS + stop_token_ids);
  3. repetition (prompt + output tokens), frequency and presence (output tokens) penalties;
  4. greedy rows (temperature < 1e-5) take the argmax here;
  5. random rows: temperature, min_p, top_k then top_p, then a Gumbel-max draw whose key is
     ``fold_in(fold_in(key(seed_lo), seed_hi), step)`` — a function of the row's own seed and its
     number of generated tokens only, so a seeded request samples the same tokens whatever batch
     it is in.

Everything data-dependent is an array in ``SamplingMetadata``: changing parameters never
recompiles. Costly parts sit behind ``lax.cond`` on "does any row need it" so the common
all-greedy step with no bias/min_tokens/penalty is a bare argmax plus a logsumexp (no [S, V]
copy): logit edits, penalties (scatter of the token history), random sampling (one Gumbel draw
per row), the full-vocabulary sort (only for top_k / top_p), and the top-k logprobs and ranks
(only when a row asked for logprobs).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxserve.core.sampling_params import DEFAULT_MAX_LOGPROBS, SAMPLING_EPS
from jaxserve.models import argmax, batch_invariant

_NEG_INF = float("-inf")


class SamplingMetadata(NamedTuple):
    """Per-row sampling controls, S = sequence bucket. Built on the host by
    ``jaxserve.core.sampling_metadata.build_sampling_arrays`` (same field names, numpy arrays)."""

    temperature: jax.Array  # [S] f32; < 1e-5 = greedy (padding rows are greedy)
    top_p: jax.Array  # [S] f32 in (0, 1]; 1 = off
    top_k: jax.Array  # [S] i32; 0 = off
    min_p: jax.Array  # [S] f32; 0 = off
    presence_penalty: jax.Array  # [S] f32; 0 = off
    frequency_penalty: jax.Array  # [S] f32; 0 = off
    repetition_penalty: jax.Array  # [S] f32; 1 = off
    seeds: jax.Array  # [S, 2] u32 (low, high 32 bits of the 64-bit seed; random for unseeded)
    steps: jax.Array  # [S] i32 tokens generated so far (folded into the row's key)
    num_logprobs: jax.Array  # [S] i32; -1 = no logprobs, else top-k count (<= K)
    mask_stop: jax.Array  # [S] bool; min_tokens not reached yet -> stop_ids get -inf
    stop_ids: jax.Array  # [S, E] i32, -1 padded: EOS + stop_token_ids
    bias_ids: jax.Array  # [S, B] i32, -1 padded: logit_bias keys
    bias_values: jax.Array  # [S, B] f32: logit_bias values (0 where padded)
    history: jax.Array  # [S, L] i32, -1 padded: prompt ids then output ids (penalty rows only)
    prompt_lens: jax.Array  # [S] i32: how many leading history entries are prompt

    @classmethod
    def from_dict(cls, arrays: dict) -> SamplingMetadata:
        return cls(**{f: jnp.asarray(arrays[f]) for f in cls._fields})


class SamplerOutput(NamedTuple):
    token_ids: jax.Array  # [S] i32
    logprobs: jax.Array  # [S] f32 raw logprob of the sampled token
    topk_ids: jax.Array  # [S, K] i32 (zeros unless some row asked for logprobs)
    topk_logprobs: jax.Array  # [S, K] f32
    ranks: jax.Array  # [S] i32, 1 = the most likely token (zeros unless logprobs asked)


def _rows(S: int) -> jax.Array:
    return jnp.arange(S, dtype=jnp.int32)[:, None]


def _oob(ids: jax.Array, valid: jax.Array, V: int) -> jax.Array:
    """Invalid entries point past the vocabulary so ``mode='drop'`` ignores them (a -1 would wrap)."""
    return jnp.where(valid & (ids >= 0) & (ids < V), ids, V)


def is_greedy(md: "SamplingMetadata") -> jax.Array:
    """[S] bool. The host decided (``SamplingParams.is_greedy``) and wrote temperature 0 for
    greedy rows; the device reads that one rule back."""
    return md.temperature < SAMPLING_EPS


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """Structured outputs: -inf for every token whose bit is 0 in ``bitmask [S, ceil(V/32)]``
    (int32, bit ``t % 32`` of word ``t // 32``). A row that allows nothing is left as it is
    (never a row of -inf: the host's matcher then sees the token and stops the request)."""
    V = logits.shape[-1]
    ids = jnp.arange(V, dtype=jnp.int32)
    words = bitmask[:, ids // 32]
    allowed = (jnp.right_shift(words, ids % 32) & 1).astype(jnp.bool_)
    allowed = allowed | ~jnp.any(allowed, axis=-1, keepdims=True)
    return jnp.where(allowed, logits, _NEG_INF)


def apply_logit_bias_and_min_tokens(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    S, V = logits.shape
    rows = _rows(S)
    logits = logits.at[rows, _oob(md.bias_ids, True, V)].add(md.bias_values, mode="drop")
    stop = _oob(md.stop_ids, md.mask_stop[:, None], V)
    return logits.at[rows, stop].set(_NEG_INF, mode="drop")


def apply_penalties(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """vLLM's formulas: repetition over prompt+output tokens (divide positive logits, multiply
    negative ones), then ``- frequency * count - presence * (count > 0)`` over output tokens."""
    S, V = logits.shape
    rows = _rows(S)
    pos = jnp.arange(md.history.shape[1], dtype=jnp.int32)[None, :]
    is_out = pos >= md.prompt_lens[:, None]
    counts = jnp.zeros((S, V), jnp.int32).at[rows, _oob(md.history, is_out, V)].add(
        1, mode="drop")
    seen = jnp.zeros((S, V), jnp.bool_).at[rows, _oob(md.history, True, V)].set(
        True, mode="drop")
    rep = jnp.where(seen, md.repetition_penalty[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = logits - md.frequency_penalty[:, None] * counts
    return logits - md.presence_penalty[:, None] * (counts > 0)


def apply_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Mask everything below each row's cutoff: top-k first, then top-p over what is left
    (vLLM's order). One descending sort of the vocabulary; ties at the cutoff are kept."""
    S, V = logits.shape
    desc = jnp.flip(jnp.sort(logits, axis=-1), axis=-1)
    k = jnp.where((top_k > 0) & (top_k < V), top_k, V)
    idx = jnp.arange(V, dtype=jnp.int32)[None, :]
    desc_k = jnp.where(idx < k[:, None], desc, _NEG_INF)
    probs = jax.nn.softmax(desc_k, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each token
    n_p = jnp.sum(before < top_p[:, None], axis=-1).astype(jnp.int32)
    n_keep = jnp.where(top_p < 1.0, jnp.clip(n_p, 1, k), k)
    cutoff = jnp.take_along_axis(desc, (n_keep - 1)[:, None], axis=-1)
    return jnp.where(logits < cutoff, _NEG_INF, logits)


def _row_keys(seeds: jax.Array, steps: jax.Array) -> jax.Array:
    def one(seed, step):
        key = jax.random.fold_in(jax.random.key(seed[0]), seed[1])
        return jax.random.fold_in(key, step)

    return jax.vmap(one)(seeds, steps)


def apply_processors(logits: jax.Array, processors, argmax_invariant: bool) -> jax.Array:
    """The custom jax logits processors of one kind (``core.logits_processor``), in order:
    ``processors`` holds ``(apply_jax, argmax invariant, state rows)``."""
    for fn, invariant, state in processors:
        if invariant == argmax_invariant:
            logits = fn(logits, state).astype(jnp.float32)
    return logits


def _random_sample(logits: jax.Array, md: SamplingMetadata, greedy_rows: jax.Array,
                   processors=()) -> jax.Array:
    S, V = logits.shape
    temp = jnp.where(greedy_rows, 1.0, md.temperature)
    x = logits / temp[:, None]
    x = apply_processors(x, processors, argmax_invariant=True)
    # min_p: drop tokens with prob < min_p * max prob, i.e. logit < max + log(min_p).
    floor = jnp.max(x, axis=-1, keepdims=True) + jnp.log(md.min_p)[:, None]
    x = jnp.where(x < floor, _NEG_INF, x)
    needs_sort = ~greedy_rows & (((md.top_k > 0) & (md.top_k < V)) | (md.top_p < 1.0))
    x = jax.lax.cond(jnp.any(needs_sort),
                     lambda x: apply_top_k_top_p(x, md.top_k, md.top_p), lambda x: x, x)
    keys = _row_keys(md.seeds, md.steps)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(keys)
    return argmax.argmax(x + gumbel)


def _log_softmax(x: jax.Array) -> jax.Array:
    return batch_invariant.log_softmax(x) if batch_invariant.enabled() else \
        jax.nn.log_softmax(x, axis=-1)


def _logprob_details(raw: jax.Array, token_ids: jax.Array, k: int):
    logprobs = _log_softmax(raw)
    tok_lp = jnp.take_along_axis(logprobs, token_ids[:, None], axis=-1)
    ranks = jnp.sum(logprobs >= tok_lp, axis=-1).astype(jnp.int32)
    topk_ids, topk_lp = _top_k_padded(logprobs, k)
    return topk_ids, topk_lp, ranks


def _top_k_padded(logprobs: jax.Array, k: int):
    """lax.top_k with k may exceed a (tiny test) vocabulary: pad with id 0 / -inf."""
    kk = min(k, logprobs.shape[-1])
    lp, ids = jax.lax.top_k(logprobs, kk)
    pad = [(0, 0)] * (lp.ndim - 1) + [(0, k - kk)]
    return (jnp.pad(ids.astype(jnp.int32), pad),
            jnp.pad(lp, pad, constant_values=_NEG_INF))


def sample(logits: jax.Array, md: SamplingMetadata,
           num_top_logprobs: int = DEFAULT_MAX_LOGPROBS,
           token_bitmask: jax.Array | None = None, processors=()) -> SamplerOutput:
    """Sample one token per row. ``logits`` [S, V] (any float dtype; computed in float32).
    ``num_top_logprobs`` is the static width K of the top-k logprobs (the engine's
    ``max_logprobs``, at most V).
    ``token_bitmask`` [S, ceil(V/32)] int32 (structured outputs) masks the logits before
    everything else, logprobs included (as vLLM applies it to the logits); all ones = off.
    ``processors``: custom jax logits processors ``(apply_jax, argmax invariant, state)``; the
    others edit the logits with logit_bias and min_tokens, the invariant ones random rows after
    the temperature (vLLM's order); the returned logprobs stay raw."""
    raw = logits.astype(jnp.float32)
    if token_bitmask is not None:
        raw = jax.lax.cond(jnp.any(token_bitmask != -1),
                           lambda r: apply_token_bitmask(r, token_bitmask), lambda r: r, raw)
    S, V = raw.shape
    lse = (batch_invariant.logsumexp(raw) if batch_invariant.enabled()
           else jax.nn.logsumexp(raw, axis=-1))

    greedy_rows = is_greedy(md)
    any_penalty = jnp.any((md.presence_penalty != 0.0) | (md.frequency_penalty != 0.0)
                          | (md.repetition_penalty != 1.0))
    any_edit = (any_penalty | jnp.any(md.bias_ids >= 0)
                | jnp.any(md.mask_stop[:, None] & (md.stop_ids >= 0))
                | any(not inv for _, inv, _ in processors))

    def processed(raw):
        x = apply_logit_bias_and_min_tokens(raw, md)
        x = apply_processors(x, processors, argmax_invariant=False)
        x = jax.lax.cond(any_penalty, lambda x: apply_penalties(x, md), lambda x: x, x)
        greedy = argmax.argmax(x)
        return jax.lax.cond(
            jnp.all(greedy_rows), lambda x: greedy,
            lambda x: jnp.where(greedy_rows, greedy,
                                _random_sample(x, md, greedy_rows, processors)), x)

    # The common step (all greedy, nothing to edit) is a bare argmax: no [S, V] copies.
    token_ids = jax.lax.cond(jnp.all(greedy_rows) & ~any_edit,
                             argmax.argmax, processed, raw)

    tok_lp = jnp.take_along_axis(raw, token_ids[:, None], axis=-1)[:, 0] - lse
    k = num_top_logprobs
    topk_ids, topk_lp, ranks = jax.lax.cond(
        jnp.any(md.num_logprobs >= 0),
        lambda r: _logprob_details(r, token_ids, k),
        lambda r: (jnp.zeros((S, k), jnp.int32), jnp.zeros((S, k), jnp.float32),
                   jnp.zeros((S,), jnp.int32)),
        raw)
    return SamplerOutput(token_ids, tok_lp, topk_ids, topk_lp, ranks)


def compute_prompt_logprobs(logits: jax.Array, next_token_ids: jax.Array,
                            k: int = DEFAULT_MAX_LOGPROBS):
    """For prompt_logprobs: logits [T, V] at prompt positions, next_token_ids [T] (the prompt
    token that follows each position). Returns (logprob of that token [T], top-k ids [T, k],
    top-k logprobs [T, k], rank of that token [T], 1 = most likely). Raw distribution."""
    raw = logits.astype(jnp.float32)
    logprobs = _log_softmax(raw)
    tok_lp = jnp.take_along_axis(logprobs, next_token_ids[:, None].astype(jnp.int32), axis=-1)
    ranks = jnp.sum(logprobs >= tok_lp, axis=-1).astype(jnp.int32)
    topk_ids, topk_lp = _top_k_padded(logprobs, k)
    return tok_lp[:, 0], topk_ids, topk_lp, ranks
