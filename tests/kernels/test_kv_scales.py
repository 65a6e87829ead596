"""float8 KV pages with per-KV-head scales (``kv_scale [Hkv, 2]``): every attention path ==
the reference, and the reference == plain attention over the dequantized pages.

K/V are drawn far outside e4m3's range (|x| up to ~3000 > 448), so scale 1.0 saturates and the
scales matter; the scales differ per head and between K and V. Fixed ragged batches (decodes,
a short row, prefill chunks, a one-token context, padding rows) with small tiles, so the
Pallas kernel runs split decode + combine and several prefill query blocks. CPU: Pallas in
interpret mode, the Triton-language kernel under Triton's interpreter (as the fp8 tests of
test_ragged_paged_attention / test_triton_attention do).
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import reference, xla_attention
from pallas_kernels.ragged_batch import make_ragged_batch
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

SMALL_TILES = dict(prefill_block_m=16, prefill_block_kv=16, decode_block_kv=16,
                   decode_num_splits=3, decode_min_kv_per_split=16)
FP8 = jnp.float8_e4m3fn
_ON_GPU = any(dev.platform == "gpu" for dev in jax.devices())
if not _ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
ROWS = [([1, 9, 1, 3, 12], [40, 30, 1, 17, 12]), ([1, 1, 20], [33, 8, 44])]


def _rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(out)), "non-finite output"
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30))


def _scaled_batch(rows, seed, *, hq=6, hkv=2, d=64, page_size=8, dtype=jnp.float32):
    """(args with fp8 pages holding K/V divided by the scales, kv_scale, dequantized f32 args,
    unquantized f32 args, num_seqs)."""
    q_lens, ctx = rows
    rng = np.random.default_rng(seed)
    batch = make_ragged_batch(rng, q_lens, ctx, num_tokens=32, num_seqs=6, max_pages=6,
                              num_pages=6 * 6 + 3, num_q_heads=hq, num_kv_heads=hkv,
                              head_dim=d, page_size=page_size)
    args = [jnp.asarray(a) for a in batch.args()]
    args[5] = args[5].at[batch.num_seqs:].set(0)  # the reference reads every table row
    # Per-head magnitudes far past e4m3's max (448): K ~ 1000-3000, V ~ 300-900.
    k = args[1] * jnp.asarray([1000.0, 3000.0][:hkv])[:, None, None, None]
    v = args[2] * jnp.asarray([300.0, 900.0][:hkv])[:, None, None, None]
    fmax = float(jnp.finfo(FP8).max)
    kv_scale = jnp.stack([jnp.max(jnp.abs(k), axis=(1, 2, 3)),
                          jnp.max(jnp.abs(v), axis=(1, 2, 3))], axis=1) / fmax
    kp = reference.to_page_dtype(k, FP8, kv_scale[:, 0, None, None, None])
    vp = reference.to_page_dtype(v, FP8, kv_scale[:, 1, None, None, None])
    q = (args[0] * 1e-3).astype(dtype)  # scores of O(1) against K of O(1000)
    fp8_args = [q, kp, vp, *args[3:]]
    deq = [q, kp.astype(jnp.float32) * kv_scale[:, 0, None, None, None],
           vp.astype(jnp.float32) * kv_scale[:, 1, None, None, None], *args[3:]]
    exact = [q, k, v, *args[3:]]
    return fp8_args, kv_scale, deq, exact, jnp.int32(batch.num_seqs), batch.num_tokens


@functools.lru_cache(maxsize=None)
def _ref(sm_scale, soft_cap, scaled):
    fn = functools.partial(reference.ragged_paged_attention, sm_scale=sm_scale,
                           soft_cap=soft_cap)
    if scaled:
        return jax.jit(lambda *a, kv_scale: fn(*a, kv_scale=kv_scale))
    return jax.jit(fn)


def test_write_kv_divides_by_the_scales_and_saturates():
    """Pages hold k / k_scale (v / v_scale) per KV head; values past the format saturate."""
    kp = jnp.zeros((2, 4, 4, 8), FP8)
    k = jnp.full((3, 2, 8), 900.0).at[:, 1].set(-4000.0)
    v = jnp.full((3, 2, 8), 50.0)
    scale = jnp.asarray([[2.0, 0.5], [4.0, 1.0]])
    kp2, vp2 = reference.write_kv(kp, kp, k, v, jnp.asarray([4, 5, 6]), kv_scale=scale)
    got_k = np.asarray(kp2.astype(jnp.float32)).reshape(2, 16, 8)[:, 4:7]
    got_v = np.asarray(vp2.astype(jnp.float32)).reshape(2, 16, 8)[:, 4:7]
    assert np.all(got_k[0] == 448.0)  # 900 / 2 = 450 saturates at e4m3's max 448
    assert np.all(got_k[1] == -448.0)  # -4000 / 4 = -1000 saturates too
    assert np.all(got_v[0] == 96.0) and np.all(got_v[1] == 48.0)  # 50/0.5 = 100 -> 96 in e4m3
    unscaled, _ = reference.write_kv(kp, kp, k, v, jnp.asarray([4, 5, 6]))
    assert np.all(np.asarray(unscaled.astype(jnp.float32)).reshape(2, 16, 8)[0, 4:7] == 448.0)


@pytest.mark.parametrize("soft_cap", [3.0])
def test_reference_scales_equal_dequantized_pages(soft_cap):
    """Folding the scales into scores/output == attention over pages * scale, and it is close
    to the unquantized K/V, while scale 1.0 (saturated pages) is far off."""
    fp8_args, kv_scale, deq, exact, nseq, _ = _scaled_batch(ROWS[0], seed=1)
    sm = 64 ** -0.5
    got = _ref(sm, soft_cap, True)(*fp8_args, kv_scale=kv_scale)
    assert _rel_err(got, _ref(sm, soft_cap, False)(*deq)) <= 1e-5
    want = _ref(sm, soft_cap, False)(*exact)
    err_scaled = _rel_err(got, want)
    saturated = [fp8_args[0], reference.to_page_dtype(exact[1], FP8),
                 reference.to_page_dtype(exact[2], FP8), *fp8_args[3:]]
    err_unit = _rel_err(_ref(sm, soft_cap, False)(*saturated), want)
    assert err_scaled < 0.1 and err_unit > 5 * err_scaled, (err_scaled, err_unit)


@pytest.mark.parametrize("rows", ROWS[:1], ids=["mixed"])
def test_xla_path_with_scales_matches_reference(rows):
    fp8_args, kv_scale, _, _, nseq, n_tok = _scaled_batch(rows, seed=2, page_size=8)
    ref = _ref(0.125, None, True)(*fp8_args, kv_scale=kv_scale)
    out = jax.jit(lambda *a, kv_scale: xla_attention.attention(
        *a, sm_scale=0.125, kv_scale=kv_scale, chunk_tokens=16, short_chunk_tokens=16,
        q_block=8))(*fp8_args, nseq, kv_scale=kv_scale)
    assert _rel_err(out, ref) <= 1e-5
    assert np.all(np.asarray(out)[n_tok:] == 0)


@pytest.mark.parametrize("rows,soft_cap,dtype", [(ROWS[0], 4.0, jnp.float32)],
                         ids=["mixed_cap_f32"])
def test_pallas_kernel_with_scales_matches_reference_interpret(rows, soft_cap, dtype):
    fp8_args, kv_scale, _, _, nseq, n_tok = _scaled_batch(rows, seed=3, dtype=dtype)
    ref = _ref(0.125, soft_cap, True)(*fp8_args, kv_scale=kv_scale)
    out = ragged_paged_attention(*fp8_args, nseq, sm_scale=0.125, soft_cap=soft_cap,
                                 kv_scale=kv_scale, interpret=True, **SMALL_TILES)
    assert out.dtype == dtype
    assert _rel_err(out, ref) <= (1e-5 if dtype == jnp.float32 else 2e-2)
    assert np.all(np.asarray(out.astype(jnp.float32))[n_tok:] == 0)


@pytest.mark.skipif(_ON_GPU, reason="Triton's interpreter runs on the CPU")
def test_triton_kernel_with_scales_matches_reference_interpreter():
    """The Triton-language kernel on torch tensors under TRITON_INTERPRET."""
    pytest.importorskip("triton")
    torch = pytest.importorskip("torch")
    from pallas_kernels import triton_attention, triton_kernels

    if "Interpret" not in type(triton_kernels.combine_kernel).__name__:
        pytest.skip("triton was imported before TRITON_INTERPRET was set")
    for rows, soft_cap in ((ROWS[0], 4.0),):
        fp8_args, kv_scale, _, _, nseq, n_tok = _scaled_batch(rows, seed=4)
        ref = np.asarray(_ref(0.125, soft_cap, True)(*fp8_args, kv_scale=kv_scale))
        t = [torch.from_numpy(np.array(a)) for a in (fp8_args[0], *fp8_args[3:])]
        kp, vp = (torch.from_numpy(np.array(p.astype(jnp.float32))).to(torch.float8_e4m3fn)
                  for p in fp8_args[1:3])
        out = triton_attention.ragged_paged_attention_torch(
            t[0], kp, vp, *t[1:], int(nseq), sm_scale=0.125, soft_cap=soft_cap,
            kv_scale=torch.from_numpy(np.array(kv_scale)), **SMALL_TILES)
        assert _rel_err(out.numpy(), ref) <= 1e-5, rows
        assert np.all(out.numpy()[n_tok:] == 0)
