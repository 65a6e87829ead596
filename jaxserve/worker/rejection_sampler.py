"""Verifying speculative tokens on the device: keep what the target would have produced.

Pure jnp, inside the jitted step. A row with ``d`` drafts has target logits at ``d + 1``
positions. Greedy rows keep the longest prefix of drafts equal to the target's argmax, then the
target's own argmax at the first mismatch (or after the last draft: the bonus token). Random
rows use rejection sampling (Leviathan et al. 2023, Chen et al. 2023): draft ``x_j`` is kept
with probability ``min(1, p_j(x_j) / q_j(x_j))``; at the first rejection a token is drawn from
the normalised residual ``max(0, p_j - q_j)``, and after ``d`` acceptances from ``p_d``. The
emitted tokens are then distributed exactly as ``d + 1`` tokens sampled from the target one by
one. ``q`` is the draft distribution; a proposer without one (n-gram) is a point mass on its
token, which is the ``draft_probs=None`` case.

The target distribution ``p`` at each position is the sampler's own (logit_bias, temperature,
min_p, top_k, top_p), so a verified token and a plainly sampled one follow the same law.
Randomness is a function of the row's seed and its number of generated tokens, like the
sampler's, so seeded requests reproduce.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxserve.models import argmax
from jaxserve.worker.sampler import (SamplingMetadata, apply_logit_bias_and_min_tokens,
                                     apply_top_k_top_p, is_greedy)

_NEG_INF = float("-inf")
_UNIFORM_TAG, _RESAMPLE_TAG = 0x5EC1, 0x5EC2  # keep the verifier's draws apart from the sampler's


class VerifyOutput(NamedTuple):
    token_ids: jax.Array  # [S, k+1] i32: emitted tokens, -1 after the last
    num_emitted: jax.Array  # [S] i32: accepted drafts + 1


def rejection_sample(target_probs: jax.Array, draft_ids: jax.Array, num_draft: jax.Array,
                     uniforms: jax.Array, gumbel: jax.Array,
                     draft_probs: jax.Array | None = None) -> VerifyOutput:
    """The acceptance rule on probabilities.

    target_probs [S, k+1, V]; draft_ids [S, k]; num_draft [S] (0..k); uniforms [S, k] in
    [0, 1); gumbel [S, V] standard Gumbel noise for the one token drawn per row; draft_probs
    [S, k, V] or None (a point mass on each draft)."""
    S, K1, V = target_probs.shape
    k = K1 - 1
    rows = jnp.arange(S)
    j = jnp.arange(k, dtype=jnp.int32)[None, :]
    p_d = jnp.take_along_axis(target_probs[:, :k], draft_ids[..., None], axis=-1)[..., 0]
    if draft_probs is None:
        q_d = jnp.ones_like(p_d)
    else:
        q_d = jnp.take_along_axis(draft_probs, draft_ids[..., None], axis=-1)[..., 0]
    accept = (uniforms * q_d < p_d) & (j < num_draft[:, None])  # u < p/q, q > 0 for a draft
    a = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    p_a = target_probs[rows, a]  # [S, V]
    rejected = a < num_draft
    a_d = jnp.minimum(a, max(k - 1, 0))
    if k == 0:
        q_a = jnp.zeros_like(p_a)
    elif draft_probs is None:
        q_a = jax.nn.one_hot(draft_ids[rows, a_d], V, dtype=p_a.dtype)
    else:
        q_a = draft_probs[rows, a_d]
    resid = jnp.where(rejected[:, None], jnp.maximum(p_a - q_a, 0.0), p_a)
    resid = jnp.where(jnp.sum(resid, axis=-1, keepdims=True) > 0, resid, p_a)  # p == q: unreachable
    scores = jnp.where(resid > 0, jnp.log(jnp.maximum(resid, 1e-38)), _NEG_INF) + gumbel
    drawn = argmax.argmax(scores)
    return _emit(draft_ids, a, drawn)


def _emit(draft_ids: jax.Array, a: jax.Array, last: jax.Array) -> VerifyOutput:
    """Tokens ``draft[:a]`` then ``last``, -1 padded to ``k + 1``."""
    S, k = draft_ids.shape
    pos = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    padded = jnp.concatenate([draft_ids, jnp.zeros((S, 1), jnp.int32)], axis=1)
    toks = jnp.where(pos < a[:, None], padded, -1)
    toks = jnp.where(pos == a[:, None], last[:, None], toks)
    return VerifyOutput(toks.astype(jnp.int32), a + 1)


def greedy_verify(target_ids: jax.Array, draft_ids: jax.Array, num_draft: jax.Array
                  ) -> VerifyOutput:
    """target_ids [S, k+1] (the target's argmax at each position): longest matching prefix of
    the drafts, then the target's token at the first mismatch (or the bonus token)."""
    S, K1 = target_ids.shape
    k = K1 - 1
    j = jnp.arange(k, dtype=jnp.int32)[None, :]
    match = (draft_ids == target_ids[:, :k]) & (j < num_draft[:, None])
    a = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    return _emit(draft_ids, a, target_ids[jnp.arange(S), a])


def _keys(seeds: jax.Array, steps: jax.Array, tag: int) -> jax.Array:
    def one(seed, step):
        key = jax.random.fold_in(jax.random.key(seed[0]), seed[1])
        return jax.random.fold_in(jax.random.fold_in(key, step), tag)

    return jax.vmap(one)(seeds, steps)


class _PerPosition(NamedTuple):
    """The sampler fields ``apply_logit_bias_and_min_tokens`` reads, one row per position."""

    bias_ids: jax.Array
    bias_values: jax.Array
    stop_ids: jax.Array
    mask_stop: jax.Array


def target_logits(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """[S, k+1, V] raw logits -> [S*(k+1), V] with each row's logit_bias added (the edits that
    do not depend on the position's history; rows with penalties/min_tokens never draft)."""
    S, K1, V = logits.shape
    x = logits.astype(jnp.float32).reshape(S * K1, V)
    rep = lambda a: jnp.repeat(a, K1, axis=0)  # noqa: E731
    pp = _PerPosition(rep(md.bias_ids), rep(md.bias_values), rep(md.stop_ids),
                      jnp.zeros((S * K1,), jnp.bool_))
    return jax.lax.cond(jnp.any(md.bias_ids >= 0),
                        lambda x: apply_logit_bias_and_min_tokens(x, pp), lambda x: x, x)


def target_probs(x: jax.Array, md: SamplingMetadata, K1: int) -> jax.Array:
    """[S*(k+1), V] biased logits -> [S, k+1, V] the sampler's distribution at each position."""
    S = md.temperature.shape[0]
    V = x.shape[-1]
    rep = lambda a: jnp.repeat(a, K1, axis=0)  # noqa: E731
    greedy = rep(is_greedy(md))
    x = x / jnp.where(greedy, 1.0, rep(md.temperature))[:, None]
    floor = jnp.max(x, axis=-1, keepdims=True) + jnp.log(rep(md.min_p))[:, None]
    x = jnp.where(x < floor, _NEG_INF, x)
    top_k, top_p = rep(md.top_k), rep(md.top_p)
    needs_sort = ~greedy & (((top_k > 0) & (top_k < V)) | (top_p < 1.0))
    x = jax.lax.cond(jnp.any(needs_sort), lambda x: apply_top_k_top_p(x, top_k, top_p),
                     lambda x: x, x)
    return jax.nn.softmax(x, axis=-1).reshape(S, K1, V)


def verify(logits: jax.Array, md: SamplingMetadata, draft_ids: jax.Array, num_draft: jax.Array,
           first_token: jax.Array) -> VerifyOutput:
    """The step's verification. logits [S, k+1, V]; ``first_token`` [S] is what the plain
    sampler drew at column 0, which rows without drafts keep (all its features apply there)."""
    S, K1, V = logits.shape
    k = K1 - 1
    x = target_logits(logits, md)
    greedy_rows = is_greedy(md)
    greedy_ids = argmax.argmax(x).reshape(S, K1)
    out = greedy_verify(greedy_ids, draft_ids, num_draft)

    def random_rows(out):
        p = target_probs(x, md, K1)
        uk = _keys(md.seeds, md.steps, _UNIFORM_TAG)
        gk = _keys(md.seeds, md.steps, _RESAMPLE_TAG)
        u = jax.vmap(lambda key: jax.random.uniform(key, (k,), jnp.float32))(uk)
        g = jax.vmap(lambda key: jax.random.gumbel(key, (V,), jnp.float32))(gk)
        rs = rejection_sample(p, draft_ids, num_draft, u, g)
        return VerifyOutput(jnp.where(greedy_rows[:, None], out.token_ids, rs.token_ids),
                            jnp.where(greedy_rows, out.num_emitted, rs.num_emitted))

    out = jax.lax.cond(jnp.any(~greedy_rows & (num_draft > 0)), random_rows, lambda o: o, out)
    plain = num_draft == 0
    col0 = jnp.arange(K1)[None, :] == 0
    toks = jnp.where(plain[:, None], jnp.where(col0, first_token[:, None], -1), out.token_ids)
    return VerifyOutput(toks, jnp.where(plain, 1, out.num_emitted))
