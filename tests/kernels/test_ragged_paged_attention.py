"""Pallas ragged paged attention == the jnp reference on random ragged batches.

CPU runs the kernel in interpret mode; the same checks run natively under ``-m gpu``. Shapes are
fixed per configuration (one compile each) and hypothesis varies the batch inside them: number
of sequences, context lengths (incl. 1 and exact page multiples), chunk sizes (decodes, short
spec-decode rows and prefill chunks mixed), pages scattered over the pool, padding rows.
Tolerance is relative to the output's largest magnitude: f32 1e-5, bf16 2e-2.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pallas_kernels import reference
from pallas_kernels.ragged_batch import make_ragged_batch, naive_attention
from pallas_kernels.ragged_paged_attention import default_tiles, ragged_paged_attention

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}

# Small tiles so the CPU shapes still cover multi-step KV loops, several query blocks per
# prefill row and split-KV decode with its combine step.
SMALL_TILES = dict(
    prefill_block_m=16, prefill_block_kv=16, decode_block_kv=16,
    decode_num_splits=3, decode_min_kv_per_split=16,
)


@functools.lru_cache(maxsize=None)
def _ref_fn(sm_scale, sliding_window, soft_cap):
    return jax.jit(functools.partial(
        reference.ragged_paged_attention, sm_scale=sm_scale, sliding_window=sliding_window,
        soft_cap=soft_cap,
    ))


def _rel_err(out, ref):
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    assert np.all(np.isfinite(out)), "kernel produced non-finite values"
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30))


@st.composite
def ragged_rows(draw, *, num_tokens, num_seqs, max_ctx, page_size):
    """(q_lens, ctx_lens) of a mixed step that fits the buckets."""
    n = draw(st.integers(1, num_seqs))
    ctx_choice = st.one_of(
        st.just(1),
        st.integers(1, max_ctx // page_size).map(lambda p: p * page_size),  # exact page multiple
        st.integers(1, max_ctx),
    )
    ctx = [draw(ctx_choice) for _ in range(n)]
    budget = num_tokens - n  # every row keeps >= 1 token
    q_lens = []
    for c in ctx:
        kind = draw(st.sampled_from(["decode", "short", "chunk", "whole"]))
        want = {"decode": 1, "short": min(c, 3), "chunk": draw(st.integers(1, c)), "whole": c}[kind]
        extra = min(want - 1, budget)
        budget -= extra
        q_lens.append(1 + extra)
    return q_lens, ctx


# (name, dtype, Hq, Hkv, D, page_size, options, tiles)
CONFIGS = [
    ("f32_gqa2_d64", jnp.float32, 4, 2, 64, 8, {}, SMALL_TILES),
    ("bf16_gqa4_d128", jnp.bfloat16, 8, 2, 128, 16, {}, SMALL_TILES),
    ("f32_mqa_d64_page32", jnp.float32, 4, 1, 64, 32, {}, SMALL_TILES),  # KV step < a page
    ("f32_gqa3_window_cap", jnp.float32, 6, 2, 64, 8, dict(sliding_window=13, soft_cap=5.0), SMALL_TILES),
    # Default tiles, but splits allowed down to one page so the run-time split choice is used.
    ("f32_mha_defaults", jnp.float32, 2, 2, 64, 16, {}, dict(decode_min_kv_per_split=16)),
    ("bf16_gqa2_d256_window", jnp.bfloat16, 4, 2, 256, 16, dict(sliding_window=20), SMALL_TILES),
    # float8 pages (--kv-cache-dtype fp8): read and upcast in the kernel, as the reference does
    ("bf16_gqa4_fp8e4m3_kv", jnp.bfloat16, 8, 2, 64, 16, dict(kv_dtype=jnp.float8_e4m3fn),
     SMALL_TILES),
    ("f32_gqa2_fp8e5m2_kv_window", jnp.float32, 4, 2, 64, 8,
     dict(kv_dtype=jnp.float8_e5m2, sliding_window=13), SMALL_TILES),
    # Gemma 4's global layers: head_dim 512, a wide GQA group, soft-capping, fp8 pages
    ("bf16_gqa4_d512_cap_fp8", jnp.bfloat16, 4, 1, 512, 8,
     dict(soft_cap=30.0, kv_dtype=jnp.float8_e4m3fn), SMALL_TILES),
]
NUM_TOKENS, NUM_SEQS, MAX_PAGES = 32, 6, 6


def _check_config(cfg, rows, seed, interpret, num_tokens=NUM_TOKENS, num_seqs=NUM_SEQS,
                  max_pages=MAX_PAGES):
    name, dtype, hq, hkv, d, page_size, opts, tiles = cfg
    q_lens, ctx = rows
    rng = np.random.default_rng(seed)
    batch = make_ragged_batch(
        rng, q_lens, ctx, num_tokens=num_tokens, num_seqs=num_seqs, max_pages=max_pages,
        num_pages=num_seqs * max_pages + 3, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
        page_size=page_size, dtype=dtype, padding_tables="random" if seed % 2 else "trash",
    )
    args = [jnp.asarray(a) for a in batch.args()]
    opts = dict(opts)
    kv_dtype = opts.pop("kv_dtype", None)
    if kv_dtype is not None:
        args[1], args[2] = (reference.to_page_dtype(a, kv_dtype) for a in args[1:3])
    sm_scale = d ** -0.5
    num_seqs_arg = jnp.int32(batch.num_seqs)
    out = ragged_paged_attention(*args, num_seqs_arg, sm_scale=sm_scale, interpret=interpret,
                                 **opts, **tiles)
    # The reference reads every block-table row, so give it the step plan's trash rows.
    ref_args = list(args)
    ref_args[5] = args[5].at[batch.num_seqs:].set(0)
    ref = _ref_fn(sm_scale, opts.get("sliding_window"), opts.get("soft_cap"))(*ref_args)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = _rel_err(out, ref)
    assert err <= TOL[dtype], f"{name}: rel err {err:.3g} > {TOL[dtype]} for q_lens={q_lens} ctx={ctx}"
    pad = np.asarray(out[batch.num_tokens:], np.float32)
    assert np.all(pad == 0), "padded tokens must come back as zeros"
    return err


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c[0] for c in CONFIGS])
@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_kernel_matches_reference_interpret(cfg, data):
    page_size = cfg[5]
    rows = data.draw(ragged_rows(num_tokens=NUM_TOKENS, num_seqs=NUM_SEQS,
                                 max_ctx=MAX_PAGES * page_size, page_size=page_size))
    seed = data.draw(st.integers(0, 2**16))
    _check_config(cfg, rows, seed, interpret=True)


def test_padding_rows_read_nothing():
    """Pages reachable only from padding rows (or past a row's last page) hold NaN; the output
    stays finite and exact, so none of them is read."""
    shape = dict(num_tokens=16, num_seqs=4, max_pages=4, num_pages=16, num_q_heads=4,
                 num_kv_heads=2, head_dim=64, page_size=16)
    batch = make_ragged_batch(np.random.default_rng(1), [1, 5], [9, 33], **shape)
    used = set(batch.block_tables[: batch.num_seqs].ravel().tolist()) - {0}
    poison = [p for p in range(1, 16) if p not in used]
    k, v = batch.k_pages.copy(), batch.v_pages.copy()
    k[:, poison] = np.nan
    v[:, poison] = np.nan
    bt = batch.block_tables.copy()
    bt[batch.num_seqs:] = poison[-1]
    for r in range(batch.num_seqs):  # entries past a row's last page point at poison too
        bt[r, -(-int(batch.seq_lens[r]) // 16):] = poison[0]
    args = [jnp.asarray(a) for a in (batch.q, k, v, batch.query_start, batch.seq_lens, bt)]
    ref = _ref_fn(0.125, None, None)(*[jnp.asarray(a) for a in batch.args()])
    # One page per KV step, so a step never reaches past the row's last page.
    out = ragged_paged_attention(*args, sm_scale=0.125, interpret=True,
                                 prefill_block_kv=16, decode_block_kv=16, prefill_block_m=16)
    assert _rel_err(out, ref) <= 1e-5


def test_reference_matches_naive_numpy():
    """The jnp reference itself against per-sequence float64 numpy attention."""
    rng = np.random.default_rng(7)
    for opts in ({}, dict(sliding_window=5), dict(soft_cap=2.0)):
        batch = make_ragged_batch(
            rng, [1, 6, 1, 9, 2], [1, 16, 17, 24, 8], num_tokens=24, num_seqs=7, max_pages=4,
            num_pages=24, num_q_heads=6, num_kv_heads=2, head_dim=16, page_size=8,
        )
        ref = _ref_fn(0.3, opts.get("sliding_window"), opts.get("soft_cap"))(
            *[jnp.asarray(a) for a in batch.args()])
        naive = naive_attention(batch, sm_scale=0.3, **opts)
        err = _rel_err(ref, naive)
        assert err <= 1e-5, (opts, err)


def test_bad_arguments_raise_value_error():
    q = jnp.zeros((8, 4, 64))
    kp = jnp.zeros((2, 8, 8, 64))
    meta = (jnp.zeros(3, jnp.int32), jnp.zeros(2, jnp.int32), jnp.zeros((2, 2), jnp.int32))
    with pytest.raises(ValueError, match="tile parameter"):
        ragged_paged_attention(q, kp, kp, *meta, sm_scale=1.0, block_size_typo=3)
    with pytest.raises(ValueError, match="prefill_block_kv"):
        ragged_paged_attention(q, kp, kp, *meta, sm_scale=1.0, prefill_block_kv=48)
    with pytest.raises(ValueError, match="num query heads"):
        ragged_paged_attention(jnp.zeros((8, 3, 64)), kp, kp, *meta, sm_scale=1.0)
    with pytest.raises(ValueError, match="sliding_window"):
        ragged_paged_attention(q, kp, kp, *meta, sm_scale=1.0, sliding_window=0)


def test_tile_config_defaults_fit_shared_memory():
    for d in (64, 128, 256, 512):  # 512: Gemma 4's global layers
        for dtype in (jnp.bfloat16, jnp.float32):
            cfg = default_tiles(d, dtype)
            item = jnp.dtype(dtype).itemsize
            for kv, stages in ((cfg.prefill_block_kv, cfg.prefill_num_stages),
                               (cfg.decode_block_kv, cfg.decode_num_stages)):
                assert 16 <= kv and 2 * kv * d * item * stages <= 96 * 1024, (d, dtype, cfg)


# ---- the same checks natively on a GPU (run by the lead with `-m gpu`) ----

def _gpu_available():
    try:
        return any(dev.platform == "gpu" for dev in jax.devices())
    except RuntimeError:
        return False


GPU_CONFIGS = [c for c in CONFIGS if c[0] != "f32_mha_defaults"] + [
    ("bf16_gqa4_d128_defaults", jnp.bfloat16, 32, 8, 128, 16, {}, {}),
    ("f32_gqa4_d128_defaults", jnp.float32, 8, 2, 128, 16, {}, {}),
    ("bf16_gqa8_d64_splits", jnp.bfloat16, 16, 2, 64, 16, {}, dict(decode_num_splits=4)),
]


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_available(), reason="needs a GPU backend")
@pytest.mark.parametrize("cfg", GPU_CONFIGS, ids=[c[0] for c in GPU_CONFIGS])
@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_kernel_matches_reference_gpu(cfg, data):
    page_size = cfg[5]
    num_tokens, num_seqs, max_pages = 256, 24, 40
    rows = data.draw(ragged_rows(num_tokens=num_tokens, num_seqs=num_seqs,
                                 max_ctx=max_pages * page_size, page_size=page_size))
    seed = data.draw(st.integers(0, 2**16))
    _check_config(cfg, rows, seed, interpret=False, num_tokens=num_tokens, num_seqs=num_seqs,
                  max_pages=max_pages)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_available(), reason="needs a GPU backend")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda v: v.__name__)
def test_long_contexts_gpu(dtype):
    """Benchmark-like heads with long contexts: split-KV decode (default, run-time splits) and a
    prefill chunk deep into its context, in one call."""
    q_lens, ctx = [1, 1, 1, 256, 1], [8192, 1, 5000, 4096, 2048]
    batch = make_ragged_batch(
        np.random.default_rng(3), q_lens, ctx, num_tokens=272, num_seqs=8, max_pages=512,
        num_pages=1300, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype=dtype,
    )
    args = [jnp.asarray(a) for a in batch.args()]
    out = ragged_paged_attention(*args, jnp.int32(batch.num_seqs), sm_scale=128 ** -0.5)
    ref = _ref_fn(128 ** -0.5, None, None)(*args)
    assert _rel_err(out, ref) <= TOL[dtype]


# ---- per-call cost outside the kernels (issue 11: a fixed ~0.4 ms per call on the H100) ----

def _cuda_export_text(fn, *specs):
    import importlib.util

    from jax import export

    if not any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin")):
        pytest.skip("jax CUDA plugin not installed")
    triton = "__gpu$xla.gpu.triton"
    return export.export(
        jax.jit(fn), platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(triton)],
    )(*specs).mlir_module()


@pytest.mark.parametrize("ctx,tokens", [(512, 64), (8192, 64), (2048, 512)],
                         ids=["decode_ctx512", "decode_ctx8192_split", "mixed"])
def test_call_is_only_the_kernels(ctx, tokens):
    """At the benchmark's shape (B 64, 32/8 heads, D 128, page 16, bf16) a call lowers to the
    Triton kernels, one zero fill and free reshapes: no while loops (searchsorted), gathers,
    transposes or other XLA ops that each cost a launch on every layer of every step."""
    import re

    sds = jax.ShapeDtypeStruct
    b, mp = 64, ctx // 16
    specs = (sds((tokens, 32, 128), jnp.bfloat16), sds((8, 1 + b * mp, 16, 128), jnp.bfloat16),
             sds((8, 1 + b * mp, 16, 128), jnp.bfloat16), sds((b + 1,), jnp.int32),
             sds((b,), jnp.int32), sds((b, mp), jnp.int32), sds((), jnp.int32))
    fn = functools.partial(ragged_paged_attention, sm_scale=0.1)
    text = _cuda_export_text(fn, *specs)
    ops = set(re.findall(r'"?(stablehlo\.[a-z_]+)', text))
    allowed = {"stablehlo.custom_call", "stablehlo.reshape", "stablehlo.broadcast_in_dim",
               "stablehlo.constant", "stablehlo.output_operand_alias", "stablehlo.convert"}
    assert ops <= allowed, f"XLA ops around the kernels: {sorted(ops - allowed)}"
    n_calls = text.count("__gpu$xla.gpu.triton")
    assert 1 <= n_calls <= 3, n_calls
    assert text.count("stablehlo.broadcast_in_dim") <= 1  # the zero fill


def test_decode_only_bucket_launches_no_prefill_call():
    """When no row can be longer than a decode block (T <= block_q), the prefill call is not
    built at all; the result is still exact."""
    batch = make_ragged_batch(np.random.default_rng(5), [1, 1, 1], [7, 16, 30], num_tokens=4,
                              num_seqs=4, max_pages=4, num_pages=16, num_q_heads=8,
                              num_kv_heads=2, head_dim=64, page_size=8)
    args = [jnp.asarray(a) for a in batch.args()]
    fn = functools.partial(ragged_paged_attention, sm_scale=0.125, interpret=True, **SMALL_TILES)
    jaxpr = str(jax.make_jaxpr(fn)(*args, jnp.int32(3)))
    assert "rpa_decode" in jaxpr and "rpa_prefill" not in jaxpr
    ref = _ref_fn(0.125, None, None)(*args)
    assert _rel_err(fn(*args, jnp.int32(3)), ref) <= 1e-5


def test_split_prefill_combines_into_the_output():
    """prefill_num_splits > 1 sends prefill blocks through the combine kernel too."""
    cfg = ("f32_gqa3_split_prefill", jnp.float32, 6, 2, 64, 8, dict(sliding_window=19),
           dict(SMALL_TILES, prefill_num_splits=2))
    _check_config(cfg, ([1, 17, 2, 9], [40, 48, 2, 30]), seed=3, interpret=True)
