"""Ragged paged attention as a Pallas kernel (Triton lowering on GPU, ``interpret=True`` on CPU).

Drop-in for :func:`pallas_kernels.reference.ragged_paged_attention`: same arguments, same result.

How the work is cut (all grid sizes come from static shapes; per-sequence work is dynamic):

* **Rows = tokens x query heads of one KV head.** The ``G`` query heads that share a KV head are
  processed together (padded to a power of two ``Gp``), so a KV page is read once per group and
  the matmul's M dimension is ``block_q * Gp`` even for a single decode token.
* **Two calls of one kernel body.** Sequences with at most ``block_q`` new tokens (decodes, short
  spec-decode rows) go to the *decode* call: one query block per sequence, KV split over up to
  ``num_splits`` programs (flash-decoding) whose partial results a small combine kernel reduces.
  Longer rows (prefill chunks) go to the *prefill* call: one program per (query block, KV head),
  walking the pages from the window start up to the block's causal end.
* **KV rows gathered by slot.** The pool is viewed as ``[Hkv, num_pages * page_size, D]`` (a
  free reshape) and each KV step gathers its ``block_kv`` rows through the block table, so the
  step size is independent of the page size and no 3-D page tile has to be reshaped.
* **Nothing around the kernels.** Each program reads the step metadata itself: a decode program
  its row by index, a prefill program its (row, query block) by a prefix sum over the rows in
  registers. Queries are gathered from the flat ``[T * Hq, D]`` array and results scattered into
  the flat output (masked stores, the output aliased through the calls in place), so a call is
  free reshapes + one zero fill + 2-3 kernels: no XLA metadata ops, while loops, layout copies
  or output gathers, which at short contexts cost more than the attention.
* **Padding costs nothing.** Query blocks that belong to no sequence, empty splits and padding
  rows exit before touching memory; the KV loop's trip count is bounded by each sequence's
  ``seq_lens`` (and sliding window). Padded tokens keep the output's zeros.
* **Visibility limits** (``kv_limit``, reference.py): a step ref of its own, present only when
  given (the text-only programs are unchanged); a block's KV walk then ends at its tokens'
  furthest limit, and the mask reads each row's.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_LOG2E = math.log2(math.e)
_MASK = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: no inf - inf = nan in the online softmax

# jax 0.10.x and 0.11.x name the Triton compiler params `CompilerParams`; older releases called
# them `TritonCompilerParams`. Explicit params are what lets `jax.export` lower for CUDA on CPU.
_TritonParams = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams")


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Tile sizes of both calls. Defaults target Hopper (H100: 132 SMs, 50 MB L2, ~3 TB/s).

    ``*_block_m`` is the number of (token x query head) rows per program; ``*_block_kv`` the KV
    tokens per inner step (a power of two; pages may straddle it). ``decode_num_splits=None``
    bounds the split count from the static shapes (context, bucket: ~8 programs per SM when the
    bucket is full) and picks it at run time from the real rows, aiming at ~4 programs per SM;
    a split never covers less than ``decode_min_kv_per_split`` KV tokens.
    """

    decode_block_m: int = 16
    decode_block_kv: int = 64
    decode_num_splits: int | None = None
    decode_min_kv_per_split: int = 512
    decode_num_warps: int = 4
    decode_num_stages: int = 2
    prefill_block_m: int = 64
    prefill_block_kv: int = 64
    prefill_num_splits: int = 1
    prefill_num_warps: int = 4
    prefill_num_stages: int = 2
    combine_num_warps: int = 4
    num_sms: int = 132

    def replace(self, **kw) -> "TileConfig":
        names = {f.name for f in dataclasses.fields(self)}
        bad = sorted(set(kw) - names)
        if bad:
            raise ValueError(f"unknown tile parameter(s) {bad}; known: {sorted(names)}")
        kw = {k: v for k, v in kw.items() if v is not None or k == "decode_num_splits"}
        return dataclasses.replace(self, **kw)


def default_tiles(head_dim: int, dtype) -> TileConfig:
    """Hopper defaults, shrunk where K/V tiles x stages would not fit in shared memory."""
    itemsize = jnp.dtype(dtype).itemsize
    cfg = TileConfig()
    # K and V tiles per pipeline stage; keep <= ~96 KB so two programs fit per SM.
    budget = 96 * 1024

    def fit(kv, stages):
        """Halve the KV tile down to 16, then drop pipeline stages (head_dim 512 in f32)."""
        while kv > 16 and 2 * kv * head_dim * itemsize * stages > budget:
            kv //= 2
        while stages > 1 and 2 * kv * head_dim * itemsize * stages > budget:
            stages -= 1
        return kv, stages

    warps = 8 if head_dim * itemsize >= 512 else 4
    prefill_kv, prefill_stages = fit(cfg.prefill_block_kv, cfg.prefill_num_stages)
    decode_kv, decode_stages = fit(cfg.decode_block_kv, cfg.decode_num_stages)
    return cfg.replace(
        prefill_block_kv=prefill_kv, prefill_num_stages=prefill_stages,
        decode_block_kv=decode_kv, decode_num_stages=decode_stages,
        prefill_num_warps=warps,
    )


def _is_pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _cdiv(a, b):
    return (a + b - 1) // b


@dataclasses.dataclass(frozen=True)
class _CallShape:
    """Static shape of one pallas_call (decode or prefill)."""

    block_m: int  # rows per program (tokens x Gp)
    block_q: int  # tokens per program
    block_kv: int  # KV tokens per inner step (any power of two >= 16; pages may straddle it)
    num_blocks: int  # query blocks in the grid
    num_splits: int
    num_warps: int
    num_stages: int


def call_shapes(t, hq, hkv, page_size, s_len, max_pages, head_dim, cfg: TileConfig):
    """Static shapes of the decode and prefill calls of a step bucket (shared by every backend
    that cuts the work this way): ``(decode, prefill, split_target, min_iters)``."""
    gp = _next_pow2(hq // hkv)
    bm_dec = max(cfg.decode_block_m, gp)
    bq_dec = bm_dec // gp
    bm_pre = max(cfg.prefill_block_m, gp)
    bq_pre = bm_pre // gp
    max_ctx = max_pages * page_size
    if cfg.decode_num_splits is None:
        # Grid bound: no more splits than the longest context allows, partial results of at most
        # ~64 MB, and ~8 programs per SM when every row of the bucket is a decode (so a full
        # bucket launches few programs that exit at once). The count used is picked at run time
        # from the real rows (`_kv_range`), aiming at ~4 programs per SM.
        by_len = _cdiv(max_ctx, cfg.decode_min_kv_per_split)
        by_mem = (64 << 20) // max(1, s_len * hkv * bm_dec * head_dim * 4)
        by_grid = _cdiv(8 * cfg.num_sms, s_len * hkv)
        ns_dec = max(1, min(16, by_len, by_mem, by_grid))
        split_target = 4 * cfg.num_sms
    else:
        ns_dec = max(1, cfg.decode_num_splits)
        split_target = 0
    n_long_max = min(s_len, t // (bq_dec + 1))
    nb_pre = t // bq_pre + n_long_max if n_long_max else 0
    dec = _CallShape(bm_dec, bq_dec, cfg.decode_block_kv, s_len, ns_dec, cfg.decode_num_warps,
                     cfg.decode_num_stages)
    pre = _CallShape(bm_pre, bq_pre, cfg.prefill_block_kv, nb_pre, max(1, cfg.prefill_num_splits),
                     cfg.prefill_num_warps, cfg.prefill_num_stages)
    min_iters = max(1, _cdiv(cfg.decode_min_kv_per_split, cfg.decode_block_kv))
    return dec, pre, split_target, min_iters


def _decode_row(b, qs_ref, sl_ref, nseq_ref, *, bq):
    """(seq, q0, qn, pos0) of decode block ``b`` (block index == sequence index), read straight
    from the step metadata: no per-call metadata arrays are built by XLA ops around the call."""
    q0 = qs_ref[b]
    q_len = qs_ref[b + 1] - q0
    sl = sl_ref[b]
    ok = (b < nseq_ref[0]) & (sl > 0) & (q_len > 0) & (q_len <= bq)
    return b, q0, jnp.where(ok, q_len, 0), sl - q_len


def _prefill_row(b, qs_ref, sl_ref, nseq_ref, *, bq, bq_dec, s_len):
    """(seq, q0, qn, pos0) of prefill block ``b``. The long rows' query blocks are numbered
    consecutively; a program finds its row with a prefix sum over all rows (``S`` ints in
    registers), so nothing is computed per call outside the kernel."""
    sp = max(16, _next_pow2(s_len))
    i = lax.broadcasted_iota(jnp.int32, (sp,), 0)
    ic = jnp.minimum(i, s_len - 1)
    lo = qs_ref[ic]
    q_len = qs_ref[ic + 1] - lo
    sl = sl_ref[ic]
    ok = (i < s_len) & (i < nseq_ref[0]) & (sl > 0) & (q_len > bq_dec)
    nblk = jnp.where(ok, lax.div(q_len + (bq - 1), jnp.int32(bq)), 0)
    end = jnp.cumsum(nblk)  # exclusive end block of every row
    seq = jnp.minimum(jnp.sum((end <= b).astype(jnp.int32)), s_len - 1)
    first = jnp.sum(jnp.where(i == seq, end - nblk, 0))
    active = b < jnp.sum(nblk)
    q0_seq = qs_ref[seq]
    q_len_s = qs_ref[seq + 1] - q0_seq
    j = (b - first) * bq
    qn = jnp.where(active, jnp.clip(q_len_s - j, 0, bq), 0)
    return seq, q0_seq + j, qn, sl_ref[seq] - q_len_s + j


def _limits(lim_ref, sl_ref, seq, q0, qn, pos0, *, block_m, gp):
    """Each row's last visible position (``[block_m, 1]``: its token's position or, where
    later, its ``kv_limit`` inside the row's context) and the block's KV end (one past the
    furthest)."""
    rows = lax.broadcasted_iota(jnp.int32, (block_m,), 0)
    tok = lax.div(rows, jnp.int32(gp))
    lim = lim_ref[jnp.clip(q0 + tok, 0, lim_ref.shape[0] - 1)]
    hi = jnp.maximum(pos0 + tok, jnp.minimum(lim, sl_ref[seq] - 1))
    end = jnp.maximum(pos0 + qn, jnp.max(jnp.where(tok < qn, hi, -1)) + 1)
    return hi[:, None], end


def _kv_range(pos0, qn, sp, nseq_ref, hi_tok=None, *, page_size, block_kv, sliding_window,
              num_splits, split_target, hkv, min_iters):
    """KV steps ``[it_lo, it_hi)`` of split ``sp``, the first KV token and the split count;
    ``hi_tok``: one past the block's last visible KV position (default: causal)."""
    if hi_tok is None:
        hi_tok = pos0 + qn
    if sliding_window is None:
        lo_tok = jnp.int32(0)
    else:
        lo_tok = jnp.maximum(pos0 - sliding_window + 1, 0)
    kv_lo = lax.div(lo_tok, jnp.int32(page_size)) * page_size  # page-aligned start
    nkv = jnp.where(qn > 0, lax.div(hi_tok - kv_lo + (block_kv - 1), jnp.int32(block_kv)), 0)
    if num_splits > 1 and split_target:
        # Run-time split count: about `split_target` programs over the real rows' (row, KV
        # head) pairs, never more than the grid's `num_splits`.
        work = jnp.maximum(nseq_ref[0] * hkv, 1)
        splits = jnp.clip(lax.div(split_target + work - 1, work), 1, num_splits)
    else:
        splits = jnp.int32(num_splits)
    bps = jnp.maximum(lax.div(nkv + splits - 1, splits), min_iters)
    it_lo = sp * bps
    it_hi = jnp.minimum(it_lo + bps, nkv)
    nsplit = lax.div(nkv + bps - 1, bps)
    return it_lo, it_hi, kv_lo, nsplit


def _col_iota(n):
    # Stores index both dimensions with arrays (interpret mode cannot mix arrays and slices).
    return lax.broadcasted_iota(jnp.int32, (1, n), 1)


def _row_index(q0, qn, h, *, block_m, gp, group, hq, num_rows):
    """Row of every (token, query head) of a block in the flat ``[T * Hq, D]`` q and output,
    whether it is real, and its token offset in the block."""
    rows = lax.broadcasted_iota(jnp.int32, (block_m,), 0)
    tok = lax.div(rows, jnp.int32(gp))
    head = lax.rem(rows, jnp.int32(gp))
    ok = (tok < qn) & (head < group)
    idx = jnp.clip((q0 + tok) * hq + h * group + head, 0, num_rows - 1)
    # Rows that are not real get distinct indices past the end: masked off on the GPU, and
    # dropped (never duplicating a real row) by interpret mode's scatter.
    return jnp.where(ok, idx, num_rows + rows), ok, tok


def _attn_kernel(
    qs_ref, sl_ref, nseq_ref, *refs,
    row_fn, kv_kw, block_m, sm_scale, soft_cap, sliding_window, group, gp, hq, page_size,
    block_kv, max_pages, direct, scaled, limited,
):
    """One (query block, KV head, split): online softmax over this split's KV pages.

    ``limited``: the first ref after the step metadata is ``kv_limit [T]``. ``scaled``: the
    ref after the pages holds the float8 pages' K/V scales, flat ``[Hkv * 2]``."""
    b = pl.program_id(0)
    h = pl.program_id(1)
    sp = pl.program_id(2)
    lim_ref = None
    if limited:
        lim_ref, refs = refs[0], refs[1:]
    bt_ref, q_ref, k_ref, v_ref, *refs = refs
    k_scale = v_scale = None
    if scaled:
        k_scale, v_scale = refs[0][2 * h], refs[0][2 * h + 1]
        refs = refs[1:]
    seq, q0, qn, pos0 = row_fn(b, qs_ref, sl_ref, nseq_ref)
    row_hi = hi_tok = None
    if limited:
        row_hi, hi_tok = _limits(lim_ref, sl_ref, seq, q0, qn, pos0, block_m=block_m, gp=gp)
    it_lo, it_hi, kv_lo, _ = _kv_range(pos0, qn, sp, nseq_ref, hi_tok, **kv_kw)

    @pl.when(it_hi > it_lo)
    def _():
        head_dim = q_ref.shape[-1]
        num_pages = k_ref.shape[0] // page_size
        idx, row_ok, tok = _row_index(q0, qn, h, block_m=block_m, gp=gp, group=group, hq=hq,
                                      num_rows=q_ref.shape[0])
        # [block_m, D] gathered from the flat [T * Hq, D] queries (rows not real read row 0).
        q = q_ref[jnp.where(row_ok, idx, 0)]
        q_pos = (pos0 + tok)[:, None]
        row_ok2 = row_ok[:, None]
        cols = lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
        kv_rows = lax.broadcasted_iota(jnp.int32, (block_kv,), 0)
        bt_row = seq * max_pages
        qk_scale = sm_scale if k_scale is None else sm_scale * k_scale

        def step(it, carry, masked):
            acc, m_i, l_i = carry
            kv0 = kv_lo + it * block_kv
            kv_tok = kv0 + kv_rows  # [block_kv] positions in the sequence
            ps = jnp.int32(page_size)
            # Columns past the table's end only feed masked positions: clamp, don't pad.
            col = jnp.minimum(lax.div(kv_tok, ps), max_pages - 1)
            pages = bt_ref[bt_row + col]  # page of every row (cached, tiny)
            pages = jnp.clip(pages, 0, num_pages - 1)  # a bad table must not fault the GPU
            slots = pages * ps + lax.rem(kv_tok, ps)
            # [block_kv, D] rows gathered straight from the pool; float8 pages are upcast
            # in registers, their K scale rides on the scores and V scale on the output
            k = k_ref[slots].astype(q.dtype)
            v = v_ref[slots].astype(q.dtype)
            s = lax.dot_general(
                q, k, (((1,), (1,)), ((), ())),
                precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32,
            ) * qk_scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            s = s * _LOG2E  # base-2 units from here on
            if masked:
                kv_pos = kv0 + cols
                mask = row_ok2 & (kv_pos <= (q_pos if row_hi is None else row_hi))
                if sliding_window is not None:
                    mask = mask & (kv_pos > q_pos - sliding_window)
                s = jnp.where(mask, s, _MASK)
            m_new = jnp.maximum(m_i, jnp.max(s, axis=1, keepdims=True))
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(s - m_new)
            if masked:
                p = jnp.where(mask, p, 0.0)
            l_new = alpha * l_i + jnp.sum(p, axis=1, keepdims=True)
            pv = lax.dot_general(
                p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32,
            )
            return acc * alpha + pv, m_new, l_new

        acc0 = jnp.zeros((block_m, head_dim), jnp.float32)
        m0 = jnp.full((block_m, 1), _MASK, jnp.float32)
        l0 = jnp.zeros((block_m, 1), jnp.float32)
        carry = (acc0, m0, l0)
        if sliding_window is None:
            # KV steps wholly at or before the block's first query position need no mask (rows
            # past the block's tokens compute garbage that is never stored); the rest are masked.
            n_full = lax.div(pos0 + 1 - kv_lo, jnp.int32(block_kv))
            mid = jnp.clip(n_full, it_lo, it_hi)
            carry = lax.fori_loop(it_lo, mid, functools.partial(step, masked=False), carry)
        else:
            mid = it_lo
        acc, m_i, l_i = lax.fori_loop(mid, it_hi, functools.partial(step, masked=True), carry)
        has = l_i > 0.0
        out = acc / jnp.where(has, l_i, 1.0)
        if v_scale is not None:
            out = out * v_scale
        if direct:
            # Masked scatter of the real rows into the flat output; refs[0] is its aliased input.
            o_ref = refs[1]
            plgpu.store(o_ref.at[idx[:, None], _col_iota(head_dim)], out.astype(o_ref.dtype),
                        mask=row_ok2)
        else:
            o_ref, lse_ref = refs
            o_ref[...] = out
            lse = jnp.where(has, m_i + jnp.log2(jnp.where(has, l_i, 1.0)), _MASK)
            lse_ref[...] = lse.reshape(block_m)


def _combine_kernel(qs_ref, sl_ref, nseq_ref, *refs, row_fn, kv_kw, block_m, gp, group, hq,
                    limited):
    """Merge the splits of one (row, KV head) into the flat output; reads only splits that ran."""
    b = pl.program_id(0)
    h = pl.program_id(1)
    hi_tok = None
    seq, q0, qn, pos0 = row_fn(b, qs_ref, sl_ref, nseq_ref)
    if limited:
        _, hi_tok = _limits(refs[0], sl_ref, seq, q0, qn, pos0, block_m=block_m, gp=gp)
        refs = refs[1:]
    o_ref, lse_ref, _alias_ref, out_ref = refs
    _, _, _, nsplit = _kv_range(pos0, qn, 0, nseq_ref, hi_tok, **kv_kw)
    head_dim = o_ref.shape[-1]

    @pl.when(nsplit > 0)
    def _():
        def body(i, carry):
            acc, m_i, l_i = carry
            lse = lse_ref[i].reshape(block_m, 1)
            o = o_ref[i]
            m_new = jnp.maximum(m_i, lse)
            alpha = jnp.exp2(m_i - m_new)
            w = jnp.exp2(lse - m_new)
            return acc * alpha + o * w, m_new, l_i * alpha + w

        acc0 = jnp.zeros((block_m, head_dim), jnp.float32)
        m0 = jnp.full((block_m, 1), _MASK, jnp.float32)
        l0 = jnp.zeros((block_m, 1), jnp.float32)
        acc, _, l_i = lax.fori_loop(0, nsplit, body, (acc0, m0, l0))
        out = (acc / jnp.where(l_i > 0, l_i, 1.0)).astype(out_ref.dtype)
        idx, row_ok, _ = _row_index(q0, qn, h, block_m=block_m, gp=gp, group=group, hq=hq,
                                    num_rows=out_ref.shape[0])
        plgpu.store(out_ref.at[idx[:, None], _col_iota(head_dim)], out, mask=row_ok[:, None])


def _run_call(out, step_refs, bt_flat, q_flat, k_flat, v_flat, scales, shape: _CallShape,
              row_fn, kv_kw, *,
              page_size, sm_scale, soft_cap, sliding_window, group, gp, hq, max_pages,
              interpret, name):
    """One pallas_call (+ combine when split); writes its rows into ``out`` (aliased, in place)."""
    hkv, num_slots, d = k_flat.shape
    nb, bm, ns = shape.num_blocks, shape.block_m, shape.num_splits
    direct = ns == 1
    kernel = functools.partial(
        _attn_kernel, row_fn=row_fn, kv_kw=kv_kw, block_m=bm, sm_scale=sm_scale,
        soft_cap=soft_cap, sliding_window=sliding_window, group=group, gp=gp, hq=hq,
        page_size=page_size, block_kv=shape.block_kv, max_pages=max_pages, direct=direct,
        scaled=scales is not None, limited=len(step_refs) > 3,
    )
    whole = lambda arr: pl.BlockSpec(arr.shape, lambda *_: (0,) * arr.ndim)
    in_specs = [whole(a) for a in step_refs] + [
        whole(bt_flat),
        whole(q_flat),
        pl.BlockSpec((None, num_slots, d), lambda b, h, s: (h, 0, 0)),
        pl.BlockSpec((None, num_slots, d), lambda b, h, s: (h, 0, 0)),
    ]
    params = _TritonParams(num_warps=shape.num_warps, num_stages=shape.num_stages)
    args = (*step_refs, bt_flat, q_flat, k_flat, v_flat)
    if scales is not None:
        in_specs.append(whole(scales))
        args += (scales,)
    if direct:
        return pl.pallas_call(
            kernel, grid=(nb, hkv, 1), in_specs=in_specs + [whole(out)], out_specs=whole(out),
            out_shape=jax.ShapeDtypeStruct(out.shape, out.dtype),
            input_output_aliases={len(args): 0}, compiler_params=params, interpret=interpret,
            name=f"{name}_bm{bm}_kv{shape.block_kv}_s1",
        )(*args, out)
    o_part, lse_part = pl.pallas_call(
        kernel,
        grid=(nb, hkv, ns),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, None, bm, d), lambda b, h, s: (s, b, h, 0, 0)),
            pl.BlockSpec((None, None, None, bm), lambda b, h, s: (s, b, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((ns, nb, hkv, bm, d), jnp.float32),
            jax.ShapeDtypeStruct((ns, nb, hkv, bm), jnp.float32),
        ],
        compiler_params=params, interpret=interpret,
        name=f"{name}_bm{bm}_kv{shape.block_kv}_s{ns}",
    )(*args)
    combine = functools.partial(_combine_kernel, row_fn=row_fn, kv_kw=kv_kw, block_m=bm, gp=gp,
                                group=group, hq=hq, limited=len(step_refs) > 3)
    step_specs = [pl.BlockSpec(a.shape, lambda b, h, nd=a.ndim: (0,) * nd) for a in step_refs]
    return pl.pallas_call(
        combine,
        grid=(nb, hkv),
        in_specs=step_specs + [
            pl.BlockSpec((ns, None, None, bm, d), lambda b, h: (0, b, h, 0, 0)),
            pl.BlockSpec((ns, None, None, bm), lambda b, h: (0, b, h, 0)),
            pl.BlockSpec(out.shape, lambda b, h: (0, 0)),
        ],
        out_specs=pl.BlockSpec(out.shape, lambda b, h: (0, 0)),
        out_shape=jax.ShapeDtypeStruct(out.shape, out.dtype),
        input_output_aliases={len(step_refs) + 2: 0},
        compiler_params=_TritonParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name=f"{name}_combine",
    )(*step_refs, o_part, lse_part, out)


def _check(q, k_pages, v_pages, query_start, seq_lens, block_tables, cfg: TileConfig):
    if q.ndim != 3 or k_pages.ndim != 4:
        raise ValueError(f"q must be [T, Hq, D] and k_pages [Hkv, P, page, D]; got {q.shape}, {k_pages.shape}")
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} differ")
    t, hq, d = q.shape
    hkv, _, page_size, dk = k_pages.shape
    if dk != d:
        raise ValueError(f"head_dim of q ({d}) and k_pages ({dk}) differ")
    kv_dtype = k_pages.dtype  # numpy's or torch's (the Triton backend's torch path)
    if kv_dtype != q.dtype and getattr(kv_dtype, "itemsize", None) != 1:
        raise ValueError(f"k/v pages must be q's dtype ({q.dtype}) or a float8, got {kv_dtype}")
    if hq % hkv:
        raise ValueError(f"num query heads {hq} not a multiple of num kv heads {hkv}")
    if not _is_pow2(d) or d < 16:
        raise ValueError(f"head_dim must be a power of two >= 16, got {d}")
    s = seq_lens.shape[0]
    if query_start.shape != (s + 1,) or block_tables.ndim != 2 or block_tables.shape[0] != s:
        raise ValueError(
            f"query_start {query_start.shape}, seq_lens {seq_lens.shape}, block_tables "
            f"{block_tables.shape} disagree on the number of sequences"
        )
    for name in ("decode_block_m", "decode_block_kv", "prefill_block_m", "prefill_block_kv"):
        val = getattr(cfg, name)
        if not _is_pow2(val) or val < 16:  # Triton's dot needs every dimension >= 16
            raise ValueError(f"{name} must be a power of two >= 16, got {val}")


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "soft_cap", "interpret", "cfg"),
)
def _ragged_paged_attention(q, k_pages, v_pages, query_start, seq_lens, block_tables, num_seqs,
                            kv_scale, kv_limit, *, sm_scale, sliding_window, soft_cap, interpret,
                            cfg: TileConfig):
    # Everything per call is free reshapes plus one zero fill and the pallas_calls: each kernel
    # reads the step metadata itself (decode rows by index, prefill blocks by a prefix sum), so
    # no metadata, gathers or layout copies run as separate XLA ops. Each call writes its real
    # rows straight into the flat [T * Hq, D] output (masked scatter, aliased in place); rows
    # nobody writes (padding tokens) keep the zeros.
    t, hq, d = q.shape
    hkv, _, page_size, _ = k_pages.shape
    group = hq // hkv
    gp = _next_pow2(group)
    s_len, max_pages = block_tables.shape

    dec, pre, split_target, min_iters = call_shapes(t, hq, hkv, page_size, s_len, max_pages, d,
                                                    cfg)
    meta = (
        query_start.astype(jnp.int32),
        seq_lens.astype(jnp.int32),
        (jnp.int32(s_len) if num_seqs is None else num_seqs).astype(jnp.int32).reshape(1),
    ) + (() if kv_limit is None else (kv_limit.astype(jnp.int32),))
    bt_flat = block_tables.astype(jnp.int32).reshape(-1)
    q_flat = q.reshape(t * hq, d)
    # The pool as rows of slots (a free reshape): a KV step gathers its rows by slot.
    k_flat = k_pages.reshape(hkv, -1, d)
    v_flat = v_pages.reshape(hkv, -1, d)
    scales = None if kv_scale is None else kv_scale.astype(jnp.float32).reshape(hkv * 2)
    common = dict(page_size=page_size, sm_scale=sm_scale, soft_cap=soft_cap,
                  sliding_window=sliding_window, group=group, gp=gp, hq=hq, max_pages=max_pages,
                  interpret=interpret)

    def kv_kw(shape, split_target, min_iters):
        return dict(page_size=page_size, block_kv=shape.block_kv, sliding_window=sliding_window,
                    num_splits=shape.num_splits, split_target=split_target, hkv=hkv,
                    min_iters=min_iters)

    out = jnp.zeros((t * hq, d), q.dtype)
    if pre.num_blocks > 0:
        row_fn = functools.partial(_prefill_row, bq=pre.block_q, bq_dec=dec.block_q,
                                   s_len=s_len)
        out = _run_call(out, meta, bt_flat, q_flat, k_flat, v_flat, scales, pre, row_fn,
                        kv_kw(pre, 0, 1), name="rpa_prefill", **common)
    row_fn = functools.partial(_decode_row, bq=dec.block_q)
    out = _run_call(out, meta, bt_flat, q_flat, k_flat, v_flat, scales, dec, row_fn,
                    kv_kw(dec, split_target, min_iters), name="rpa_decode", **common)
    return out.reshape(t, hq, d)


def ragged_paged_attention(
    q,
    k_pages,
    v_pages,
    query_start,
    seq_lens,
    block_tables,
    num_seqs=None,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    kv_scale=None,
    kv_limit=None,
    interpret: bool = False,
    **tile_params,
):
    """Causal attention of every new token against its sequence's pages (see reference.py).

    q: ``[T, Hq, D]``; k_pages/v_pages: ``[Hkv, num_pages, page_size, D]`` with the step's new
    K/V already written; query_start ``[S+1]``; seq_lens ``[S]`` (0 = padding row);
    block_tables ``[S, M]``; num_seqs: optional count of real rows (rows at or past it are
    padding too); kv_scale: optional ``[Hkv, 2]`` scales of float8 pages; kv_limit: optional
    ``[T]`` last visible key position of each token (see reference.py).
    Padded tokens come back as zeros. ``tile_params`` override
    :class:`TileConfig` fields (e.g. ``decode_num_splits=4``). Returns ``[T, Hq, D]`` in q's dtype.
    """
    cfg = default_tiles(q.shape[-1], q.dtype).replace(**tile_params)
    _check(q, k_pages, v_pages, query_start, seq_lens, block_tables, cfg)
    if sliding_window is not None:
        sliding_window = int(sliding_window)
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if soft_cap is not None:
        soft_cap = float(soft_cap)
        if soft_cap <= 0:
            raise ValueError(f"soft_cap must be > 0, got {soft_cap}")
    return _ragged_paged_attention(
        q, k_pages, v_pages, query_start, seq_lens, block_tables, num_seqs, kv_scale, kv_limit,
        sm_scale=float(sm_scale), sliding_window=sliding_window, soft_cap=soft_cap,
        interpret=bool(interpret), cfg=cfg,
    )
