"""Per-token visibility limits (``kv_limit``: runs of tokens that see each other, Gemma 4's
image tokens) in every attention kernel == the jnp reference, on random ragged batches with
random runs; the reference == a float64 numpy loop. Without a limit nothing changes (the
other kernel tests)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu_kernels, reference, xla_attention
from pallas_kernels.ragged_batch import make_ragged_batch, naive_attention, random_kv_limits

PAGE, MAX_PAGES, T, S, HQ, HKV, D = 4, 8, 32, 6, 4, 2, 16
# (q_lens, ctx_lens): prefill chunks with earlier context, whole prompts, decodes, mixed
ROWS = [([12, 1, 9, 1, 5], [20, 7, 9, 30, 17]), ([T - 2, 1], [T - 2, 11]),
        ([3, 4, 14, 2], [3, 31, 20, 2])]
OPTS = [dict(), dict(sliding_window=5), dict(sliding_window=3, soft_cap=4.0)]


def _batch(rows, seed, dtype=np.float32):
    q_lens, ctx = rows
    rng = np.random.default_rng(seed)
    b = make_ragged_batch(rng, q_lens, ctx, num_tokens=T, num_seqs=S, max_pages=MAX_PAGES,
                          num_pages=S * MAX_PAGES + 3, num_q_heads=HQ, num_kv_heads=HKV,
                          head_dim=D, page_size=PAGE, dtype=dtype)
    return b, random_kv_limits(rng, b)


def _args(b):
    args = [jnp.asarray(a) for a in b.args()]
    args[5] = args[5].at[b.num_seqs:].set(0)  # the reference reads every table row
    return args


@functools.lru_cache(maxsize=None)
def _ref(**kw):
    return jax.jit(functools.partial(reference.ragged_paged_attention, sm_scale=0.3, **kw))


def _rel(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(out))
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30))


# one compile per (options, loop choice; short_query 4: decodes on the per-token loop, longer
# rows on the per-sequence loop); the three batches share its shapes
CASES = [(dict(sliding_window=5, soft_cap=4.0), 4)]


@pytest.mark.parametrize("opts,short_query", CASES)
def test_reference_and_xla(opts, short_query):
    """The reference == numpy, and differs from causal exactly where a limit reaches ahead;
    the XLA kernel (per-sequence loop, per-token loop, or both) == the reference."""
    xla = jax.jit(functools.partial(xla_attention.attention, sm_scale=0.3,
                                    short_query=short_query, **opts))
    for seed, rows in enumerate(ROWS):
        b, lim = _batch(rows, seed)
        args = _args(b)
        out = _ref(**opts)(*args, kv_limit=jnp.asarray(lim))
        assert _rel(out, naive_attention(b, sm_scale=0.3, kv_limit=lim, **opts)) < 1e-5
        causal = _ref(**opts)(*args)
        ahead = np.nonzero(lim >= 0)[0]  # inside a run: only these may differ from causal
        same = np.setdiff1d(np.arange(T), ahead)
        assert np.allclose(np.asarray(out)[same], np.asarray(causal)[same])
        assert not np.allclose(np.asarray(out)[ahead], np.asarray(causal)[ahead])
        got = xla(*args, jnp.int32(b.num_seqs), kv_limit=jnp.asarray(lim))
        assert _rel(got, out) < 1e-5


@pytest.mark.skipif(not cpu_kernels.available(), reason="the C++ kernels are not built")
@pytest.mark.parametrize("page_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("opts", [CASES[0][0], dict()])
def test_cpu_kernel_matches_reference(opts, page_dtype):
    for seed, rows in enumerate(ROWS):
        b, lim = _batch(rows, seed)
        args = _args(b)
        args[1:3] = [a.astype(page_dtype) for a in args[1:3]]
        limit = jnp.asarray(lim)
        ref = _ref(**opts)(*args, kv_limit=limit)
        out = cpu_kernels.paged_attention(*args, jnp.int32(b.num_seqs), sm_scale=0.3,
                                          kv_limit=limit, **opts)
        assert _rel(out, ref) < 1e-5
        # the fused write: the step's K/V into its slots first, then the same attention
        rng = np.random.default_rng(seed)
        k_new = jnp.asarray(rng.standard_normal((T, HKV, D)), jnp.float32)
        slots = jnp.asarray(rng.permutation(args[1].shape[1] * PAGE)[:T], jnp.int32)
        kp, vp = reference.write_kv(args[1], args[2], k_new, -k_new, slots)
        ref = _ref(**opts)(args[0], kp, vp, *args[3:], kv_limit=limit)
        out, kp2, _ = cpu_kernels.write_and_attend(
            args[0], k_new, -k_new, args[1], args[2], slots, *args[3:], jnp.int32(b.num_seqs),
            sm_scale=0.3, kv_limit=limit, **opts)
        assert np.array_equal(np.asarray(kp2, np.float32), np.asarray(kp, np.float32))
        assert _rel(out, ref) < 1e-5


# Small tiles: several query blocks per prefill row, multi-step KV loops, split-KV decode with
# its combine kernel (which must count the same KV steps as the attention kernel).
SMALL_TILES = dict(prefill_block_m=16, prefill_block_kv=16, decode_block_kv=16,
                   decode_num_splits=3, decode_min_kv_per_split=16)


@pytest.mark.parametrize("opts", [dict(sliding_window=5)])
def test_pallas_interpret_matches_reference(opts):
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention

    for seed, rows in enumerate(ROWS):
        b, lim = _batch(rows, seed)
        args = _args(b)
        limit = jnp.asarray(lim)
        ref = _ref(**opts)(*args, kv_limit=limit)
        out = ragged_paged_attention(*args, jnp.int32(b.num_seqs), sm_scale=0.3, interpret=True,
                                     kv_limit=limit, **opts, **SMALL_TILES)
        assert _rel(out, ref) < 1e-5
