"""Ragged paged attention as a Pallas Mosaic GPU kernel (Hopper: TMA + WGMMA).

Same arguments and result as :func:`pallas_kernels.reference.ragged_paged_attention` for
bfloat16 / float16 inputs (the tensor cores' WGMMA types) with ``head_dim`` a multiple of 64,
and KV pages in that dtype or float8 (``--kv-cache-dtype fp8``).

How the work is cut:

* **Rows = (token, query head) of one KV head, flattened.** The backend's query layout is
  ``[Hkv, T * G, D]`` (row ``t * G + g``), so the ``G`` heads of a KV head and consecutive
  tokens of a sequence are consecutive rows. A program owns 64 rows (one WGMMA M tile) of one
  sequence: a decode token of GQA-8 fills 8 of them, a prefill chunk ``ceil(len * G / 64)``
  blocks; any group size works, no head padding.
* **Pages by TMA, multi-stage.** A KV step of ``block_kv`` tokens is ``block_kv / page_size``
  page copies (TMA, one per page of the pool ``[Hkv, num_pages, page_size, D]``) into one
  swizzled shared-memory stage; ``num_stages`` steps are in flight while the warpgroup computes.
  The sequence's block-table row is brought into shared memory once per program.
* **QK and PV on the tensor cores** (``plgpu.wgmma``), online softmax in base 2 in registers.
* **Split KV** over the grid's third axis for long contexts; every program writes its rows'
  normalised partial output and log-sum-exp, and one XLA epilogue merges the splits and puts
  the rows back in ``[T, Hq, D]`` order.

KV layout: ``[Hkv, num_pages, page_size, D]`` (the Pallas backend's pool), ``page_size`` a
multiple of 8 dividing ``block_kv``. fp8 KV: the TMA stages hold float8 pages (half the bytes
in flight); each step upcasts its K and V tile in registers into one q-dtype tile in shared
memory that the WGMMAs read (float8 values are exact in bf16/f16). The ``[Hkv, 2]`` scales
ride on the queries (``q * k_scale``, in the XLA prologue that already lays out the rows) and
on the output (``* v_scale``, in the split-merge epilogue), so the kernel body is the same.

Visibility limits (``kv_limit``, reference.py; only when given, else the program is as
without): the XLA prologue lays each row's last visible position out like the query rows and
each block's KV end in its metadata; a program copies its 64 rows' limits to shared memory with
its queries and masks by them.

Known costs outside the kernel (a next step, measured on the GPU first): the query transpose,
the per-block metadata (a few tiny XLA ops) and the split merge / row gather epilogue.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.reference import is_fp8

_MASK = -0.7 * float(jnp.finfo(jnp.float32).max)
_LOG2E = math.log2(math.e)
_ROWS = 64  # WGMMA M tile of one warpgroup
_META = 32  # int32 fields per block (a TMA copy moves a multiple of 128 bytes)


@dataclasses.dataclass(frozen=True)
class MosaicTileConfig:
    """``block_kv``: KV tokens per pipeline stage (a multiple of 64 and of the page size);
    ``num_stages``: stages in flight; ``num_splits=None`` bounds splits from the static shapes
    (``min_kv_per_split`` tokens at least, ~``8 * num_sms`` programs when the bucket is full)."""

    block_kv: int = 64
    num_stages: int = 4
    num_splits: int | None = None
    min_kv_per_split: int = 512
    num_sms: int = 132

    def replace(self, **kw) -> "MosaicTileConfig":
        names = {f.name for f in dataclasses.fields(self)}
        bad = sorted(set(kw) - names)
        if bad:
            raise ValueError(f"unknown tile parameter(s) {bad}; known: {sorted(names)}")
        return dataclasses.replace(self, **kw)


def _cdiv(a, b):
    return (a + b - 1) // b


def _check(q, k_pages, v_pages, query_start, seq_lens, block_tables, cfg: MosaicTileConfig):
    if q.ndim != 3 or k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(f"q must be [T, Hq, D], k/v_pages [Hkv, P, page, D]; got {q.shape}, "
                         f"{k_pages.shape}, {v_pages.shape}")
    t, hq, d = q.shape
    hkv, _, page_size, dk = k_pages.shape
    if dk != d or hq % hkv:
        raise ValueError(f"head_dim {d} vs {dk} / heads {hq} vs {hkv} do not match")
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) or \
            (k_pages.dtype != q.dtype and not is_fp8(k_pages.dtype)):
        raise ValueError(f"the Mosaic GPU kernel takes bfloat16/float16 q and KV pages in q's "
                         f"dtype or float8, got {q.dtype} and {k_pages.dtype}")
    if d % 64:
        raise ValueError(f"head_dim must be a multiple of 64, got {d}")
    if page_size % 8 or cfg.block_kv % 64 or cfg.block_kv % page_size:
        raise ValueError(f"block_kv {cfg.block_kv} must be a multiple of 64 and of page_size "
                         f"{page_size} (a multiple of 8)")
    if cfg.num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {cfg.num_stages}")
    s = seq_lens.shape[0]
    if query_start.shape != (s + 1,) or block_tables.ndim != 2 or block_tables.shape[0] != s:
        raise ValueError("query_start, seq_lens and block_tables disagree on the sequences")


def _block_metadata(query_start, seq_lens, num_seqs, group, nb):
    """``[nb, 32]`` int32 per 64-row block: seq, first row in ``[T * G]``, row offset in its
    sequence, real rows, position of the sequence's first new token (0 padding); and the first
    block of every sequence ``[S]``."""
    s_len = seq_lens.shape[0]
    qs = query_start.astype(jnp.int32)
    q_len = qs[1:] - qs[:-1]
    real = (jnp.arange(s_len) < num_seqs) & (seq_lens > 0) & (q_len > 0)
    nrow = jnp.where(real, q_len * group, 0)
    nblk = _cdiv(nrow, _ROWS)
    end = jnp.cumsum(nblk)
    b = jnp.arange(nb, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(end, b, side="right"), s_len - 1).astype(jnp.int32)
    seq_first = end - nblk  # first block of every sequence
    first = seq_first[seq]
    active = b < end[-1]
    r_rel = (b - first) * _ROWS
    rows = jnp.where(active, jnp.clip(nrow[seq] - r_rel, 0, _ROWS), 0)
    row0 = qs[seq] * group + r_rel
    pos0 = seq_lens[seq] - q_len[seq]
    fields = jnp.stack([seq, row0, r_rel, rows, pos0], axis=1)
    return jnp.pad(fields, ((0, 0), (0, _META - 5))), seq_first


def _widen(x, dtype):
    """float8 registers -> ``dtype``; through float32, the conversion every ptxas has (float8
    values are exact in float32, bf16 and f16)."""
    return x.astype(jnp.float32).astype(dtype)


def _row_limits(kv_limit, query_start, seq_lens, meta, group, t):
    """``kv_limit [T]`` as the kernel reads it: each (token, head) row's last visible position
    ``[T * G + pad]`` (its own position, or its limit where later inside its context), and the
    metadata with field 5, one past the furthest position of each block's rows."""
    qs = query_start.astype(jnp.int32)
    tok = jnp.arange(t, dtype=jnp.int32)
    s_len = seq_lens.shape[0]
    seq_of = jnp.minimum(jnp.searchsorted(qs[1:], tok, side="right"), s_len - 1)
    pos = seq_lens[seq_of] - (qs[seq_of + 1] - qs[seq_of]) + (tok - qs[seq_of])
    hi = jnp.maximum(pos, jnp.minimum(kv_limit.astype(jnp.int32), seq_lens[seq_of] - 1))
    rows = jnp.repeat(hi, group)
    rows = jnp.pad(rows, (0, _cdiv(t * group + _ROWS, 8) * 8 - t * group))
    r = meta[:, 1, None] + jnp.arange(_ROWS, dtype=jnp.int32)[None, :]  # [nb, 64]
    live = jnp.arange(_ROWS)[None, :] < meta[:, 3, None]
    end = jnp.max(jnp.where(live, rows[jnp.minimum(r, rows.shape[0] - 1)], -1), axis=1) + 1
    return rows, meta.at[:, 5].set(end)


def _kernel(meta_ref, bt_ref, q_ref, k_ref, v_ref, *refs, sm_scale, soft_cap,
            sliding_window, group, page_size, block_kv, num_stages, num_splits, min_iters,
            max_pages, num_pages, dtype, kv_dtype, limited):
    import jax.experimental.pallas.mosaic_gpu as plgpu

    head_dim = q_ref.shape[-1]
    pps = block_kv // page_size
    b = lax.axis_index("block")
    h = lax.axis_index("kv_head")
    sp = lax.axis_index("split")
    bt_w = bt_ref.shape[-1]

    upcast = jnp.dtype(kv_dtype) != jnp.dtype(dtype)
    hi_ref = None
    if limited:  # [T * G + pad] each row's last visible position
        hi_ref, refs = refs[0], refs[1:]
    o_ref, lse_ref = refs

    def body(meta_smem, bt_smem, q_smem, k_smem, v_smem, o_smem, lse_smem, bars, *scratch):
        meta_bar, q_bar, k_bars, v_bars = bars
        hi_smem, wide = (scratch[0], scratch[1:]) if limited else (None, scratch)
        plgpu.copy_gmem_to_smem(meta_ref.at[b], meta_smem, meta_bar)
        plgpu.barrier_wait(meta_bar)
        seq, row0, r_rel, nrows, pos0 = (meta_smem[i] for i in range(5))
        plgpu.copy_gmem_to_smem(bt_ref.at[seq], bt_smem, meta_bar)
        plgpu.copy_gmem_to_smem(q_ref.at[h, pl.ds(row0, _ROWS)], q_smem, q_bar)
        if limited:
            plgpu.copy_gmem_to_smem(hi_ref.at[pl.ds(row0, _ROWS)], hi_smem, q_bar)

        # KV tokens this block needs: up to its last row's position (or furthest limit); from
        # the window start.
        hi_tok = pos0 + lax.div(r_rel + nrows - 1, group) + 1
        if limited:
            hi_tok = jnp.maximum(hi_tok, meta_smem[5])
        if sliding_window is None:
            lo_tok = jnp.int32(0)
        else:
            lo_tok = jnp.maximum(pos0 + lax.div(r_rel, group) - sliding_window + 1, 0)
        kv_lo = lax.div(lo_tok, jnp.int32(page_size)) * page_size
        nkv = jnp.where(nrows > 0, lax.div(hi_tok - kv_lo + block_kv - 1, block_kv), 0)
        bps = jnp.maximum(lax.div(nkv + num_splits - 1, num_splits), min_iters)
        it_lo = jnp.minimum(sp * bps, nkv)
        it_hi = jnp.minimum(it_lo + bps, nkv)
        plgpu.barrier_wait(meta_bar)  # the block-table row

        def issue(it, slot):
            first_col = lax.div(kv_lo, jnp.int32(page_size)) + it * pps
            for j in range(pps):
                # Columns past the table only feed masked positions: clamp, don't pad.
                col = jnp.minimum(first_col + j, max_pages - 1)
                page = jnp.clip(bt_smem[lax.div(col, bt_w), lax.rem(col, bt_w)]
                                if bt_smem.ndim == 2 else bt_smem[col], 0, num_pages - 1)
                dst = pl.ds(j * page_size, page_size)
                plgpu.copy_gmem_to_smem(k_ref.at[h, page], k_smem.at[slot, dst],
                                        k_bars.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[h, page], v_smem.at[slot, dst],
                                        v_bars.at[slot])

        for s in range(num_stages):
            pl.when(it_lo + s < it_hi)(functools.partial(issue, it_lo + s, s))
        plgpu.barrier_wait(q_bar)

        wg = plgpu.Layout.WGMMA
        row_pos = pos0 + lax.div(
            r_rel + plgpu.broadcasted_iota(jnp.int32, (_ROWS, block_kv), 0, layout=wg), group)
        row_ok = plgpu.broadcasted_iota(jnp.int32, (_ROWS, block_kv), 0, layout=wg) < nrows
        row_hi = row_pos
        if limited:
            row_hi = lax.broadcast_in_dim(plgpu.load(hi_smem, (), layout=wg.reduce(1)),
                                          (_ROWS, block_kv), [0])
        col_iota = plgpu.broadcasted_iota(jnp.int32, (_ROWS, block_kv), 1, layout=wg)

        def step(it, carry):
            acc, m_i, l_i = carry
            slot = lax.rem(it - it_lo, jnp.int32(num_stages))
            plgpu.barrier_wait(k_bars.at[slot])

            k_tile = k_smem.at[slot]
            if upcast:  # float8 stage -> q-dtype tile for the WGMMA (the previous one is done)
                wide[0][...] = _widen(k_tile[...], dtype)
                plgpu.commit_smem()
                k_tile = wide[0]

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_tile.T)
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((_ROWS, block_kv), jnp.float32)) * sm_scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            s = s * _LOG2E
            kv_pos = kv_lo + it * block_kv + col_iota
            mask = row_ok & (kv_pos <= row_hi)
            if sliding_window is not None:
                mask = mask & (kv_pos > row_pos - sliding_window)
            s = jnp.where(mask, s, _MASK)
            m_new = jnp.maximum(m_i, s.max(axis=1))
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            p = jnp.where(mask, p, 0.0)
            l_new = l_i * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            plgpu.barrier_wait(v_bars.at[slot])
            v_tile = v_smem.at[slot]
            if upcast:
                wide[1][...] = _widen(v_tile[...], dtype)
                plgpu.commit_smem()
                v_tile = wide[1]

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p.astype(dtype), v_tile)

            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            # The stage is free again (both WGMMAs done): refill it.
            nxt = it + num_stages
            pl.when(nxt < it_hi)(functools.partial(issue, nxt, slot))
            return acc, m_new, l_new

        acc = plgpu.layout_cast(jnp.zeros((_ROWS, head_dim), jnp.float32), wg)
        m_i = plgpu.layout_cast(jnp.full((_ROWS,), _MASK, jnp.float32), wg.reduce(1))
        l_i = plgpu.layout_cast(jnp.zeros((_ROWS,), jnp.float32), wg.reduce(1))
        acc, m_i, l_i = lax.fori_loop(it_lo, it_hi, step, (acc, m_i, l_i))
        has = l_i > 0.0
        l_safe = jnp.where(has, l_i, 1.0)
        o_smem[...] = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
        lse_smem[...] = jnp.where(has, m_i + jnp.log2(l_safe), _MASK)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[sp, b, h])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[sp, b, h])
        plgpu.wait_smem_to_gmem(0)

    def smem_transforms(dt):
        itemsize = jnp.dtype(dt).itemsize
        swz = 128 if head_dim * itemsize >= 128 else 64
        return (plgpu.TilingTransform((8, swz // itemsize)), plgpu.SwizzleTransform(swz))

    transforms, kv_transforms = smem_transforms(dtype), smem_transforms(kv_dtype)
    wide_tiles = [plgpu.SMEM((block_kv, head_dim), dtype, transforms=transforms)
                  for _ in range(2)]
    pl.run_scoped(
        body,
        plgpu.SMEM((_META,), jnp.int32),
        plgpu.SMEM(bt_ref.shape[1:], jnp.int32),
        plgpu.SMEM((_ROWS, head_dim), dtype, transforms=transforms),
        plgpu.SMEM((num_stages, block_kv, head_dim), kv_dtype, transforms=kv_transforms),
        plgpu.SMEM((num_stages, block_kv, head_dim), kv_dtype, transforms=kv_transforms),
        plgpu.SMEM((_ROWS, head_dim), jnp.float32),
        plgpu.SMEM((_ROWS,), jnp.float32),
        (plgpu.Barrier(num_arrivals=1), plgpu.Barrier(num_arrivals=1),
         plgpu.Barrier(num_arrivals=pps, num_barriers=num_stages),
         plgpu.Barrier(num_arrivals=pps, num_barriers=num_stages)),
        *((plgpu.SMEM((_ROWS,), jnp.int32),) if limited else ()),
        *(wide_tiles if upcast else ()),
    )


def fit_stages(cfg: MosaicTileConfig, head_dim, itemsize, bt_entries, budget=220 * 1024,
               kv_itemsize=None):
    """The configured stage count, lowered until the kernel's shared memory fits Hopper's
    227 KB per block (q tile, f32 output tile, block-table row, K and V stages, and with
    float8 pages (``kv_itemsize`` 1) the two upcast K/V tiles)."""
    kv_itemsize = itemsize if kv_itemsize is None else kv_itemsize
    fixed = _META * 4 + bt_entries * 4 + _ROWS * head_dim * (itemsize + 4) + _ROWS * 4 + 1024
    if kv_itemsize != itemsize:
        fixed += 2 * cfg.block_kv * head_dim * itemsize
    per_stage = 2 * cfg.block_kv * head_dim * kv_itemsize
    stages = min(cfg.num_stages, (budget - fixed) // per_stage)
    if stages < 1:
        raise ValueError(f"block_kv {cfg.block_kv} x head_dim {head_dim} does not fit shared "
                         "memory; use a smaller block_kv")
    return stages


def call_grid(t, hq, hkv, s_len, max_pages, page_size, cfg: MosaicTileConfig):
    """Static ``(num_blocks, num_splits, min_iters)`` of a step bucket."""
    group = hq // hkv
    nb = _cdiv(t * group, _ROWS) + s_len  # every row's blocks, each row's last one partial
    if cfg.num_splits is None:
        by_len = _cdiv(max_pages * page_size, cfg.min_kv_per_split)
        by_grid = _cdiv(8 * cfg.num_sms, nb * hkv)
        ns = max(1, min(16, by_len, by_grid))
    else:
        ns = max(1, cfg.num_splits)
    return nb, ns, max(1, cfg.min_kv_per_split // cfg.block_kv)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "cfg"))
def _ragged_paged_attention(q, k_pages, v_pages, query_start, seq_lens, block_tables, num_seqs,
                            kv_scale, kv_limit, *, sm_scale, sliding_window, soft_cap,
                            cfg: MosaicTileConfig):
    import jax.experimental.pallas.mosaic_gpu as plgpu

    t, hq, d = q.shape
    hkv, num_pages, page_size, _ = k_pages.shape
    group = hq // hkv
    s_len, max_pages = block_tables.shape
    nb, ns, min_iters = call_grid(t, hq, hkv, s_len, max_pages, page_size, cfg)
    nseq = jnp.int32(s_len) if num_seqs is None else jnp.asarray(num_seqs, jnp.int32)
    meta, first_blk = _block_metadata(query_start, seq_lens.astype(jnp.int32), nseq, group, nb)
    limits = ()
    if kv_limit is not None:
        hi_rows, meta = _row_limits(kv_limit, query_start, seq_lens.astype(jnp.int32), meta,
                                    group, t)
        limits = (hi_rows,)
    # Block-table rows padded to 128 bytes (TMA) and cut into <= 256-entry TMA boxes.
    mp = _cdiv(max_pages, 32) * 32
    if mp > 256:
        mp = _cdiv(mp, 256) * 256
    bt = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, mp - max_pages)))
    if mp > 256:
        bt = bt.reshape(s_len, mp // 256, 256)
    cfg = cfg.replace(num_stages=fit_stages(cfg, d, q.dtype.itemsize, mp,
                                            kv_itemsize=k_pages.dtype.itemsize))
    q_rows = q.reshape(t, hkv, group, d)
    if kv_scale is not None:  # scores come out times k_scale (float32, then q's dtype)
        q_rows = (q_rows.astype(jnp.float32) * kv_scale[:, 0, None, None].astype(jnp.float32)
                  ).astype(q.dtype)
    q_rows = q_rows.transpose(1, 0, 2, 3).reshape(hkv, t * group, d)
    # A block reads 64 rows from its first: rows padded so every read is in bounds and the
    # row count is a multiple of TMA's 8-row tiling.
    q_rows = jnp.pad(q_rows, ((0, 0), (0, _cdiv(t * group + _ROWS, 8) * 8 - t * group), (0, 0)))

    kernel = functools.partial(
        _kernel, sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
        group=group, page_size=page_size, block_kv=cfg.block_kv, num_stages=cfg.num_stages,
        num_splits=ns, min_iters=min_iters, max_pages=max_pages, num_pages=num_pages,
        dtype=q.dtype, kv_dtype=k_pages.dtype, limited=kv_limit is not None)
    # The kernel's name in profiles and HLO (plgpu.kernel names it after the body).
    kernel.__name__ = f"rpa_mosaic_kv{cfg.block_kv}_st{cfg.num_stages}_s{ns}"
    o_part, lse = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((ns, nb, hkv, _ROWS, d), jnp.float32),
                  jax.ShapeDtypeStruct((ns, nb, hkv, _ROWS), jnp.float32)),
        grid=(nb, hkv, ns),
        grid_names=("block", "kv_head", "split"),
        # The body is written in lane semantics (explicit WGMMA register layouts, per-thread
        # masks); jax 0.11 made warpgroup semantics the default, so name it.
        compiler_params=plgpu.CompilerParams(
            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
    )(meta, bt, q_rows, k_pages, v_pages, *limits)

    # Merge the splits (base-2 log-sum-exp weights), then rows back to [T, Hq, D].
    m = jnp.max(lse, axis=0, keepdims=True)
    w = jnp.exp2(lse - m)
    out_blk = jnp.sum(o_part * w[..., None], axis=0) / jnp.maximum(jnp.sum(w, 0), 1e-30)[..., None]
    if kv_scale is not None:  # [nb, Hkv, rows, D] times each KV head's V scale
        out_blk = out_blk * kv_scale[None, :, 1, None, None].astype(jnp.float32)
    qs = query_start.astype(jnp.int32)
    tok = jnp.arange(t, dtype=jnp.int32)
    seq_of = jnp.minimum(jnp.searchsorted(qs[1:], tok, side="right"), s_len - 1)
    rel = (tok - qs[seq_of])[:, None] * group + jnp.arange(group, dtype=jnp.int32)[None, :]
    blk = jnp.clip(first_blk[seq_of][:, None] + rel // _ROWS, 0, nb - 1)  # [T, G]
    heads = jnp.arange(hkv, dtype=jnp.int32)[None, :, None]
    rows = out_blk[blk[:, None, :], heads, (rel % _ROWS)[:, None, :]]  # [T, Hkv, G, D]
    tok_ok = (tok < qs[-1]) & (seq_of < nseq) & (seq_lens[seq_of] > 0)
    out = jnp.where(tok_ok[:, None, None, None], rows, 0.0)
    return out.reshape(t, hq, d).astype(q.dtype)


def ragged_paged_attention(q, k_pages, v_pages, query_start, seq_lens, block_tables,
                           num_seqs=None, *, sm_scale: float, sliding_window: int | None = None,
                           soft_cap: float | None = None, kv_scale=None, kv_limit=None,
                           **tile_params):
    """Causal attention of every new token against its sequence's pages (see reference.py),
    on Hopper's TMA and tensor cores. ``kv_scale``: optional ``[Hkv, 2]`` scales of float8
    pages; ``kv_limit``: optional ``[T]`` last visible key position of each token.
    ``tile_params`` override :class:`MosaicTileConfig`."""
    cfg = MosaicTileConfig().replace(**tile_params)
    _check(q, k_pages, v_pages, query_start, seq_lens, block_tables, cfg)
    if sliding_window is not None and int(sliding_window) < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if soft_cap is not None and float(soft_cap) <= 0:
        raise ValueError(f"soft_cap must be > 0, got {soft_cap}")
    return _ragged_paged_attention(
        q, k_pages, v_pages, query_start, seq_lens, block_tables, num_seqs, kv_scale, kv_limit,
        sm_scale=float(sm_scale),
        sliding_window=None if sliding_window is None else int(sliding_window),
        soft_cap=None if soft_cap is None else float(soft_cap), cfg=cfg)
