"""The Pallas Mosaic GPU ragged paged attention: CUDA lowering on CPU, numerics on a GPU.

`jax.export(..., platforms=["cuda"])` runs the whole Pallas -> Mosaic GPU lowering (WGMMA
operand shapes and layouts, TMA transfer sizes, the shared-memory budget) and emits one
``mosaic_gpu_v2`` custom call; it needs the CUDA plugin of the installed jaxlib and skips
without it. What it cannot check: PTX compilation and the numbers, which only a Hopper GPU
gives — ``test_mosaic_matches_reference_gpu`` (``-m gpu``) compares against the reference.
"""
from __future__ import annotations

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels import reference
from pallas_kernels.mosaic_gpu_attention import (
    MosaicTileConfig,
    _block_metadata,
    call_grid,
    ragged_paged_attention,
)
from pallas_kernels.ragged_batch import make_ragged_batch

_HAS_PLUGIN = any(
    importlib.util.find_spec(m) is not None for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
needs_plugin = pytest.mark.skipif(not _HAS_PLUGIN, reason="jax CUDA plugin not installed")
MOSAIC = "mosaic_gpu_v2"


def _specs(*, tokens, seqs, ctx, hq=32, hkv=8, d=128, page_size=16, dtype=jnp.bfloat16,
           kv_dtype=None):
    sds = jax.ShapeDtypeStruct
    mp = -(-ctx // page_size)
    pool = (hkv, 1 + seqs * mp, page_size, d)
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    return (sds((tokens, hq, d), dtype), sds(pool, kv_dtype), sds(pool, kv_dtype),
            sds((seqs + 1,), jnp.int32), sds((seqs,), jnp.int32), sds((seqs, mp), jnp.int32),
            sds((), jnp.int32))


def _lower(opts=None, scaled=False, **shape):
    """``scaled``: float8 pages' ``kv_scale [Hkv, 2]`` as one more argument."""
    fn = functools.partial(ragged_paged_attention, sm_scale=0.1, **(opts or {}))
    specs = _specs(**shape)
    if scaled:
        specs += (jax.ShapeDtypeStruct((specs[1].shape[0], 2), jnp.float32),)
        fn = (lambda f: lambda *a: f(*a[:-1], kv_scale=a[-1]))(fn)
    return export.export(jax.jit(fn), platforms=["cuda"])(*specs).mlir_module()


# benchmarks/kernels.py's shapes: B 64 decodes, 32/8 heads, D 128, page 16, bf16; the mixed
# case (4 chunks of 512 at ctx 2048 + 32 decodes) in one call.
BENCH = {
    "decode_ctx512": dict(tokens=64, seqs=64, ctx=512),
    "decode_ctx2048": dict(tokens=64, seqs=64, ctx=2048),
    "decode_ctx8192": dict(tokens=64, seqs=64, ctx=8192),
    "mixed_4x512_32dec": dict(tokens=4 * 512 + 32, seqs=36, ctx=2048),
}


@needs_plugin
@pytest.mark.parametrize("name", list(BENCH))
def test_mosaic_lowers_at_benchmark_shapes(name):
    text = _lower(**BENCH[name])
    assert text.count(MOSAIC) == 1
    assert "rpa_mosaic" in text


@needs_plugin
@pytest.mark.parametrize("name", list(BENCH))
def test_mosaic_lowers_fp8_pages_at_benchmark_shapes(name):
    """--kv-cache-dtype fp8: float8 TMA stages, upcast in registers into the WGMMA's bf16 tiles,
    with the K/V scales; one Mosaic GPU kernel as with bf16 pages."""
    text = _lower(scaled=True, kv_dtype=jnp.float8_e4m3fn, **BENCH[name])
    assert text.count(MOSAIC) == 1
    assert "rpa_mosaic" in text


@needs_plugin
@pytest.mark.parametrize("tokens,hq", [(99, 8), (49, 14), (3, 32)])
def test_mosaic_lowers_any_row_count(tokens, hq):
    """Rows (tokens x group) that are not a multiple of TMA's 8-row tiling (396 on the H200
    failed to lower under jax 0.11.2): the query rows are padded, so every count lowers."""
    assert _lower(tokens=tokens, seqs=5, ctx=300, hq=hq, hkv=2).count(MOSAIC) == 1


@needs_plugin
def test_mosaic_lowers_fp8_e5m2_f16_window_softcap_d64():
    shape = dict(tokens=48, seqs=12, ctx=320, hq=14, hkv=2, d=64, dtype=jnp.float16,
                 kv_dtype=jnp.float8_e5m2)
    assert _lower(dict(sliding_window=100, soft_cap=30.0), **shape).count(MOSAIC) == 1


@needs_plugin
@pytest.mark.parametrize("semantics", ["Lane", "Warpgroup"])
def test_mosaic_lowering_does_not_follow_the_default_semantics(monkeypatch, semantics):
    """The body is lane-semantics code; jax 0.11 changed ``CompilerParams``'s default to
    warpgroup semantics, under which it fails layout inference (an AssertionError on 0.11.2,
    a ValueError on 0.10.2). Whatever the installed default, the kernel names its own."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    sem = getattr(plgpu.LoweringSemantics, semantics)
    monkeypatch.setattr(plgpu, "CompilerParams",
                        functools.partial(plgpu.CompilerParams, lowering_semantics=sem))
    jax.clear_caches()
    try:
        assert _lower(tokens=24, seqs=3, ctx=96).count(MOSAIC) == 1
    finally:
        jax.clear_caches()


def test_mosaic_fp8_stages_fit_shared_memory():
    """float8 stages take half the bytes, plus two upcast tiles: more stages fit at D 128."""
    from pallas_kernels import mosaic_gpu_attention as mga

    cfg = mga.MosaicTileConfig(block_kv=64, num_stages=8)
    assert mga.fit_stages(cfg, 128, 2, 32, kv_itemsize=1) > mga.fit_stages(cfg, 128, 2, 32)


@needs_plugin
@pytest.mark.parametrize("shape,opts", [
    (dict(tokens=64, seqs=16, ctx=512, dtype=jnp.float16), dict(sliding_window=128,
                                                                soft_cap=30.0)),
    (dict(tokens=48, seqs=12, ctx=320, hq=14, hkv=2, d=64), {}),  # group 7, odd page count
    (dict(tokens=64, seqs=16, ctx=1024, d=256, page_size=32), {}),  # stages cut to fit smem
    (dict(tokens=64, seqs=16, ctx=1024, hkv=1, page_size=64), dict(block_kv=128, num_splits=4)),
    (dict(tokens=16, seqs=4, ctx=64, hq=8, hkv=8, page_size=8), dict(num_stages=1)),  # MHA
], ids=["f16_window_softcap", "gqa7_d64", "d256_page32", "mqa_kv128_page64", "mha_page8"])
def test_mosaic_lowers_options(shape, opts):
    assert _lower(opts, **shape).count(MOSAIC) == 1


@needs_plugin
def test_mosaic_lowering_rejects_what_a_gpu_rejects():
    """The harness is live: a KV stage that overflows shared memory fails to lower."""
    from pallas_kernels import mosaic_gpu_attention as mga

    with pytest.raises(ValueError, match="shared memory"):
        mga.fit_stages(mga.MosaicTileConfig(block_kv=1024), 256, 2, 32)
    with pytest.raises(ValueError, match="block_kv"):
        _lower(dict(block_kv=96), tokens=16, seqs=4, ctx=64)


def test_mosaic_rejects_bad_arguments():
    q = jnp.zeros((8, 4, 64), jnp.float32)
    kp = jnp.zeros((2, 8, 8, 64), jnp.float32)
    meta = (jnp.zeros(3, jnp.int32), jnp.zeros(2, jnp.int32), jnp.zeros((2, 2), jnp.int32))
    with pytest.raises(ValueError, match="bfloat16/float16"):
        ragged_paged_attention(q, kp, kp, *meta, sm_scale=1.0)
    with pytest.raises(ValueError, match="float8"):  # f32 pages under bf16 queries
        ragged_paged_attention(q.astype(jnp.bfloat16), kp, kp, *meta, sm_scale=1.0)
    with pytest.raises(ValueError, match="head_dim"):
        ragged_paged_attention(jnp.zeros((8, 4, 32), jnp.bfloat16),
                               jnp.zeros((2, 8, 8, 32), jnp.bfloat16),
                               jnp.zeros((2, 8, 8, 32), jnp.bfloat16), *meta, sm_scale=1.0)
    with pytest.raises(ValueError, match="tile parameter"):
        ragged_paged_attention(q.astype(jnp.bfloat16), kp.astype(jnp.bfloat16),
                               kp.astype(jnp.bfloat16), *meta, sm_scale=1.0, blok_kv=64)


def test_mosaic_block_metadata_covers_every_row_once():
    """The 64-row blocks the kernel runs cover each real (token, head) row of a KV head exactly
    once, with the right sequence and positions (brute force over a ragged batch, group 7)."""
    group, q_lens, ctx = 7, [1, 20, 3, 1, 10], [5, 40, 3, 9, 10]
    batch = make_ragged_batch(np.random.default_rng(0), q_lens, ctx, num_tokens=40, num_seqs=7,
                              max_pages=8, num_pages=40, num_q_heads=14, num_kv_heads=2,
                              head_dim=64, page_size=8, fill=False)
    nb, _, _ = call_grid(40, 14, 2, 7, 8, 8, MosaicTileConfig())
    meta, first = _block_metadata(jnp.asarray(batch.query_start), jnp.asarray(batch.seq_lens),
                                  jnp.int32(batch.num_seqs), group, nb)
    meta = np.asarray(meta)
    seen = {}
    for b in range(nb):
        seq, row0, r_rel, rows, pos0 = meta[b, :5]
        for i in range(rows):
            tok = (row0 + i) // group
            assert (row0 + i) not in seen
            seen[row0 + i] = (seq, pos0 + (r_rel + i) // group)
            assert batch.query_start[seq] <= tok < batch.query_start[seq + 1]
    want = {}
    for s, (ql, c) in enumerate(zip(q_lens, ctx)):
        for j in range(ql):
            tok = batch.query_start[s] + j
            for g in range(group):
                want[tok * group + g] = (s, c - ql + j)
    assert seen == want
    assert list(np.asarray(first)[:5]) == list(np.cumsum([0] + [-(-q * group // 64)
                                                               for q in q_lens])[:5])


# ---- numerics on a Hopper GPU (run with `-m gpu`) ----

def _hopper():
    try:
        return any(d.platform == "gpu" and ("H100" in d.device_kind or "H200" in d.device_kind)
                   for d in jax.devices())
    except RuntimeError:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (H100/H200)")
@pytest.mark.parametrize("case", [
    dict(q_lens=[1, 17, 2, 9, 1, 64], ctx=[40, 48, 2, 30, 1, 300], hq=8, hkv=2, d=128, ps=16),
    dict(q_lens=[1] * 6 + [100], ctx=[700, 1, 5000, 16, 17, 2048, 4096], hq=32, hkv=8, d=128,
         ps=16),
    dict(q_lens=[3, 1, 40], ctx=[90, 33, 200], hq=14, hkv=2, d=64, ps=8,
         opts=dict(sliding_window=37, soft_cap=20.0)),
    dict(q_lens=[1, 1, 30], ctx=[1000, 64, 500], hq=16, hkv=2, d=256, ps=32,
         opts=dict(num_splits=4, min_kv_per_split=64)),
], ids=["mixed_gqa4", "long_ctx_splits", "gqa7_window_cap", "d256_forced_splits"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda v: v.__name__)
def test_mosaic_matches_reference_gpu(case, dtype):
    q_lens, ctx = case["q_lens"], case["ctx"]
    ps = case["ps"]
    mp = -(-max(ctx) // ps)
    batch = make_ragged_batch(np.random.default_rng(0), q_lens, ctx,
                              num_tokens=sum(q_lens) + 5, num_seqs=len(q_lens) + 2,
                              max_pages=mp, num_pages=(len(q_lens) + 2) * mp + 1,
                              num_q_heads=case["hq"], num_kv_heads=case["hkv"],
                              head_dim=case["d"], page_size=ps, dtype=dtype)
    args = [jnp.asarray(a) for a in batch.args()]
    opts = case.get("opts", {})
    ref_opts = {k: v for k, v in opts.items() if k in ("sliding_window", "soft_cap")}
    out = ragged_paged_attention(*args, jnp.int32(batch.num_seqs), sm_scale=case["d"] ** -0.5,
                                 **opts)
    ref = reference.ragged_paged_attention(*args, sm_scale=case["d"] ** -0.5, **ref_opts)
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(out))
    assert np.max(np.abs(out - ref)) / np.max(np.abs(ref)) <= 2e-2
    assert np.all(out[batch.num_tokens:] == 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (H100/H200)")
@pytest.mark.parametrize("kv_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2],
                         ids=lambda v: v.__name__)
def test_mosaic_fp8_pages_with_scales_match_reference_gpu(kv_dtype):
    """float8 pages holding K/V / scale (per KV head), read by the Mosaic kernel == the
    reference on the same pages and scales."""
    q_lens, ctx, hq, hkv, d, ps = [1, 17, 2, 9, 1, 64, 1], [40, 48, 2, 30, 1, 300, 3000], 8, 2, \
        128, 16
    mp = -(-max(ctx) // ps)
    batch = make_ragged_batch(np.random.default_rng(1), q_lens, ctx,
                              num_tokens=sum(q_lens) + 5, num_seqs=len(q_lens) + 2,
                              max_pages=mp, num_pages=(len(q_lens) + 2) * mp + 1,
                              num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=ps,
                              dtype=jnp.bfloat16)
    args = [jnp.asarray(a) for a in batch.args()]
    kv_scale = jnp.asarray([[0.5, 2.0], [3.0, 0.25]], jnp.float32)
    args[1] = reference.to_page_dtype(args[1] * 100.0, kv_dtype, kv_scale[:, 0, None, None, None])
    args[2] = reference.to_page_dtype(args[2] * 100.0, kv_dtype, kv_scale[:, 1, None, None, None])
    args[0] = args[0] * 0.01
    out = ragged_paged_attention(*args, jnp.int32(batch.num_seqs), sm_scale=d ** -0.5,
                                 kv_scale=kv_scale)
    ref = reference.ragged_paged_attention(*args, sm_scale=d ** -0.5, kv_scale=kv_scale)
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(out))
    assert np.max(np.abs(out - ref)) / np.max(np.abs(ref)) <= 2e-2
    assert np.all(out[batch.num_tokens:] == 0)


# ---- visibility limits (kv_limit: runs of tokens that see each other, Gemma 4's images) ----

@needs_plugin
@pytest.mark.parametrize("opts", [dict(sliding_window=37, soft_cap=20.0)])
def test_mosaic_lowers_with_kv_limit(opts):
    fn = functools.partial(ragged_paged_attention, sm_scale=0.1, **opts)
    specs = _specs(tokens=96, seqs=8, ctx=512, hq=8, hkv=2)
    fn = (lambda f: lambda *a: f(*a[:-1], kv_limit=a[-1]))(fn)
    specs += (jax.ShapeDtypeStruct((96,), jnp.int32),)
    text = export.export(jax.jit(fn), platforms=["cuda"])(*specs).mlir_module()
    assert MOSAIC in text


def test_mosaic_row_limits_are_each_rows_and_each_blocks_furthest():
    """The prologue's per-row limits (token's position, or its limit inside its context) and
    each block's KV end, brute force over a ragged batch with random runs (group 7)."""
    from pallas_kernels.mosaic_gpu_attention import _row_limits
    from pallas_kernels.ragged_batch import random_kv_limits

    group, q_lens, ctx = 7, [1, 20, 3, 1, 10], [5, 40, 3, 9, 10]
    rng = np.random.default_rng(2)
    batch = make_ragged_batch(rng, q_lens, ctx, num_tokens=40, num_seqs=7, max_pages=8,
                              num_pages=40, num_q_heads=14, num_kv_heads=2, head_dim=64,
                              page_size=8)
    lim = random_kv_limits(rng, batch)
    lim[3] = 10**6  # past its context: capped there
    nb, _, _ = call_grid(40, 14, 2, 7, 8, 8, MosaicTileConfig())
    qs, sl = jnp.asarray(batch.query_start), jnp.asarray(batch.seq_lens)
    meta, _ = _block_metadata(qs, sl, jnp.int32(batch.num_seqs), group, nb)
    rows, meta = map(np.asarray, _row_limits(jnp.asarray(lim), qs, sl, meta, group, 40))
    for s, (ql, c) in enumerate(zip(q_lens, ctx)):
        for j in range(ql):
            tok = batch.query_start[s] + j
            pos = c - ql + j
            want = max(pos, min(int(lim[tok]), c - 1))
            assert all(rows[tok * group + g] == want for g in range(group))
    for b in range(nb):
        row0, n = meta[b, 1], meta[b, 3]
        if n:
            assert meta[b, 5] == rows[row0:row0 + n].max() + 1


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (H100/H200)")
@pytest.mark.parametrize("opts", [{}, dict(sliding_window=37)])
def test_mosaic_kv_limit_matches_reference_gpu(opts):
    from pallas_kernels.ragged_batch import random_kv_limits

    q_lens, ctx, ps = [1, 17, 2, 90, 1, 64], [40, 48, 2, 130, 1, 300], 16
    mp = -(-max(ctx) // ps)
    rng = np.random.default_rng(3)
    batch = make_ragged_batch(rng, q_lens, ctx, num_tokens=sum(q_lens) + 5,
                              num_seqs=len(q_lens) + 2, max_pages=mp,
                              num_pages=(len(q_lens) + 2) * mp + 1, num_q_heads=8,
                              num_kv_heads=2, head_dim=128, page_size=ps, dtype=jnp.bfloat16)
    lim = jnp.asarray(random_kv_limits(rng, batch, max_run=40))
    args = [jnp.asarray(a) for a in batch.args()]
    out = ragged_paged_attention(*args, jnp.int32(batch.num_seqs), sm_scale=128 ** -0.5,
                                 kv_limit=lim, **opts)
    ref = reference.ragged_paged_attention(*args, sm_scale=128 ** -0.5, kv_limit=lim, **opts)
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.max(np.abs(out - ref)) / np.max(np.abs(ref)) <= 2e-2
