"""The Triton-language ragged paged attention == the jnp reference on random ragged batches.

CPU: the kernels run on torch tensors under Triton's interpreter (``TRITON_INTERPRET=1``, set
here before ``triton`` is first imported). Triton 3.9's interpreter computes ``tl.dot`` of
bfloat16 tiles wrongly (float16 and float32 are right), so bf16 is checked natively only, with
the ``jax_triton.triton_call`` path, under ``-m gpu``. Tolerance is relative to the output's
largest magnitude.
"""
from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pallas_kernels import reference
from pallas_kernels.ragged_batch import make_ragged_batch


def _gpu_available():
    try:
        return any(dev.platform == "gpu" for dev in jax.devices())
    except RuntimeError:
        return False


_ON_GPU = _gpu_available()
if not _ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

triton = pytest.importorskip("triton", reason="triton not installed (pip install triton)")
torch = pytest.importorskip("torch")

from pallas_kernels import triton_attention  # noqa: E402
from pallas_kernels.ragged_paged_attention import call_shapes, default_tiles  # noqa: E402

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and (
    "pallas_kernels.triton_kernels" not in sys.modules
    or "Interpret" in type(sys.modules["pallas_kernels.triton_kernels"].combine_kernel).__name__)
interpreter = pytest.mark.skipif(_ON_GPU or not _INTERPRETED,
                                 reason="needs Triton's interpreter (CPU, TRITON_INTERPRET=1)")

SMALL_TILES = dict(prefill_block_m=16, prefill_block_kv=16, decode_block_kv=16,
                   decode_num_splits=3, decode_min_kv_per_split=16)
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 2e-2}
TORCH_DTYPE = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@functools.lru_cache(maxsize=None)
def _ref_fn(sm_scale, sliding_window, soft_cap):
    return jax.jit(functools.partial(
        reference.ragged_paged_attention, sm_scale=sm_scale, sliding_window=sliding_window,
        soft_cap=soft_cap))


def _rel_err(out, ref):
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    assert np.all(np.isfinite(out)), "kernel produced non-finite values"
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30))


@st.composite
def ragged_rows(draw, *, num_tokens, num_seqs, max_ctx, page_size):
    """(q_lens, ctx_lens) of a mixed step (decodes, short rows, prefill chunks) in the buckets."""
    n = draw(st.integers(1, num_seqs))
    ctx = [draw(st.one_of(st.just(1), st.integers(1, max_ctx // page_size).map(
        lambda p: p * page_size), st.integers(1, max_ctx))) for _ in range(n)]
    budget = num_tokens - n
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
    ("f32_gqa2_d64", "float32", 4, 2, 64, 8, {}, SMALL_TILES),
    ("f16_gqa4_d128", "float16", 8, 2, 128, 16, {}, SMALL_TILES),
    ("f32_mqa_page32", "float32", 4, 1, 64, 32, {}, SMALL_TILES),  # KV step < a page
    ("f32_gqa3_window_cap", "float32", 6, 2, 64, 8, dict(sliding_window=13, soft_cap=5.0),
     SMALL_TILES),
    # Default tiles; splits allowed down to one page so the run-time split count is used.
    ("f32_mha_defaults", "float32", 2, 2, 64, 16, {}, dict(decode_min_kv_per_split=16)),
    # float8 pages (--kv-cache-dtype fp8), upcast in the kernel as the reference does
    ("f16_gqa4_fp8e4m3_kv", "float16", 8, 2, 64, 16, dict(kv_dtype="float8_e4m3fn"),
     SMALL_TILES),
    ("f32_gqa2_fp8e5m2_kv_window", "float32", 4, 2, 64, 8,
     dict(kv_dtype="float8_e5m2", sliding_window=13), SMALL_TILES),
]
NUM_TOKENS, NUM_SEQS, MAX_PAGES = 32, 6, 6


def _batch(cfg, rows, seed, num_tokens=NUM_TOKENS, num_seqs=NUM_SEQS, max_pages=MAX_PAGES):
    name, dtype, hq, hkv, d, page_size, opts, tiles = cfg
    q_lens, ctx = rows
    return make_ragged_batch(
        np.random.default_rng(seed), q_lens, ctx, num_tokens=num_tokens, num_seqs=num_seqs,
        max_pages=max_pages, num_pages=num_seqs * max_pages + 3, num_q_heads=hq,
        num_kv_heads=hkv, head_dim=d, page_size=page_size, dtype=np.float32,
        padding_tables="random" if seed % 2 else "trash")


def _reference(batch, cfg):
    _, _, _, _, d, _, opts, _ = cfg
    args = [jnp.asarray(a) for a in batch.args()]
    args[0:3] = [a.astype(jnp.dtype(cfg[1])) for a in args[0:3]]
    if "kv_dtype" in opts:
        args[1:3] = [reference.to_page_dtype(a, jnp.dtype(opts["kv_dtype"])) for a in args[1:3]]
    args[5] = args[5].at[batch.num_seqs:].set(0)  # the reference reads every table row
    return _ref_fn(d ** -0.5, opts.get("sliding_window"), opts.get("soft_cap"))(*args)


def _check_torch(cfg, rows, seed, device="cpu"):
    name, dtype, *_, opts, tiles = cfg
    batch = _batch(cfg, rows, seed)
    tdt = TORCH_DTYPE[dtype]
    args = [torch.from_numpy(np.asarray(a)).to(device) for a in batch.args()]
    args[0:3] = [a.to(tdt) for a in args[0:3]]
    opts = dict(opts)
    if kv_dtype := opts.pop("kv_dtype", None):  # the reference's float8 pages, bit for bit
        pages = [reference.to_page_dtype(jnp.asarray(a, jnp.dtype(dtype)), jnp.dtype(kv_dtype))
                 for a in (batch.k_pages, batch.v_pages)]
        args[1:3] = [torch.from_numpy(np.array(p.astype(jnp.float32))).to(
            getattr(torch, kv_dtype)).to(device) for p in pages]
    out = triton_attention.ragged_paged_attention_torch(
        *args, batch.num_seqs, sm_scale=cfg[4] ** -0.5, **opts, **tiles)
    assert out.shape == args[0].shape and out.dtype == tdt
    out = out.float().cpu().numpy()
    ref = np.asarray(_reference(batch, cfg), np.float32)
    err = _rel_err(out, ref)
    assert err <= TOL[dtype], f"{name}: rel err {err:.3g} for q_lens={rows[0]} ctx={rows[1]}"
    assert np.all(out[batch.num_tokens:] == 0), "padded tokens must come back as zeros"


@interpreter
@pytest.mark.parametrize("cfg", CONFIGS, ids=[c[0] for c in CONFIGS])
@settings(max_examples=2, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_triton_interpreter_matches_reference(cfg, data):
    rows = data.draw(ragged_rows(num_tokens=NUM_TOKENS, num_seqs=NUM_SEQS,
                                 max_ctx=MAX_PAGES * cfg[5], page_size=cfg[5]))
    _check_torch(cfg, rows, data.draw(st.integers(0, 2**16)))


@interpreter
def test_triton_interpreter_split_prefill_and_fixed_rows():
    """A fixed mixed batch (long prefill chunk, decodes, a short row, a one-token context)
    through split prefill + split decode: both combine launches write the output."""
    cfg = ("f32_gqa3_split_prefill", "float32", 6, 2, 64, 8, dict(sliding_window=19),
           dict(SMALL_TILES, prefill_num_splits=2))
    _check_torch(cfg, ([1, 17, 2, 9, 1], [40, 48, 2, 30, 1]), seed=3)


@interpreter
def test_triton_interpreter_kv_limit_matches_reference():
    """Runs of tokens that see each other (``kv_limit``, Gemma 4's image tokens) over split
    and direct launches: each block's KV walk and the combine reach the runs' ends."""
    from pallas_kernels.ragged_batch import random_kv_limits

    opts, tiles = dict(sliding_window=13), dict(SMALL_TILES, prefill_num_splits=2)
    cfg = ("f32_gqa2_kv_limit", "float32", 4, 2, 64, 8, opts, tiles)
    batch = _batch(cfg, ([1, 17, 2, 9, 1], [40, 48, 2, 30, 1]), seed=5)
    lim = random_kv_limits(np.random.default_rng(5), batch)
    args = [torch.from_numpy(np.asarray(a)) for a in batch.args()]
    out = triton_attention.ragged_paged_attention_torch(
        *args, batch.num_seqs, sm_scale=64 ** -0.5, kv_limit=torch.from_numpy(lim), **opts,
        **tiles)
    ref_args = [jnp.asarray(a) for a in batch.args()]
    ref_args[5] = ref_args[5].at[batch.num_seqs:].set(0)
    ref = _ref_fn(64 ** -0.5, opts.get("sliding_window"), None)(*ref_args,
                                                               kv_limit=jnp.asarray(lim))
    causal = _ref_fn(64 ** -0.5, opts.get("sliding_window"), None)(*ref_args)
    assert _rel_err(out.numpy(), ref) <= 1e-5
    assert _rel_err(causal, ref) > 1e-3  # the limits matter in this batch


@interpreter
def test_triton_interpreter_padding_rows_read_nothing():
    """Pages reachable only from padding rows or past a row's last page hold NaN; the output
    stays finite and exact."""
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
    for r in range(batch.num_seqs):
        bt[r, -(-int(batch.seq_lens[r]) // 16):] = poison[0]
    args = [torch.from_numpy(a) for a in (batch.q, k, v, batch.query_start, batch.seq_lens, bt)]
    out = triton_attention.ragged_paged_attention_torch(
        *args, sm_scale=0.125, prefill_block_kv=16, decode_block_kv=16, prefill_block_m=16)
    ref = _ref_fn(0.125, None, None)(*[jnp.asarray(a) for a in batch.args()])
    assert _rel_err(out.numpy(), ref) <= 1e-5


def test_triton_launch_plan_matches_pallas_call_shapes():
    """The Triton backend launches the Pallas kernel's calls: same grids, block sizes, splits
    (the benchmark shape: 64 decodes at ctx 8192, and a mixed bucket)."""
    for t, ctx in ((64, 8192), (2080, 2048)):
        cfg = default_tiles(128, jnp.bfloat16)
        mp = ctx // 16
        plan = triton_attention.launch_plan((t, 32, 128), (8, 1 + 64 * mp, 16, 128), 64, mp,
                                            jnp.bfloat16, sm_scale=0.1, sliding_window=None,
                                            soft_cap=None, cfg=cfg)
        dec, pre, _, _ = call_shapes(t, 32, 8, 16, 64, mp, 128, cfg)
        by_name = {(k, n): (g, kw) for k, n, g, kw, *_ in plan}
        kind = "split" if dec.num_splits > 1 else "direct"
        grid, kw = by_name[(kind, "decode")]
        assert grid == (dec.num_blocks, 8, dec.num_splits)
        assert (kw["BLOCK_M"], kw["BLOCK_KV"], kw["GP"]) == (dec.block_m, dec.block_kv, 4)
        assert (("combine", "decode") in by_name) == (dec.num_splits > 1)
        assert (("direct", "prefill") in by_name) == (pre.num_blocks > 0)
    assert dec.num_splits > 1 and pre.num_blocks > 0  # both paths were covered


# ---- natively on a GPU through jax_triton.triton_call (run with `-m gpu`) ----

GPU_CONFIGS = [c for c in CONFIGS if c[1] == "float32"] + [
    ("bf16_gqa4_d128", "bfloat16", 8, 2, 128, 16, {}, SMALL_TILES),
    ("bf16_gqa4_d128_defaults", "bfloat16", 32, 8, 128, 16, {}, {}),
    ("bf16_gqa8_d64_window_cap", "bfloat16", 16, 2, 64, 16, dict(sliding_window=40,
                                                                 soft_cap=20.0), {}),
]


@pytest.mark.gpu
@pytest.mark.skipif(not _ON_GPU, reason="needs a GPU backend")
@pytest.mark.parametrize("cfg", GPU_CONFIGS, ids=[c[0] for c in GPU_CONFIGS])
@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_triton_jax_call_matches_reference_gpu(cfg, data):
    pytest.importorskip("jax_triton")
    rows = data.draw(ragged_rows(num_tokens=NUM_TOKENS, num_seqs=NUM_SEQS,
                                 max_ctx=MAX_PAGES * cfg[5], page_size=cfg[5]))
    seed = data.draw(st.integers(0, 2**16))
    batch = _batch(cfg, rows, seed)
    name, dtype, *_, opts, tiles = cfg
    args = [jnp.asarray(a) for a in batch.args()]
    args[0:3] = [a.astype(jnp.dtype(dtype)) for a in args[0:3]]
    opts = dict(opts)
    if kv_dtype := opts.pop("kv_dtype", None):  # the reference's float8 pages, bit for bit
        args[1:3] = [reference.to_page_dtype(a, jnp.dtype(kv_dtype)) for a in args[1:3]]
    fn = jax.jit(functools.partial(triton_attention.ragged_paged_attention,
                                   sm_scale=cfg[4] ** -0.5, **opts, **tiles))
    out = fn(*args, jnp.int32(batch.num_seqs))
    assert out.dtype == jnp.dtype(dtype)
    err = _rel_err(out, _reference(batch, cfg))
    assert err <= TOL[dtype], f"{name}: rel err {err:.3g}"
    assert np.all(np.asarray(out[batch.num_tokens:], np.float32) == 0)
