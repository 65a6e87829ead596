"""Batched LoRA: the reference is the per-token definition, and the XLA path and the Pallas SGMV +
BGMV kernels (interpret mode on CPU) equal it on random ragged mixes of adapters; the kernels
lower for CUDA; any mix of slots runs in the one compiled graph.

A random step: prefill chunks (runs of one adapter, some longer than a block), decode tokens of
random adapters side by side, base-model tokens (-1) and padding (-1) at the end. Adapters have
different ranks, zero-padded to the slots' rank as the adapter slots hold them.
"""
from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels import lora, reference

T, D_IN, D_OUT, L, R = 80, 48, 40, 5, 8
# Several k steps and output blocks; 3 tokens per BGMV program (T is no multiple of it).
SMALL = dict(block_m=16, block_k=16, block_n=16, bgmv_tokens=3)


def random_step(rng, *, num_tokens=T, num_loras=L, d_in=D_IN, d_out=D_OUT, rank=R,
                dtype=np.float32):
    slots = []
    while len(slots) < num_tokens - 6:
        kind = rng.choice(["prefill", "decode", "base"])
        if kind == "prefill":
            slots += [int(rng.integers(0, num_loras))] * int(rng.integers(2, 30))
        elif kind == "decode":
            slots += list(rng.integers(-1, num_loras, size=int(rng.integers(1, 6))))
        else:
            slots += [-1] * int(rng.integers(1, 8))
    slots = np.asarray(slots[: num_tokens - 6] + [-1] * 6, np.int32)  # padding at the end
    x = rng.standard_normal((num_tokens, d_in)).astype(dtype)
    a = rng.standard_normal((num_loras, d_in, rank)).astype(np.float32)
    b = rng.standard_normal((num_loras, rank, d_out)).astype(np.float32)
    ranks = rng.integers(1, rank + 1, size=num_loras)
    for i, rk in enumerate(ranks):  # the slots hold each adapter zero-padded to the max rank
        a[i, :, rk:] = 0
        b[i, rk:] = 0
    scale = (rng.random(num_loras) * 2).astype(np.float32)
    return x, a.astype(dtype), b.astype(dtype), slots, scale


def naive(x, a, b, slots, scale):
    x, a, b = (np.asarray(v, np.float64) for v in (x, a, b))
    out = np.zeros((x.shape[0], b.shape[2]))
    for t, s in enumerate(slots):
        if s >= 0:
            out[t] = scale[s] * (x[t] @ a[s] @ b[s])
    return out


def _rel(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(out))
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30))


def test_reference_is_the_per_token_definition():
    rng = np.random.default_rng(0)
    x, a, b, slots, scale = random_step(rng)
    ref = reference.lora_delta(x, a, b, slots, scale)
    assert _rel(ref, naive(x, a, b, slots, scale)) < 1e-5
    np.testing.assert_array_equal(np.asarray(ref)[slots < 0], 0)


@pytest.mark.parametrize("seed", range(4))
def test_xla_path_equals_reference(seed):
    rng = np.random.default_rng(10 + seed)
    args = random_step(rng)
    ref = reference.lora_delta(*args)
    out = lora.lora_delta(*args)
    assert _rel(out, ref) < 1e-5
    np.testing.assert_array_equal(np.asarray(out)[args[3] < 0], 0)


def test_xla_path_base_only_step_is_zero():
    rng = np.random.default_rng(9)
    x, a, b, _, scale = random_step(rng)
    out = lora.lora_delta(x, a, b, np.full(T, -1, np.int32), scale)
    assert out.shape == (T, D_OUT) and not np.any(np.asarray(out))
    one = np.full(T, -1, np.int32)
    one[5] = 3  # a single adapter token anywhere turns the delta on
    out = lora.lora_delta(x, a, b, one, scale)
    assert _rel(out, naive(x, a, b, one, scale)) < 1e-5 and np.any(np.asarray(out)[5])


@pytest.mark.parametrize("seed", range(4))
def test_pallas_sgmv_bgmv_equal_reference(seed):
    rng = np.random.default_rng(20 + seed)
    args = random_step(rng)
    ref = reference.lora_delta(*args)
    # From every run in SGMV to every token in BGMV; the run bound as tight as the step allows.
    min_len = (2, 4, 1, 100)[seed]
    runs = 1 + int(np.count_nonzero(np.diff(args[3])))
    max_runs = (None, runs, runs, 1)[seed]
    out = lora.lora_delta_pallas(*args, interpret=True, sgmv_min_len=min_len, max_runs=max_runs,
                                 **SMALL)
    assert _rel(out, ref) < 1e-5
    np.testing.assert_array_equal(np.asarray(out)[args[3] < 0], 0)


def test_pallas_bf16_default_tiles():
    rng = np.random.default_rng(3)
    args = random_step(rng, dtype=jnp.bfloat16)
    ref = naive(*args)
    out = lora.lora_delta_pallas(*args, interpret=True)
    assert out.dtype == jnp.bfloat16
    assert _rel(out, ref) < 2e-2
    assert _rel(lora.lora_delta(*args), ref) < 2e-2


def test_segment_blocks_cover_runs():
    """SGMV blocks: every token of a run >= sgmv_min_len in exactly one block of its slot, at
    most block_m rows, never across runs; the rest go to BGMV (or nowhere when base)."""
    rng = np.random.default_rng(5)
    _, _, _, slots, _ = random_step(rng)
    bt, bl, bs, ts = (np.asarray(v) for v in lora.segment_blocks(
        jnp.asarray(slots), L, block_m=16, sgmv_min_len=3))
    covered = np.zeros(T, int)
    for tok, n, s in zip(bt, bl, bs):
        assert n <= 16
        covered[tok : tok + n] += 1
        assert np.all(slots[tok : tok + n] == s)
    runs = np.split(np.arange(T), np.flatnonzero(np.diff(slots)) + 1)
    for run in runs:
        long = slots[run[0]] >= 0 and len(run) >= 3
        assert np.all(covered[run] == (1 if long else 0))
        assert np.all(ts[run] == (-1 if long or slots[run[0]] < 0 else slots[run[0]]))


def test_any_mix_runs_in_one_compiled_graph():
    rng = np.random.default_rng(6)
    x, a, b, slots, scale = random_step(rng)
    mixes = [slots, np.full(T, -1, np.int32), np.random.default_rng(1).permutation(slots),
             np.full(T, 2, np.int32)]
    sizes = []
    for s in mixes:
        out = lora.lora_delta_pallas(x, a, b, s, scale, interpret=True, **SMALL)
        ref = naive(x, a, b, s, scale)
        assert _rel(out, ref) < 1e-5 if np.any(s >= 0) else not np.any(np.asarray(out))
        sizes.append(lora._shrink._cache_size() + lora._expand._cache_size())
    assert sizes == sizes[:1] * len(mixes)  # no compile after the first mix


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_sharded_input_sums_shrinks_before_one_expand(impl):
    """Tensor parallelism over ``in`` (a row-parallel projection): each shard's shrink of its
    slice of x and A, summed, then one expand == the unsharded delta."""
    rng = np.random.default_rng(8)
    x, a, b, slots, scale = random_step(rng)
    if impl == "xla":
        shrink, expand = lora.lora_shrink, lora.lora_expand
    else:
        shrink = lambda *v: lora.lora_shrink_pallas(*v, interpret=True, **SMALL)
        expand = lambda *v: lora.lora_expand_pallas(*v, interpret=True, **SMALL)
    half = D_IN // 2
    xa = shrink(x[:, :half], a[:, :half], slots) + shrink(x[:, half:], a[:, half:], slots)
    assert xa.shape == (T, R) and xa.dtype == jnp.float32
    assert _rel(expand(xa, b, slots, scale), naive(x, a, b, slots, scale)) < 1e-5


def test_rejects_mismatched_shapes():
    rng = np.random.default_rng(7)
    x, a, b, slots, scale = random_step(rng)
    with pytest.raises(ValueError, match="chain"):
        lora.lora_delta(x, a, b[:, :, :-1].swapaxes(1, 2), slots, scale)
    with pytest.raises(ValueError, match="block_k"):
        lora.lora_delta_pallas(x, a, b, slots, scale, block_k=24)
    with pytest.raises(ValueError, match="max_runs"):
        lora.lora_delta_pallas(x, a, b, slots, scale, max_runs=0)


def _gpu_available():
    try:
        return any(dev.platform == "gpu" for dev in jax.devices())
    except RuntimeError:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_available(), reason="needs a GPU backend")
@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-4), (jnp.bfloat16, 2e-2)],
                         ids=["f32", "bf16"])
@pytest.mark.parametrize("seed", range(3))
def test_pallas_lora_gpu(seed, dtype, tol):
    rng = np.random.default_rng(40 + seed)
    args = random_step(rng, num_tokens=512, num_loras=8, d_in=1024, d_out=768, rank=16,
                       dtype=dtype)
    ref = naive(*args)
    assert _rel(lora.lora_delta_pallas(*args), ref) < tol
    assert _rel(lora.lora_delta(*args), ref) < tol


_HAS_PLUGIN = any(importlib.util.find_spec(m) is not None
                  for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
TRITON = "__gpu$xla.gpu.triton"


@pytest.mark.skipif(not _HAS_PLUGIN, reason="jax CUDA plugin not installed")
@pytest.mark.parametrize(
    "t,d_in,d_out,num,rank,dtype",
    [(256, 4096, 4096, 8, 64, jnp.bfloat16),  # Llama-3-8B q/o projection, --max-lora-rank 64
     (64, 4096, 14336, 3, 16, jnp.bfloat16),  # its MLP up projection
     (48, 576, 1536, 3, 8, jnp.float32)],  # SmolLM2-135M, rank padded to 16 inside
    ids=["llama8b_attn", "llama8b_mlp", "smollm2_f32"],
)
def test_lora_lowers_for_cuda(t, d_in, d_out, num, rank, dtype):
    sds = jax.ShapeDtypeStruct
    specs = (sds((t, d_in), dtype), sds((num, d_in, rank), dtype), sds((num, rank, d_out), dtype),
             sds((t,), jnp.int32), sds((num,), jnp.float32))
    exp = export.export(jax.jit(lora.lora_delta_pallas), platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON)])(*specs)
    text = exp.mlir_module()
    assert text.count(TRITON) == 4
    for name in ("lora_sgmv_shrink", "lora_bgmv_shrink", "lora_sgmv_expand", "lora_bgmv_expand"):
        assert name in text


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_slot_reaches_only_its_own_tokens(impl, bad):
    """Isolation: a slot whose A and B hold NaN / inf (it should never load, but if one did)
    leaves every token of the other slots and of the base model exactly as without it."""
    rng = np.random.default_rng(31)
    x, a, b, slots, scale = random_step(rng)
    poisoned = 2
    a_bad, b_bad = a.copy(), b.copy()
    a_bad[poisoned, 3, 0] = bad
    b_bad[poisoned, 0, 5] = bad
    b_bad[poisoned, 1] = bad
    run = {"reference": reference.lora_delta, "xla": lora.lora_delta,
           "pallas": lambda *v: lora.lora_delta_pallas(*v, interpret=True, **SMALL)}[impl]
    clean = np.asarray(run(x, a, b, slots, scale))
    dirty = np.asarray(run(x, a_bad, b_bad, slots, scale))
    others = slots != poisoned
    assert others.sum() > 0 and (~others).sum() > 0
    np.testing.assert_array_equal(dirty[others], clean[others])
    np.testing.assert_array_equal(dirty[slots < 0], 0)
    assert not np.all(np.isfinite(dirty[~others]))  # the poisoned slot's own tokens do see it
