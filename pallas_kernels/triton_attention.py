"""Ragged paged attention in Triton's own language, called from JAX through ``jax_triton``.

Same arguments and result as :func:`pallas_kernels.reference.ragged_paged_attention`, and the
same cut of the work as the Pallas-Triton kernel (:mod:`pallas_kernels.ragged_paged_attention`,
whose :class:`TileConfig` and :func:`call_shapes` it shares), so the two backends differ only in
the language the kernel is written in:

* rows = tokens x the ``G`` query heads of one KV head (padded to ``Gp``, a power of two);
* a *decode* call (rows of at most ``block_q`` new tokens, KV split over programs, then a
  combine kernel) and a *prefill* call (one program per query block and KV head);
* each program reads the step metadata itself; KV rows are gathered by slot through the block
  table from the pool viewed as ``[Hkv, num_pages * page_size, D]``;
* masked stores into the flat ``[T * Hq, D]`` output, which starts as zeros (padding tokens).

KV layout: ``[Hkv, num_pages, page_size, D]``, one page of one KV head contiguous (the pool the
engine allocates for the Pallas backend). fp8 KV: float8 pages are upcast in registers; the
``[Hkv, 2]`` K/V scales (reference.py) enter as ``sm_scale * k_scale`` and ``output * v_scale``.

``triton`` and ``jax_triton`` are imported when a kernel is first built, so ``pallas_kernels``
imports without them. The kernels run three ways: through ``jax_triton.triton_call`` on a GPU
(:func:`ragged_paged_attention`), or on torch tensors (:func:`ragged_paged_attention_torch`),
which under ``TRITON_INTERPRET=1`` (set before ``triton`` is imported) runs on the CPU.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from pallas_kernels.ragged_paged_attention import (
    TileConfig,
    _check,
    _next_pow2,
    call_shapes,
    default_tiles,
)

_LOG2E = math.log2(math.e)
_MASK = -0.7 * float(np.finfo(np.float32).max)  # finite: no inf - inf = nan in the online softmax


@functools.cache
def _kernels():
    """The Triton kernels by role (imports triton on first use)."""
    from pallas_kernels import triton_kernels as tk

    return dict(direct=tk.attn_direct_kernel, split=tk.attn_split_kernel,
                combine=tk.combine_kernel)


def launch_plan(q_shape, kv_shape, s_len, max_pages, dtype, *, sm_scale, sliding_window,
                soft_cap, cfg: TileConfig, scaled: bool = False, limited: bool = False):
    """The kernel launches of one call, in order: ``(kernel name, grid, constexprs, warps,
    stages, combine-of-previous)`` for the prefill call (if the bucket can hold a long row) and
    the decode call, each followed by its combine when split. Shared by the JAX and torch paths
    so they launch exactly the same kernels."""
    t, hq, d = q_shape
    hkv, num_pages, page_size, _ = kv_shape
    group = hq // hkv
    gp = _next_pow2(group)
    dec, pre, split_target, min_iters = call_shapes(t, hq, hkv, page_size, s_len, max_pages, d,
                                                    cfg)
    f32 = np.dtype(dtype) == np.float32
    base = dict(S_LEN=s_len, SP=max(16, _next_pow2(s_len)), GP=gp, GROUP=group, HQ=hq, HKV=hkv,
                HEAD_DIM=d, PAGE_SIZE=page_size, WINDOW=sliding_window or 0,
                BQ_DEC=dec.block_q, LIMITED=bool(limited))
    attn_only = dict(MAX_PAGES=max_pages, NUM_PAGES=num_pages, sm_scale=float(sm_scale),
                     soft_cap=float(soft_cap or 0.0), SOFT_CAP=soft_cap is not None,
                     DOT_PREC="ieee" if f32 else "tf32", SCALED=bool(scaled))
    launches = []
    for decode, shape in ((False, pre), (True, dec)):
        if shape.num_blocks == 0:
            continue
        kw = dict(base, DECODE=decode, BQ=shape.block_q, BLOCK_M=shape.block_m,
                  BLOCK_KV=shape.block_kv, NUM_SPLITS=shape.num_splits,
                  SPLIT_TARGET=split_target if decode else 0,
                  MIN_ITERS=min_iters if decode else 1)
        grid = (shape.num_blocks, hkv, shape.num_splits)
        name = "decode" if decode else "prefill"
        if shape.num_splits == 1:
            launches.append(("direct", name, grid, dict(kw, **attn_only), shape.num_warps,
                             shape.num_stages))
        else:
            launches.append(("split", name, grid, dict(kw, **attn_only), shape.num_warps,
                             shape.num_stages))
            launches.append(("combine", name, grid[:2], dict(kw, NUM_BLOCKS=shape.num_blocks),
                             4, 1))
    return launches


def _prepare(q, k_pages, v_pages, query_start, seq_lens, block_tables, sliding_window, soft_cap,
             tile_params, dtype):
    cfg = default_tiles(q.shape[-1], dtype).replace(**tile_params)
    _check(q, k_pages, v_pages, query_start, seq_lens, block_tables, cfg)
    if sliding_window is not None and int(sliding_window) < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if soft_cap is not None and float(soft_cap) <= 0:
        raise ValueError(f"soft_cap must be > 0, got {soft_cap}")
    return cfg, (int(sliding_window) if sliding_window is not None else None)


def ragged_paged_attention(q, k_pages, v_pages, query_start, seq_lens, block_tables,
                           num_seqs=None, *, sm_scale: float, sliding_window: int | None = None,
                           soft_cap: float | None = None, kv_scale=None, kv_limit=None,
                           **tile_params):
    """The Triton kernels through ``jax_triton.triton_call`` (GPU only; jit-compatible).

    Arguments and result as :func:`pallas_kernels.ragged_paged_attention.ragged_paged_attention`;
    ``tile_params`` override :class:`TileConfig` fields (block sizes, splits, warps, stages).
    """
    import jax
    import jax.numpy as jnp
    import jax_triton as jt

    cfg, window = _prepare(q, k_pages, v_pages, query_start, seq_lens, block_tables,
                           sliding_window, soft_cap, tile_params, q.dtype)
    t, hq, d = q.shape
    s_len, max_pages = block_tables.shape
    kernels = _kernels()
    meta = (query_start.astype(jnp.int32), seq_lens.astype(jnp.int32),
            (jnp.int32(s_len) if num_seqs is None else num_seqs).astype(jnp.int32).reshape(1))
    # kv_limit [T] (reference.py); causal launches get a never-read placeholder
    meta += (meta[2] if kv_limit is None else kv_limit.astype(jnp.int32),)
    bt = block_tables.astype(jnp.int32).reshape(-1)
    qf = q.reshape(t * hq, d)
    # Unscaled launches get a never-read placeholder for the scales pointer.
    sc = meta[2] if kv_scale is None else kv_scale.astype(jnp.float32).reshape(-1)
    out = jnp.zeros((t * hq, d), q.dtype)
    out_sds = jax.ShapeDtypeStruct(out.shape, out.dtype)
    partial = None
    for kind, name, grid, kw, warps, stages in launch_plan(
            q.shape, k_pages.shape, s_len, max_pages, q.dtype, sm_scale=sm_scale,
            sliding_window=window, soft_cap=soft_cap, cfg=cfg, scaled=kv_scale is not None,
            limited=kv_limit is not None):
        if kind == "direct":
            args = (*meta, bt, qf, k_pages, v_pages, sc, out)
            out = jt.triton_call(*args, kernel=kernels["direct"], out_shape=out_sds, grid=grid,
                                 input_output_aliases={len(args) - 1: 0}, num_warps=warps,
                                 num_stages=stages, name=f"rpa_triton_{name}", **kw)
        elif kind == "split":
            ns, nb, hkv = grid[2], grid[0], grid[1]
            bm = kw["BLOCK_M"]
            partial = jt.triton_call(
                *meta, bt, qf, k_pages, v_pages, sc, kernel=kernels["split"],
                out_shape=(jax.ShapeDtypeStruct((ns, nb, hkv, bm, d), jnp.float32),
                           jax.ShapeDtypeStruct((ns, nb, hkv, bm), jnp.float32)),
                grid=grid, num_warps=warps, num_stages=stages, name=f"rpa_triton_{name}", **kw)
        else:
            args = (*meta, *partial, out)
            out = jt.triton_call(*args, kernel=kernels["combine"], out_shape=out_sds, grid=grid,
                                 input_output_aliases={len(args) - 1: 0}, num_warps=warps,
                                 num_stages=stages, name=f"rpa_triton_{name}_combine", **kw)
    return out.reshape(t, hq, d)


def ragged_paged_attention_torch(q, k_pages, v_pages, query_start, seq_lens, block_tables,
                                 num_seqs=None, *, sm_scale: float,
                                 sliding_window: int | None = None,
                                 soft_cap: float | None = None, kv_scale=None, kv_limit=None,
                                 **tile_params):
    """The same launches on torch tensors: Triton's interpreter on the CPU
    (``TRITON_INTERPRET=1``), or a CUDA device without JAX."""
    import torch

    # Same item size as the torch dtype (tile fitting and the f32 dot precision only).
    dtype = np.float32 if q.dtype == torch.float32 else np.float16
    cfg, window = _prepare(q, k_pages, v_pages, query_start, seq_lens, block_tables,
                           sliding_window, soft_cap, tile_params, dtype)
    t, hq, d = q.shape
    s_len, max_pages = block_tables.shape
    kernels = _kernels()
    dev = q.device
    meta = (query_start.to(torch.int32).contiguous(), seq_lens.to(torch.int32).contiguous(),
            torch.tensor([s_len if num_seqs is None else int(num_seqs)], dtype=torch.int32,
                         device=dev))
    meta += (meta[2] if kv_limit is None else
             torch.as_tensor(kv_limit, dtype=torch.int32, device=dev).contiguous(),)
    bt = block_tables.to(torch.int32).reshape(-1).contiguous()
    qf = q.reshape(t * hq, d).contiguous()
    kp, vp = k_pages.contiguous(), v_pages.contiguous()
    sc = (meta[2] if kv_scale is None else
          torch.as_tensor(kv_scale, dtype=torch.float32, device=dev).reshape(-1).contiguous())
    out = torch.zeros((t * hq, d), dtype=q.dtype, device=dev)
    partial = None
    for kind, _, grid, kw, warps, stages in launch_plan(
            tuple(q.shape), tuple(k_pages.shape), s_len, max_pages, dtype, sm_scale=sm_scale,
            sliding_window=window, soft_cap=soft_cap, cfg=cfg, scaled=kv_scale is not None,
            limited=kv_limit is not None):
        if kind == "direct":
            kernels["direct"][grid](*meta, bt, qf, kp, vp, sc, out, out, num_warps=warps,
                                    num_stages=stages, **kw)
        elif kind == "split":
            ns, nb, hkv = grid[2], grid[0], grid[1]
            partial = (torch.zeros((ns, nb, hkv, kw["BLOCK_M"], d), dtype=torch.float32,
                                   device=dev),
                       torch.zeros((ns, nb, hkv, kw["BLOCK_M"]), dtype=torch.float32,
                                   device=dev))
            kernels["split"][grid](*meta, bt, qf, kp, vp, sc, *partial, num_warps=warps,
                                   num_stages=stages, **kw)
        else:
            kernels["combine"][grid](*meta, *partial, out, out, num_warps=warps,
                                     num_stages=stages, **kw)
    return out.reshape(t, hq, d)
