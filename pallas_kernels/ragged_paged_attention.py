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
* **Padding costs nothing.** Query blocks that belong to no sequence, empty splits and padding
  rows exit before touching memory; the KV loop's trip count is bounded by each sequence's
  ``seq_lens`` (and sliding window).

Outputs are written per query block and gathered back to ``[T, Hq, D]`` with one small gather,
so no program ever writes rows that belong to another sequence.
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
    tokens per inner step (a whole number of pages). ``decode_num_splits=None`` bounds the split
    count from the static shapes and picks it at run time from the real decode rows, so the
    grid fills ``num_sms`` about four times over; a split never covers less than
    ``decode_min_kv_per_split`` KV tokens.
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
        while kv > 16 and 2 * kv * head_dim * itemsize * stages > budget:
            kv //= 2
        return kv

    warps = 8 if head_dim * itemsize >= 512 else 4
    return cfg.replace(
        prefill_block_kv=fit(cfg.prefill_block_kv, cfg.prefill_num_stages),
        decode_block_kv=fit(cfg.decode_block_kv, cfg.decode_num_stages),
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


# Per-block metadata columns (int32 [num_blocks, _NMETA]).
_SEQ, _Q0, _QN, _POS0, _KV_LO, _NKV, _BPS, _NSPLIT = range(8)
_NMETA = 8


def _attn_kernel(
    meta_ref, bt_ref, q_ref, k_ref, v_ref, *out_refs,
    sm_scale, soft_cap, sliding_window, group, gp, page_size, block_kv, bt_stride, direct,
):
    """One (query block, KV head, split): online softmax over this split's KV pages."""
    b = pl.program_id(0)
    sp = pl.program_id(2)
    seq = meta_ref[b, _SEQ]
    q0 = meta_ref[b, _Q0]
    qn = meta_ref[b, _QN]
    pos0 = meta_ref[b, _POS0]
    kv_lo = meta_ref[b, _KV_LO]
    nkv = meta_ref[b, _NKV]
    bps = meta_ref[b, _BPS]
    it_lo = sp * bps
    it_hi = jnp.minimum(it_lo + bps, nkv)

    @pl.when(it_hi > it_lo)
    def _():
        o_ref = out_refs[0]
        block_m, head_dim = o_ref.shape[-2], o_ref.shape[-1]
        num_pages = k_ref.shape[0] // page_size
        q = q_ref[pl.ds(q0 * gp, block_m), :]
        rows = lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
        tok = lax.div(rows, jnp.int32(gp))
        head = lax.rem(rows, jnp.int32(gp))
        q_pos = pos0 + tok
        row_ok = (tok < qn) & (head < group)
        cols = lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
        kv_rows = lax.broadcasted_iota(jnp.int32, (block_kv,), 0)
        bt_row = seq * bt_stride

        def step(it, carry, masked):
            acc, m_i, l_i = carry
            kv0 = kv_lo + it * block_kv
            tok = kv0 + kv_rows  # [block_kv] positions in the sequence
            ps = jnp.int32(page_size)
            pages = bt_ref[bt_row + lax.div(tok, ps)]  # page of every row (cached, tiny)
            pages = jnp.clip(pages, 0, num_pages - 1)  # a bad table must not fault the GPU
            slots = pages * ps + lax.rem(tok, ps)
            k = k_ref[slots]  # [block_kv, D] rows gathered straight from the pool
            v = v_ref[slots]
            s = lax.dot_general(
                q, k, (((1,), (1,)), ((), ())),
                precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32,
            ) * sm_scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            s = s * _LOG2E  # base-2 units from here on
            if masked:
                kv_pos = kv0 + cols
                mask = row_ok & (kv_pos <= q_pos)
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
            # past the block's tokens compute garbage that is never read); the rest are masked.
            n_full = lax.div(pos0 + 1 - kv_lo, jnp.int32(block_kv))
            mid = jnp.clip(n_full, it_lo, it_hi)
            carry = lax.fori_loop(it_lo, mid, functools.partial(step, masked=False), carry)
        else:
            mid = it_lo
        acc, m_i, l_i = lax.fori_loop(mid, it_hi, functools.partial(step, masked=True), carry)
        has = l_i > 0.0
        out = acc / jnp.where(has, l_i, 1.0)
        if direct:
            o_ref[...] = out.astype(o_ref.dtype)
        else:
            lse_ref = out_refs[1]
            o_ref[...] = out
            lse = jnp.where(has, m_i + jnp.log2(jnp.where(has, l_i, 1.0)), _MASK)
            lse_ref[...] = lse.reshape(block_m)


def _combine_kernel(meta_ref, o_ref, lse_ref, out_ref):
    """Merge the splits of one (query block, KV head); reads only the splits that ran."""
    b = pl.program_id(0)
    nsplit = meta_ref[b, _NSPLIT]
    block_m, head_dim = out_ref.shape

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
        out_ref[...] = (acc / jnp.where(l_i > 0, l_i, 1.0)).astype(out_ref.dtype)


def _block_metadata(sel, q_len, qs, ctx_start, nblk_seq, first_blk, shape: _CallShape, *,
                    page_size, sliding_window, min_iters_per_split, num_splits=None):
    """int32 [num_blocks, _NMETA]: which sequence/tokens/pages each query block covers."""
    nb = shape.num_blocks
    b = jnp.arange(nb, dtype=jnp.int32)
    if nblk_seq is None:  # one block per sequence, block index == sequence index
        seq = b
        active = sel
    else:  # first_blk is the exclusive prefix sum of nblk_seq
        seq = jnp.searchsorted(first_blk + nblk_seq, b, side="right").astype(jnp.int32)
        seq = jnp.minimum(seq, q_len.shape[0] - 1)
        active = (b < jnp.sum(nblk_seq)) & sel[seq]
    j = (b - first_blk[seq]) * shape.block_q  # token offset inside the sequence's new tokens
    qn = jnp.where(active, jnp.clip(q_len[seq] - j, 0, shape.block_q), 0)
    q0 = qs[seq] + j
    pos0 = ctx_start[seq] + j
    hi_tok = pos0 + qn  # exclusive
    if sliding_window is None:
        lo_tok = jnp.zeros_like(pos0)
    else:
        lo_tok = jnp.maximum(pos0 - sliding_window + 1, 0)
    kv_lo = (lo_tok // page_size) * page_size  # page-aligned start
    nkv = jnp.where(qn > 0, _cdiv(hi_tok - kv_lo, shape.block_kv), 0)
    splits = shape.num_splits if num_splits is None else num_splits  # <= shape.num_splits
    bps = jnp.maximum(_cdiv(nkv, splits), min_iters_per_split)
    nsplit = _cdiv(nkv, bps)
    meta = jnp.stack([seq, q0, qn, pos0, kv_lo, nkv, bps, nsplit], axis=1)
    return jnp.where(active[:, None], meta, 0).astype(jnp.int32)


def _run_call(meta, bt_flat, q_rows, k_flat, v_flat, shape: _CallShape, *, out_dtype, page_size,
              sm_scale, soft_cap, sliding_window, group, gp, bt_stride, interpret, name):
    hkv, num_slots, d = k_flat.shape
    nb, bm, ns = shape.num_blocks, shape.block_m, shape.num_splits
    direct = ns == 1
    kernel = functools.partial(
        _attn_kernel, sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
        group=group, gp=gp, page_size=page_size, block_kv=shape.block_kv,
        bt_stride=bt_stride, direct=direct,
    )
    whole = lambda arr: pl.BlockSpec(arr.shape, lambda b, h, s: (0,) * arr.ndim)
    in_specs = [
        whole(meta),
        whole(bt_flat),
        pl.BlockSpec((None, q_rows.shape[1], d), lambda b, h, s: (h, 0, 0)),
        pl.BlockSpec((None, num_slots, d), lambda b, h, s: (h, 0, 0)),
        pl.BlockSpec((None, num_slots, d), lambda b, h, s: (h, 0, 0)),
    ]
    if direct:
        out_shape = [jax.ShapeDtypeStruct((nb, hkv, bm, d), out_dtype)]
        out_specs = [pl.BlockSpec((None, None, bm, d), lambda b, h, s: (b, h, 0, 0))]
    else:
        out_shape = [
            jax.ShapeDtypeStruct((ns, nb, hkv, bm, d), jnp.float32),
            jax.ShapeDtypeStruct((ns, nb, hkv, bm), jnp.float32),
        ]
        out_specs = [
            pl.BlockSpec((None, None, None, bm, d), lambda b, h, s: (s, b, h, 0, 0)),
            pl.BlockSpec((None, None, None, bm), lambda b, h, s: (s, b, h, 0)),
        ]
    outs = pl.pallas_call(
        kernel,
        grid=(nb, hkv, ns),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_TritonParams(num_warps=shape.num_warps, num_stages=shape.num_stages),
        interpret=interpret,
        name=f"{name}_bm{bm}_kv{shape.block_kv}_s{ns}",
    )(meta, bt_flat, q_rows, k_flat, v_flat)
    if direct:
        return outs[0]
    o_part, lse_part = outs
    return pl.pallas_call(
        _combine_kernel,
        grid=(nb, hkv),
        in_specs=[
            pl.BlockSpec(meta.shape, lambda b, h: (0, 0)),
            pl.BlockSpec((ns, None, None, bm, d), lambda b, h: (0, b, h, 0, 0)),
            pl.BlockSpec((ns, None, None, bm), lambda b, h: (0, b, h, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, bm, d), lambda b, h: (b, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((nb, hkv, bm, d), out_dtype),
        compiler_params=_TritonParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name=f"{name}_combine",
    )(meta, o_part, lse_part)


def _check(q, k_pages, v_pages, query_start, seq_lens, block_tables, cfg: TileConfig):
    if q.ndim != 3 or k_pages.ndim != 4:
        raise ValueError(f"q must be [T, Hq, D] and k_pages [Hkv, P, page, D]; got {q.shape}, {k_pages.shape}")
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} differ")
    t, hq, d = q.shape
    hkv, _, page_size, dk = k_pages.shape
    if dk != d:
        raise ValueError(f"head_dim of q ({d}) and k_pages ({dk}) differ")
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
                            *, sm_scale, sliding_window, soft_cap, interpret, cfg: TileConfig):
    t, hq, d = q.shape
    hkv, _, page_size, _ = k_pages.shape
    group = hq // hkv
    gp = _next_pow2(group)
    s_len, max_pages = block_tables.shape
    qs = query_start.astype(jnp.int32)
    seq_lens = seq_lens.astype(jnp.int32)

    valid = seq_lens > 0
    if num_seqs is not None:
        valid = valid & (jnp.arange(s_len, dtype=jnp.int32) < num_seqs)
    q_len = jnp.where(valid, qs[1:] - qs[:-1], 0)
    valid = valid & (q_len > 0)
    ctx_start = seq_lens - q_len

    # Static call shapes.
    bm_dec = max(cfg.decode_block_m, gp)
    bq_dec = bm_dec // gp
    bm_pre = max(cfg.prefill_block_m, gp)
    bq_pre = bm_pre // gp
    max_ctx = max_pages * page_size
    if cfg.decode_num_splits is None:
        # Static upper bound (grid size): no more splits than the longest context allows, and
        # partial results of at most ~64 MB. The split count actually used is picked at run time
        # from the number of real decode rows (below), so a half-empty bucket still fills the SMs.
        by_len = _cdiv(max_ctx, cfg.decode_min_kv_per_split)
        by_mem = (64 << 20) // max(1, s_len * hkv * bm_dec * d * 4)
        ns_dec = max(1, min(16, by_len, by_mem))
    else:
        ns_dec = max(1, cfg.decode_num_splits)
    n_long_max = min(s_len, t // (bq_dec + 1))
    nb_pre = t // bq_pre + n_long_max
    dec = _CallShape(bm_dec, bq_dec, cfg.decode_block_kv, s_len, ns_dec, cfg.decode_num_warps, cfg.decode_num_stages)
    pre = _CallShape(bm_pre, bq_pre, cfg.prefill_block_kv, nb_pre, max(1, cfg.prefill_num_splits),
                     cfg.prefill_num_warps, cfg.prefill_num_stages)

    # Query rows: [Hkv, (T + pad) * Gp, D], token-major, the group's heads adjacent.
    qg = q.reshape(t, hkv, group, d)
    pad_t = max(bq_dec, bq_pre)
    qg = jnp.pad(qg, ((0, pad_t), (0, 0), (0, gp - group), (0, 0)))
    q_rows = qg.transpose(1, 0, 2, 3).reshape(hkv, (t + pad_t) * gp, d)

    # Block tables, flattened, padded so a KV step may read past the last page (masked).
    pad_p = _cdiv(max(cfg.decode_block_kv, cfg.prefill_block_kv), page_size) + 1
    bt_stride = max_pages + pad_p
    bt_flat = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, pad_p))).reshape(-1)

    # The pool as rows of slots (a free reshape): a KV step gathers its rows by slot.
    k_flat = k_pages.reshape(hkv, -1, d)
    v_flat = v_pages.reshape(hkv, -1, d)
    common = dict(out_dtype=q.dtype, page_size=page_size, sm_scale=sm_scale, soft_cap=soft_cap,
                  sliding_window=sliding_window, group=group, gp=gp, bt_stride=bt_stride,
                  interpret=interpret)
    meta_kw = dict(page_size=page_size, sliding_window=sliding_window)

    # Decode call: one block per short row (block index == sequence index).
    is_dec = valid & (q_len <= bq_dec)
    seq_idx = jnp.arange(s_len, dtype=jnp.int32)
    min_iters = max(1, _cdiv(cfg.decode_min_kv_per_split, cfg.decode_block_kv))
    if cfg.decode_num_splits is None and ns_dec > 1:  # aim at ~4 programs per SM
        n_dec = jnp.maximum(jnp.sum(is_dec.astype(jnp.int32)) * hkv, 1)
        splits = jnp.clip(_cdiv(4 * cfg.num_sms, n_dec), 1, ns_dec)
    else:
        splits = ns_dec
    meta_dec = _block_metadata(is_dec, q_len, qs, ctx_start, None, seq_idx, dec,
                               num_splits=splits, min_iters_per_split=min_iters, **meta_kw)
    out_dec = _run_call(meta_dec, bt_flat, q_rows, k_flat, v_flat, dec, name="rpa_decode", **common)
    out_dec = out_dec.reshape(s_len, hkv, bq_dec, gp, d)

    # Token -> (sequence, offset) for the final gather.
    tok = jnp.arange(t, dtype=jnp.int32)
    seq_of = jnp.minimum(jnp.searchsorted(qs[1:], tok, side="right").astype(jnp.int32), s_len - 1)
    j = tok - qs[seq_of]
    tok_ok = (tok < qs[s_len]) & valid[seq_of]
    heads = jnp.arange(hkv, dtype=jnp.int32)
    res = out_dec[seq_of[:, None], heads[None, :], jnp.minimum(j, bq_dec - 1)[:, None]]

    if nb_pre > 0:
        is_pre = valid & (q_len > bq_dec)
        nblk = jnp.where(is_pre, _cdiv(q_len, bq_pre), 0).astype(jnp.int32)
        first = (jnp.cumsum(nblk) - nblk).astype(jnp.int32)
        meta_pre = _block_metadata(is_pre, q_len, qs, ctx_start, nblk, first, pre,
                                   min_iters_per_split=1, **meta_kw)
        out_pre = _run_call(meta_pre, bt_flat, q_rows, k_flat, v_flat, pre, name="rpa_prefill", **common)
        out_pre = out_pre.reshape(nb_pre, hkv, bq_pre, gp, d)
        blk = jnp.clip(first[seq_of] + j // bq_pre, 0, nb_pre - 1)
        res_pre = out_pre[blk[:, None], heads[None, :], (j % bq_pre)[:, None]]
        res = jnp.where(is_pre[seq_of][:, None, None, None], res_pre, res)

    res = res[:, :, :group, :]
    res = jnp.where(tok_ok[:, None, None, None], res, jnp.zeros((), res.dtype))
    return res.reshape(t, hq, d)


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
    interpret: bool = False,
    **tile_params,
):
    """Causal attention of every new token against its sequence's pages (see reference.py).

    q: ``[T, Hq, D]``; k_pages/v_pages: ``[Hkv, num_pages, page_size, D]`` with the step's new
    K/V already written; query_start ``[S+1]``; seq_lens ``[S]`` (0 = padding row);
    block_tables ``[S, M]``; num_seqs: optional count of real rows (rows at or past it are
    padding too). Padded tokens come back as zeros. ``tile_params`` override
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
        q, k_pages, v_pages, query_start, seq_lens, block_tables, num_seqs,
        sm_scale=float(sm_scale), sliding_window=sliding_window, soft_cap=soft_cap,
        interpret=bool(interpret), cfg=cfg,
    )
