"""The Pallas kernels lower for CUDA (Pallas -> Triton) on a machine without a GPU.

`jax.export` with ``platforms=["cuda"]`` runs the real Triton lowering, which rejects what a GPU
would reject (non-power-of-two tensors, unsupported ops, ...). It needs the CUDA plugin of the
installed jaxlib version (``pip install --no-deps jax-cuda12-plugin==$V jax-cuda12-pjrt==$V``);
without it these tests skip. What this cannot catch: Triton's own PTX compile (shared memory,
registers), which happens only on the device.
"""
from __future__ import annotations

import functools
import importlib.util
import itertools

import jax
import jax.numpy as jnp
import pytest
from jax import export
from jax.experimental import pallas as pl

from pallas_kernels.ragged_paged_attention import _TritonParams, ragged_paged_attention

_HAS_PLUGIN = any(
    importlib.util.find_spec(m) is not None for m in ("jax_cuda12_plugin", "jax_cuda13_plugin")
)
pytestmark = pytest.mark.skipif(not _HAS_PLUGIN, reason="jax CUDA plugin not installed")

TRITON = "__gpu$xla.gpu.triton"


def export_for_cuda(fn, *arg_specs):
    """StableHLO text of ``fn`` lowered for CUDA, Triton kernels embedded."""
    exp = export.export(
        jax.jit(fn),
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON)],
    )(*arg_specs)
    return exp.mlir_module()


def _specs(*, tokens=64, seqs=16, max_pages=32, pages=128, hq=8, hkv=2, d=128, page_size=16,
           dtype=jnp.bfloat16, kv_dtype=None):
    sds = jax.ShapeDtypeStruct
    kv_dtype = kv_dtype or dtype
    return (
        sds((tokens, hq, d), dtype),
        sds((hkv, pages, page_size, d), kv_dtype),
        sds((hkv, pages, page_size, d), kv_dtype),
        sds((seqs + 1,), jnp.int32),
        sds((seqs,), jnp.int32),
        sds((seqs, max_pages), jnp.int32),
        sds((), jnp.int32),
    )


def _lower(*, sm_scale=0.1, sliding_window=None, soft_cap=None, tiles=None, **shape):
    fn = functools.partial(
        ragged_paged_attention, sm_scale=sm_scale, sliding_window=sliding_window,
        soft_cap=soft_cap, **(tiles or {}),
    )
    return export_for_cuda(fn, *_specs(**shape))


HEAD_DIMS = (64, 128, 256)
DTYPES = (jnp.bfloat16, jnp.float32)
# (Hq, Hkv): MHA, GQA 2/4/7 (non-power-of-two group, Qwen2-style), MQA with a wide group.
HEADS = ((8, 8), (8, 4), (32, 8), (14, 2), (32, 1))


@pytest.mark.parametrize(
    "d,dtype,heads",
    list(itertools.product(HEAD_DIMS, DTYPES, HEADS)),
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_lowers_every_head_dim_dtype_group(d, dtype, heads):
    hq, hkv = heads
    # Forced splits: decode kernel + combine kernel + prefill kernel all lower.
    text = _lower(d=d, dtype=dtype, hq=hq, hkv=hkv, tiles=dict(decode_num_splits=4))
    assert text.count(TRITON) == 3
    for name in ("rpa_decode", "rpa_decode_combine", "rpa_prefill"):
        assert name in text


@pytest.mark.parametrize(
    "opts",
    [
        dict(sliding_window=128),
        dict(soft_cap=30.0),
        dict(sliding_window=4096, soft_cap=50.0),
        dict(page_size=8),
        dict(page_size=32, tiles=dict(decode_block_kv=16)),  # KV step smaller than a page
        dict(page_size=128),
        dict(tiles=dict(prefill_block_m=128, prefill_block_kv=32, prefill_num_warps=8,
                        prefill_num_stages=3, decode_block_m=32)),
        dict(tokens=512, seqs=64, max_pages=512, pages=4096),  # benchmark-like, default splits
        dict(tokens=16, seqs=16),  # decode-only bucket: T small
        dict(tokens=48, seqs=12, max_pages=20, pages=101),  # nothing a power of two
    ],
    ids=["window", "softcap", "window+softcap", "page8", "page32", "page128", "big_tiles",
         "bench_shape", "decode_bucket", "odd_sizes"],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda v: v.__name__)
def test_lowers_options(opts, dtype):
    text = _lower(dtype=dtype, **opts)
    assert text.count(TRITON) >= 2


def test_lowering_rejects_what_a_gpu_rejects():
    """The harness is live: a kernel holding a non-power-of-two tensor fails to lower."""

    def double(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    def fn(x):
        return pl.pallas_call(
            double, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(1,),
            in_specs=[pl.BlockSpec(x.shape, lambda i: (0,))],
            out_specs=pl.BlockSpec(x.shape, lambda i: (0,)),
            compiler_params=_TritonParams(num_warps=4, num_stages=1),
        )(x)

    assert TRITON in export_for_cuda(fn, jax.ShapeDtypeStruct((16,), jnp.float32))
    with pytest.raises(Exception, match="power of 2"):
        export_for_cuda(fn, jax.ShapeDtypeStruct((12,), jnp.float32))


@pytest.mark.parametrize("kv_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2],
                         ids=lambda v: v.__name__)
def test_lowers_with_float8_pages(kv_dtype):
    """--kv-cache-dtype fp8: the kernels load float8 pages and upcast them in registers."""
    text = _lower(d=128, dtype=jnp.bfloat16, kv_dtype=kv_dtype,
                  tiles=dict(decode_num_splits=4))
    assert text.count(TRITON) == 3


def test_lowers_with_float8_pages_and_kv_scales():
    """float8 pages with per-KV-head K/V scales, read by every program from a small input."""
    fn = functools.partial(ragged_paged_attention, sm_scale=0.1, decode_num_splits=4)
    specs = _specs(d=128, hq=32, hkv=8, dtype=jnp.bfloat16, kv_dtype=jnp.float8_e4m3fn)
    text = export_for_cuda(lambda *a: fn(*a[:-1], kv_scale=a[-1]), *specs,
                           jax.ShapeDtypeStruct((8, 2), jnp.float32))
    assert text.count(TRITON) == 3


# Gemma 4: sliding layers of head_dim 256 (GQA 2), global layers of 512 (GQA 8), fp8 pages
# and soft-capping, a window of 1024 on the sliding ones.
@pytest.mark.parametrize("d,hq,hkv,opts", [
    (256, 32, 16, dict(sliding_window=1024, soft_cap=30.0)),
    (512, 32, 4, dict(soft_cap=30.0)),
    (512, 32, 4, dict(kv_dtype=jnp.float8_e4m3fn)),
], ids=["gemma4_sliding_256", "gemma4_global_512", "gemma4_global_512_fp8"])
def test_lowers_gemma4_head_dims(d, hq, hkv, opts):
    text = _lower(d=d, hq=hq, hkv=hkv, dtype=jnp.bfloat16, **opts)
    assert text.count(TRITON) >= 2


@pytest.mark.parametrize("opts", [dict(), dict(sliding_window=512, soft_cap=30.0),
                                  dict(tiles=dict(prefill_num_splits=2, decode_num_splits=4))])
def test_lowers_with_kv_limit(opts):
    """Per-token visibility limits (Gemma 4's image runs): one more step ref, read by the
    attention and combine kernels."""
    tiles = opts.get("tiles") or {}
    fn = functools.partial(ragged_paged_attention, sm_scale=0.1, **tiles,
                           **{k: v for k, v in opts.items() if k != "tiles"})
    specs = _specs(hq=16, hkv=2, d=256) + (jax.ShapeDtypeStruct((64,), jnp.int32),)
    text = export_for_cuda(lambda *a: fn(*a[:-1], kv_limit=a[-1]), *specs)
    assert text.count(TRITON) >= 2
