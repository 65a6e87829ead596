"""Many LoRA adapters in one batch (Punica's BGMV / SGMV): the XLA path and the Pallas kernels.

Both compute :func:`pallas_kernels.reference.lora_delta`: ``scale[s] * (x @ A[s]) @ B[s]`` for
each token's adapter slot ``s`` (``-1``: base model, zero delta), with the adapter slots stacked
on the device as ``A [L, in, r]``, ``B [L, r, out]``, ``scale [L]``. One fixed-shape graph serves
any mix of adapters: nothing depends on which slots a step uses.

* :func:`lora_delta` (XLA, CPU): every token against every slot's A in one matmul
  (``x @ A_cat``, ``A_cat [in, L*r]``), each token keeping its own slot's columns, then one
  ``[T, r] x [r, out]`` matmul per slot, each token selecting its own slot's row. Cost
  ``T * L * r * (in + out)``: small next to the base projection while ``L * r`` is small next
  to ``in``. A token's slot is always selected (``where``, a gather, a per-slot load), never
  picked by multiplying with a 0/1 mask, so a NaN or inf in one slot cannot reach another
  slot's tokens or the base model's.
* :func:`lora_delta_pallas` (GPU; interpret mode on CPU): tokens are grouped by contiguous runs
  of the same slot. Runs of at least ``sgmv_min_len`` tokens (prefill chunks, and decodes the
  scheduler placed side by side) are cut into blocks of ``block_m`` rows: *SGMV*, one matmul per
  block with its slot's A, then with its B, each slot's weights read once per block. Shorter
  runs (isolated decode tokens) go token by token: *BGMV*, a gathered matrix-vector product.
  Each is a *shrink* (``x @ A -> [T, r]``, float32) then an *expand* (``@ B``, times the scale).

Both paths also expose the shrink and the expand on their own (``lora_shrink*``,
``lora_expand*``): a projection whose input is sharded over devices sums the shards' shrinks
before one expand.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.ragged_paged_attention import _TritonParams, _is_pow2, _next_pow2

_HI = lax.Precision.HIGHEST


def _check(x, lora_a, lora_b, slot, scale):
    if x.ndim != 2 or lora_a.ndim != 3 or lora_b.ndim != 3:
        raise ValueError(f"x must be [T, in], A [L, in, r], B [L, r, out]; got {x.shape}, "
                         f"{lora_a.shape}, {lora_b.shape}")
    num, d_in, r = lora_a.shape
    if lora_b.shape[:2] != (num, r) or d_in != x.shape[1]:
        raise ValueError(f"A {lora_a.shape} and B {lora_b.shape} do not chain from x {x.shape}")
    if slot.shape != (x.shape[0],) or scale.shape != (num,):
        raise ValueError(f"slot {slot.shape} must be [T] and scale {scale.shape} [L]")


@jax.jit
def lora_shrink(x, lora_a, slot):
    """``x @ A[slot]`` per token (XLA): ``[T, r]`` float32, zeros for base tokens. Linear in x
    (sum the shards' results when ``in`` is sharded). A step of base tokens only skips it."""
    num, d_in, r = lora_a.shape

    def shrink():
        a_cat = jnp.swapaxes(lora_a, 0, 1).reshape(d_in, num * r)
        prec = _HI if x.dtype == jnp.float32 else None
        xa = jnp.dot(x, a_cat.astype(x.dtype), precision=prec,
                     preferred_element_type=jnp.float32)
        pick = slot[:, None] == jnp.arange(num)[None, :]
        return jnp.sum(jnp.where(pick[:, :, None], xa.reshape(-1, num, r), 0.0), axis=1)

    zeros = lambda: jnp.zeros((x.shape[0], r), jnp.float32)
    return lax.cond(_any_adapter(slot, num), shrink, zeros)


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def lora_expand(xa, lora_b, slot, scale, *, out_dtype=jnp.float32):
    """``scale[slot] * xa @ B[slot]`` per token (XLA): ``[T, out]``, zeros for base tokens.

    Each token's row is *selected* from its own slot's product (``where``), never formed by
    multiplying other slots' B by a 0/1 mask: a NaN or inf in one slot reaches only the rows of
    that slot. One ``[T, r] x [r, out]`` dot per slot (the flops of one concatenated dot)."""
    num, r, d_out = lora_b.shape

    def expand():
        prec = _HI if lora_b.dtype == jnp.float32 else None
        x = xa.astype(lora_b.dtype)

        def one(l, out):
            y = jnp.dot(x, lora_b[l], precision=prec, preferred_element_type=jnp.float32)
            return jnp.where((slot == l)[:, None], y * scale[l].astype(jnp.float32), out)

        out = lax.fori_loop(0, num, one, jnp.zeros((xa.shape[0], d_out), jnp.float32))
        return out.astype(out_dtype)

    zeros = lambda: jnp.zeros((xa.shape[0], d_out), out_dtype)
    return lax.cond(_any_adapter(slot, num), expand, zeros)


def _any_adapter(slot, num_loras):
    return jnp.any((slot >= 0) & (slot < num_loras))


@jax.jit
def lora_delta(x, lora_a, lora_b, slot, scale):
    """The LoRA delta of every token (XLA): ``[T, out]`` in x's dtype."""
    _check(x, lora_a, lora_b, slot, scale)
    return lora_expand(lora_shrink(x, lora_a, slot), lora_b, slot, scale, out_dtype=x.dtype)


# ------------------------------------------------------------------------------------------
# Pallas kernels
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Tiles (static). ``block_m`` rows per SGMV block, ``block_k`` of ``in`` per shrink step,
    ``block_n`` of ``out`` per expand program; runs shorter than ``sgmv_min_len`` go to BGMV,
    ``bgmv_tokens`` tokens per BGMV program. ``max_runs`` bounds the runs of one slot a step can
    hold (the sequence bucket: a run never splits a request), which sizes the SGMV grid;
    without it the bound is ``T // sgmv_min_len``. Grids are static, so programs past the
    step's real work exit at once: the bounds keep their number small."""

    block_m: int = 16
    block_k: int = 128
    block_n: int = 128
    sgmv_min_len: int = 2
    bgmv_tokens: int = 16
    max_runs: int | None = None
    num_warps: int = 4


def _dot(a, b):
    prec = _HI if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=prec,
                           preferred_element_type=jnp.float32)


def _sgmv_shrink_kernel(bt_ref, bn_ref, bs_ref, x_ref, a_ref, _alias, xa_ref, *, block_m,
                        block_k, d_in, r):
    b = pl.program_id(0)
    n = bn_ref[b]

    @pl.when(n > 0)
    def _():
        pos = lax.broadcasted_iota(jnp.int32, (block_m,), 0)
        live = pos < n
        rows = jnp.where(live, bt_ref[b] + pos, 0)
        base = bs_ref[b] * d_in
        rc = lax.broadcasted_iota(jnp.int32, (1, r), 1)

        def step(kb, acc):
            cols = kb * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
            cm = cols < d_in
            cc = jnp.where(cm, cols, 0)
            xt = plgpu.load(x_ref.at[rows[:, None], cc[None, :]], mask=cm[None, :], other=0)
            at = plgpu.load(a_ref.at[(base + cc)[:, None], rc], mask=cm[:, None], other=0)
            return acc + _dot(xt, at.astype(xt.dtype))

        acc = lax.fori_loop(0, pl.cdiv(d_in, block_k), step, jnp.zeros((block_m, r), jnp.float32))
        idx = jnp.where(live, rows, xa_ref.shape[0] + pos)  # not real: past the end, dropped
        plgpu.store(xa_ref.at[idx[:, None], rc], acc, mask=live[:, None])


def _bgmv_shrink_kernel(ts_ref, x_ref, a_ref, _alias, xa_ref, *, block_k, d_in, r, tokens):
    """``tokens`` consecutive tokens, one after another, each with its own slot's A."""
    t_len = ts_ref.shape[0]
    rc = lax.broadcasted_iota(jnp.int32, (1, r), 1)
    t0 = pl.program_id(0) * tokens

    def token(i, carry):
        t = t0 + i
        sl = ts_ref[jnp.minimum(t, t_len - 1)]

        @pl.when((t < t_len) & (sl >= 0))
        def _():
            row = t + lax.broadcasted_iota(jnp.int32, (1,), 0)
            base = sl * d_in

            def step(kb, acc):
                cols = kb * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
                cm = cols < d_in
                cc = jnp.where(cm, cols, 0)
                xt = plgpu.load(x_ref.at[row[:, None], cc[None, :]], mask=cm[None, :], other=0)
                at = plgpu.load(a_ref.at[(base + cc)[:, None], rc], mask=cm[:, None], other=0)
                prod = xt.astype(jnp.float32).T * at.astype(jnp.float32)  # [BK, r]
                return acc + jnp.sum(prod, axis=0, keepdims=True)

            acc = lax.fori_loop(0, pl.cdiv(d_in, block_k), step,
                                jnp.zeros((1, r), jnp.float32))
            plgpu.store(xa_ref.at[row[:, None], rc], acc)

        return carry

    lax.fori_loop(0, tokens, token, 0)


def _sgmv_expand_kernel(bt_ref, bn_ref, bs_ref, sc_ref, xa_ref, b_ref, _alias, o_ref, *,
                        block_m, block_n, d_out, r):
    b = pl.program_id(0)
    j = pl.program_id(1)
    n = bn_ref[b]

    @pl.when(n > 0)
    def _():
        pos = lax.broadcasted_iota(jnp.int32, (block_m,), 0)
        live = pos < n
        rows = jnp.where(live, bt_ref[b] + pos, 0)
        sl = bs_ref[b]
        cols = j * block_n + lax.broadcasted_iota(jnp.int32, (block_n,), 0)
        cm = cols < d_out
        cc = jnp.where(cm, cols, 0)
        rc = lax.broadcasted_iota(jnp.int32, (r,), 0)
        xa = xa_ref[rows]  # [BM, r] float32
        bt = plgpu.load(b_ref.at[(sl * r + rc)[:, None], cc[None, :]], mask=cm[None, :],
                        other=0)
        y = _dot(xa.astype(bt.dtype), bt) * sc_ref[sl]
        idx = jnp.where(live, rows, o_ref.shape[0] + pos)
        # Columns past the end keep their distinct indices (masked on the GPU, dropped by
        # interpret mode's scatter), so no masked lane aliases a real one.
        plgpu.store(o_ref.at[idx[:, None], cols[None, :]], y.astype(o_ref.dtype),
                    mask=live[:, None] & cm[None, :])


def _bgmv_expand_kernel(ts_ref, sc_ref, xa_ref, b_ref, _alias, o_ref, *, block_n, d_out, r,
                        tokens):
    t_len = ts_ref.shape[0]
    j = pl.program_id(1)
    cols = j * block_n + lax.broadcasted_iota(jnp.int32, (block_n,), 0)
    cm = cols < d_out
    cc = jnp.where(cm, cols, 0)
    rc = lax.broadcasted_iota(jnp.int32, (r,), 0)
    t0 = pl.program_id(0) * tokens

    def token(i, carry):
        t = t0 + i
        sl = ts_ref[jnp.minimum(t, t_len - 1)]

        @pl.when((t < t_len) & (sl >= 0))
        def _():
            row = t + lax.broadcasted_iota(jnp.int32, (1,), 0)
            xa = xa_ref[row]  # [1, r]
            bt = plgpu.load(b_ref.at[(sl * r + rc)[:, None], cc[None, :]], mask=cm[None, :],
                            other=0)
            y = jnp.sum(xa.T * bt.astype(jnp.float32), axis=0, keepdims=True) * sc_ref[sl]
            plgpu.store(o_ref.at[row[:, None], cols[None, :]], y.astype(o_ref.dtype),
                        mask=cm[None, :])

        return carry

    lax.fori_loop(0, tokens, token, 0)


def segment_blocks(slot, num_loras, *, block_m, sgmv_min_len, max_runs=None):
    """Step metadata of the two kernels, from the per-token slots (a few [T] XLA ops).

    Returns ``(block_tok, block_len, block_slot)`` of the SGMV blocks (``[NB]``, NB a static
    bound: ``T // block_m`` + the most runs of ``sgmv_min_len`` tokens the step can hold, or
    ``max_runs`` when smaller; unused blocks have length 0) and ``token_slot`` ``[T]``: each BGMV
    token's slot, -1 for tokens that are base or in an SGMV block."""
    t_len = slot.shape[0]
    t = jnp.arange(t_len, dtype=jnp.int32)
    s = jnp.where((slot >= 0) & (slot < num_loras), slot, -1).astype(jnp.int32)
    start = jnp.concatenate([jnp.ones((1,), bool), s[1:] != s[:-1]])
    seg_id = jnp.cumsum(start.astype(jnp.int32)) - 1
    seg_first = lax.cummax(jnp.where(start, t, 0))
    seg_len = jax.ops.segment_sum(jnp.ones_like(t), seg_id, num_segments=t_len)[seg_id]
    long = (s >= 0) & (seg_len >= sgmv_min_len)
    off = t - seg_first
    first_of_block = long & (off % block_m == 0)
    nb = t_len // block_m + min(t_len // sgmv_min_len, max_runs or t_len)
    (block_tok,) = jnp.nonzero(first_of_block, size=nb, fill_value=t_len)
    ok = block_tok < t_len
    bt = jnp.minimum(block_tok, t_len - 1)
    block_len = jnp.where(ok, jnp.minimum(block_m, seg_first[bt] + seg_len[bt] - bt), 0)
    block_slot = jnp.where(ok, s[bt], 0)
    token_slot = jnp.where(long, -1, s)
    return bt.astype(jnp.int32), block_len.astype(jnp.int32), block_slot, token_slot


def _call(kernel, grid, args, out, name, cfg, interpret, **kw):
    """One pallas_call writing its rows into ``out`` (aliased, in place)."""
    whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)
    return pl.pallas_call(
        functools.partial(kernel, **kw), grid=grid,
        in_specs=[whole(a) for a in args] + [whole(out)], out_specs=whole(out),
        out_shape=jax.ShapeDtypeStruct(out.shape, out.dtype),
        input_output_aliases={len(args): 0},
        compiler_params=_TritonParams(num_warps=cfg.num_warps, num_stages=1),
        interpret=interpret, name=name,
    )(*args, out)


def _padded_rank(r):
    return max(16, _next_pow2(r))  # Triton's dot needs every dimension >= 16, a power of two


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def _shrink(x, lora_a, slot, *, cfg: LoRAConfig, interpret: bool):
    t_len, d_in = x.shape
    num, _, r = lora_a.shape
    rp = _padded_rank(r)
    if rp != r:  # slots allocated at a power-of-two rank >= 16 need no copy here
        lora_a = jnp.pad(lora_a, ((0, 0), (0, 0), (0, rp - r)))
    a_flat = lora_a.reshape(num * d_in, rp)
    block_tok, block_len, block_slot, token_slot = segment_blocks(
        slot, num, block_m=cfg.block_m, sgmv_min_len=cfg.sgmv_min_len, max_runs=cfg.max_runs)
    common = dict(cfg=cfg, interpret=interpret, block_k=cfg.block_k, d_in=d_in, r=rp)
    xa = jnp.zeros((t_len, rp), jnp.float32)
    xa = _call(_sgmv_shrink_kernel, (block_tok.shape[0],),
               (block_tok, block_len, block_slot, x, a_flat), xa, "lora_sgmv_shrink",
               block_m=cfg.block_m, **common)
    xa = _call(_bgmv_shrink_kernel, (pl.cdiv(t_len, cfg.bgmv_tokens),), (token_slot, x, a_flat),
               xa, "lora_bgmv_shrink", tokens=cfg.bgmv_tokens, **common)
    return xa[:, :r]


@functools.partial(jax.jit, static_argnames=("cfg", "interpret", "out_dtype"))
def _expand(xa, lora_b, slot, scale, *, cfg: LoRAConfig, interpret: bool, out_dtype):
    t_len, r = xa.shape
    num, _, d_out = lora_b.shape
    rp = _padded_rank(r)
    xa = xa.astype(jnp.float32)
    if rp != r:
        xa = jnp.pad(xa, ((0, 0), (0, rp - r)))
        lora_b = jnp.pad(lora_b, ((0, 0), (0, rp - r), (0, 0)))
    b_flat = lora_b.reshape(num * rp, d_out)
    block_tok, block_len, block_slot, token_slot = segment_blocks(
        slot, num, block_m=cfg.block_m, sgmv_min_len=cfg.sgmv_min_len, max_runs=cfg.max_runs)
    common = dict(cfg=cfg, interpret=interpret, block_n=cfg.block_n, d_out=d_out, r=rp)
    scale = scale.astype(jnp.float32)
    n_out = pl.cdiv(d_out, cfg.block_n)
    out = jnp.zeros((t_len, d_out), out_dtype)
    out = _call(_sgmv_expand_kernel, (block_tok.shape[0], n_out),
                (block_tok, block_len, block_slot, scale, xa, b_flat), out, "lora_sgmv_expand",
                block_m=cfg.block_m, **common)
    return _call(_bgmv_expand_kernel, (pl.cdiv(t_len, cfg.bgmv_tokens), n_out),
                 (token_slot, scale, xa, b_flat), out, "lora_bgmv_expand",
                 tokens=cfg.bgmv_tokens, **common)


def _config(config) -> LoRAConfig:
    cfg = LoRAConfig(**config)
    for name in ("block_m", "block_k", "block_n"):
        val = getattr(cfg, name)
        if not _is_pow2(val) or val < 16:
            raise ValueError(f"{name} must be a power of two >= 16, got {val}")
    for name in ("sgmv_min_len", "bgmv_tokens"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.max_runs is not None and cfg.max_runs < 1:
        raise ValueError(f"max_runs must be >= 1 or None, got {cfg.max_runs}")
    return cfg


def lora_shrink_pallas(x, lora_a, slot, *, interpret: bool = False, **config):
    """``x @ A[slot]`` per token (SGMV + BGMV): ``[T, r]`` float32, zeros for base tokens.

    Linear in x: under tensor parallelism with ``in`` sharded, sum the shards' results before
    :func:`lora_expand_pallas`."""
    if x.ndim != 2 or lora_a.ndim != 3 or lora_a.shape[1] != x.shape[1]:
        raise ValueError(f"x must be [T, in] and A [L, in, r]; got {x.shape}, {lora_a.shape}")
    if slot.shape != (x.shape[0],):
        raise ValueError(f"slot {slot.shape} must be [T] = {(x.shape[0],)}")
    return _shrink(x, lora_a, slot.astype(jnp.int32), cfg=_config(config),
                   interpret=bool(interpret))


def lora_expand_pallas(xa, lora_b, slot, scale, *, out_dtype=jnp.float32,
                       interpret: bool = False, **config):
    """``scale[slot] * xa @ B[slot]`` per token (SGMV + BGMV): ``[T, out]`` in ``out_dtype``,
    zeros for base tokens."""
    if xa.ndim != 2 or lora_b.ndim != 3 or lora_b.shape[1] != xa.shape[1]:
        raise ValueError(f"xa must be [T, r] and B [L, r, out]; got {xa.shape}, {lora_b.shape}")
    if slot.shape != (xa.shape[0],) or scale.shape != (lora_b.shape[0],):
        raise ValueError(f"slot {slot.shape} must be [T] and scale {scale.shape} [L]")
    return _expand(xa, lora_b, slot.astype(jnp.int32), scale, cfg=_config(config),
                   interpret=bool(interpret), out_dtype=jnp.dtype(out_dtype))


def lora_delta_pallas(x, lora_a, lora_b, slot, scale, *, interpret: bool = False, **config):
    """The LoRA delta of every token (Pallas SGMV + BGMV): ``[T, out]`` in x's dtype.

    ``config`` overrides :class:`LoRAConfig` fields. Ranks are padded to a power of two >= 16
    inside (zero columns of A, zero rows of B: the same delta; a copy of the slots each call, so
    allocate them at such a rank)."""
    _check(x, lora_a, lora_b, slot, scale)
    xa = lora_shrink_pallas(x, lora_a, slot, interpret=interpret, **config)
    return lora_expand_pallas(xa, lora_b, slot, scale, out_dtype=x.dtype, interpret=interpret,
                              **config)
