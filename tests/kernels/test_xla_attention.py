"""The XLA (CPU serving) attention equals the jnp reference on random ragged paged batches."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pallas_kernels import reference, xla_attention

PAGE, M, D, HKV = 4, 8, 16, 2  # max context M * PAGE = 32


def make_batch(rng, q_lens, ctx_lens, t_bucket, s_bucket, groups, dtype):
    n_pages = 1 + sum(-(-c // PAGE) for c in ctx_lens) + 3  # a few unused pages, page 0 trash
    kp = jnp.asarray(rng.standard_normal((HKV, n_pages, PAGE, D)), dtype)
    vp = jnp.asarray(rng.standard_normal((HKV, n_pages, PAGE, D)), dtype)
    q = jnp.asarray(rng.standard_normal((t_bucket, HKV * groups, D)), dtype)
    qs = np.zeros(s_bucket + 1, np.int32)
    qs[1:len(q_lens) + 1] = np.cumsum(q_lens)
    qs[len(q_lens) + 1:] = sum(q_lens)
    sl = np.zeros(s_bucket, np.int32)
    sl[:len(ctx_lens)] = ctx_lens
    bt = np.zeros((s_bucket, M), np.int32)
    free = list(rng.permutation(np.arange(1, n_pages)))
    for i, c in enumerate(ctx_lens):
        n = -(-c // PAGE)
        bt[i, :n] = [free.pop() for _ in range(n)]
        bt[i, n:] = rng.integers(0, n_pages, M - n)  # stale entries past the context: ignored
    return q, kp, vp, jnp.asarray(qs), jnp.asarray(sl), jnp.asarray(bt)


@functools.lru_cache(maxsize=None)
def _jitted(fn_name, **kw):
    if fn_name == "reference":
        return jax.jit(functools.partial(reference.ragged_paged_attention, **kw))
    return jax.jit(functools.partial(xla_attention.attention, **kw))


@st.composite
def ragged_batches(draw):
    # Few distinct shapes (each one compiles); the ragged contents vary freely.
    t_bucket = draw(st.sampled_from([16, 32]))
    s_bucket = 8
    n = draw(st.integers(1, s_bucket))
    q_lens, ctx_lens, budget = [], [], t_bucket
    for i in range(n):
        left = n - i - 1
        ql = draw(st.integers(1, max(1, min(budget - left, 20))))
        ctx = draw(st.integers(ql, M * PAGE))
        q_lens.append(ql)
        ctx_lens.append(ctx)
        budget -= ql
    return t_bucket, s_bucket, q_lens, ctx_lens


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=ragged_batches(),
    groups=st.sampled_from([1, 3]),
    dtype=st.sampled_from(["float32", "bfloat16"]),
    window_cap=st.sampled_from([(None, None), (5, None), (None, 7.0), (6, 5.0)]),
    short_query=st.sampled_from([0, 4, 10**6]),  # every row per sequence / mixed / per token
    pass_num_seqs=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_reference(batch, groups, dtype, window_cap, short_query, pass_num_seqs, seed):
    sliding_window, soft_cap = window_cap
    t_bucket, s_bucket, q_lens, ctx_lens = batch
    rng = np.random.default_rng(seed)
    dt = jnp.dtype(dtype)
    q, kp, vp, qs, sl, bt = make_batch(rng, q_lens, ctx_lens, t_bucket, s_bucket, groups, dt)
    num_seqs = jnp.int32(len(q_lens)) if pass_num_seqs else None
    kw = dict(sm_scale=0.25, sliding_window=sliding_window, soft_cap=soft_cap)
    ref = _jitted("reference", **kw)(q, kp, vp, qs, sl, bt)
    out = _jitted("xla", short_query=short_query, **kw)(q, kp, vp, qs, sl, bt, num_seqs)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    tol = 1e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=tol, rtol=tol)
    n_tok = sum(q_lens)
    assert not np.any(np.asarray(out[n_tok:], np.float32))  # padded tokens are zeros


def test_public_function_is_a_drop_in():
    """Same call as the reference (positional num_seqs, keyword-only knobs), same answer."""
    rng = np.random.default_rng(0)
    args = make_batch(rng, [5, 1, 1, 9], [20, 7, 32, 9], 16, 8, 2, jnp.float32)
    for num_seqs in (None, 4):
        ref = reference.ragged_paged_attention(*args, num_seqs, sm_scale=0.3, sliding_window=6)
        out = xla_attention.ragged_paged_attention(*args, num_seqs, sm_scale=0.3,
                                                   sliding_window=6)
        np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_serving_shapes_match_reference():
    """SmolLM2-like shapes: 9 query / 3 KV heads, head_dim 64, page 16, mixed decode + prefill."""
    rng = np.random.default_rng(1)
    hkv, g, d, page, m = 3, 3, 64, 16, 16
    q_lens, ctx = [1] * 5 + [60], [200, 17, 256, 90, 1, 60]
    n_pages = 1 + sum(-(-c // page) for c in ctx)
    kp = jnp.asarray(rng.standard_normal((hkv, n_pages, page, d)), jnp.float32)
    vp = jnp.asarray(rng.standard_normal((hkv, n_pages, page, d)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((128, hkv * g, d)), jnp.float32)
    qs = np.zeros(9, np.int32)
    qs[1:7] = np.cumsum(q_lens)
    qs[7:] = sum(q_lens)
    sl = np.zeros(8, np.int32)
    sl[:6] = ctx
    bt = np.zeros((8, m), np.int32)
    perm, k = rng.permutation(np.arange(1, n_pages)), 0
    for i, c in enumerate(ctx):
        n = -(-c // page)
        bt[i, :n] = perm[k:k + n]
        k += n
    args = (q, kp, vp, jnp.asarray(qs), jnp.asarray(sl), jnp.asarray(bt), jnp.int32(6))
    ref = reference.ragged_paged_attention(*args, sm_scale=0.125)
    out = jax.jit(functools.partial(xla_attention.ragged_paged_attention, sm_scale=0.125))(*args)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
