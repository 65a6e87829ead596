"""Gated DeltaNet as Pallas kernels (Triton lowering on GPU, ``interpret=True`` on CPU).

Drop-in for :func:`pallas_kernels.reference.gated_delta_rule`: same arguments, same result; the
state pool is read and written in place through each row's slot (aliased input -> output).

How the work is cut: one program per (row, value head, block of ``block_v`` state columns),
the state tile ``[D_k, block_v]`` held in registers for the whole row, read from the pool once
and written back once. Two calls, each program leaving at once when its row is not its call's
(the prefill call's programs count only the rows that can be long: ``T // (decode_max_tokens +
1)``, program b taking the b-th long row):

* **decode** (rows of at most ``decode_max_tokens`` new tokens): the recurrent update, token by
  token (``S = e^g S; S += k (β (v - kᵀS))ᵀ; o = qᵀS``): vector work, the state traffic is the
  cost.
  It also writes the per-token snapshots of speculative verify rows (``snapshot_slots``).
* **prefill** (longer rows): the row's chunks of ``chunk_size`` tokens in order, each in the WY/UT
  form of :mod:`pallas_kernels.gated_delta_rule` (matmuls of ``chunk x D``); the unit lower
  triangular system of a chunk is inverted in registers by forward substitution (one row per
  step, masked vector ops: Triton has no triangular solve).

q/k are l2-normalised and q scaled inside the kernels; g and beta arrive as float32.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.ragged_paged_attention import _is_pow2, _next_pow2, _TritonParams


@dataclasses.dataclass(frozen=True)
class GDNConfig:
    """Tile and launch parameters (static)."""

    chunk_size: int = 64
    block_v: int = 64
    decode_max_tokens: int = 8
    prefill_num_warps: int = 8
    decode_num_warps: int = 4
    num_stages: int = 1
    # "highest": float32 matmuls (IEEE); "default": the device's fast float32 (TF32 on a GPU).
    dot_precision: str = "highest"


_PRECISION = {"highest": lax.Precision.HIGHEST, "default": lax.Precision.DEFAULT}


def _dot(a, b, ca, cb, precision="highest"):
    return lax.dot_general(a, b, (((ca,), (cb,)), ((), ())), precision=_PRECISION[precision],
                           preferred_element_type=jnp.float32)


def _l2norm(x):
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _row(b, qs_ref, sl_ref, slot_ref, num_slots):
    q0 = qs_ref[b]
    q_len = qs_ref[b + 1] - q0
    sl = sl_ref[b]
    slot = jnp.clip(slot_ref[b], 0, num_slots - 1)
    return q0, q_len, sl, slot, (sl > 0) & (q_len > 0), sl - q_len <= 0


def _gdn_kernel(qs_ref, sl_ref, slot_ref, q_ref, k_ref, v_ref, g_ref, b_ref, *refs, decode, hk,
                hv, dk, block_v, chunk, max_dec, scale, l2, num_slots, snap_width, precision):
    """One (row, value head, column block). ``refs``: the snapshot slots ``[S * W]`` when
    ``snap_width`` (decode call only), then the aliased output and pool, the output and pool."""
    snap_ref = None
    if snap_width:
        snap_ref, refs = refs[0], refs[1:]
    _o_alias, s_in_ref, o_ref, s_ref = refs
    b = pl.program_id(0)
    h = pl.program_id(1)
    if decode:
        q0, q_len, _, slot, real, fresh = _row(b, qs_ref, sl_ref, slot_ref, num_slots)
        mine = real & (q_len <= max_dec)
    else:
        # Program b takes the b-th long row (a prefix count over the rows in registers): the
        # grid holds only as many programs as the bucket can have long rows.
        s_len = sl_ref.shape[0]
        i = lax.broadcasted_iota(jnp.int32, (max(16, _next_pow2(s_len)),), 0)
        ic = jnp.minimum(i, s_len - 1)
        long = (i < s_len) & (sl_ref[ic] > 0) & (qs_ref[ic + 1] - qs_ref[ic] > max_dec)
        rank = jnp.cumsum(long.astype(jnp.int32))
        row = jnp.sum(jnp.where(long & (rank == b + 1), i, 0))
        q0, q_len, _, slot, real, fresh = _row(row, qs_ref, sl_ref, slot_ref, num_slots)
        mine = real & (q_len > max_dec) & (b < jnp.sum(long.astype(jnp.int32)))
    head_k = h // (hv // hk)
    cols = lax.broadcasted_iota(jnp.int32, (1, block_v), 1)

    def load_qk(rows):
        qv = q_ref[rows].astype(jnp.float32)
        kv = k_ref[rows].astype(jnp.float32)
        if l2:
            qv, kv = _l2norm(qv), _l2norm(kv)
        return qv * scale, kv

    def decode_row(s):
        def token(i, s):
            t = q0 + i
            one = lax.broadcasted_iota(jnp.int32, (1,), 0)
            qv, kv = load_qk(t * hk + head_k + one)  # [1, Dk]
            vrow = t * hv + h + one
            vv = v_ref[vrow].astype(jnp.float32)  # [1, BV]
            gv = g_ref[vrow]  # [1]
            bv = b_ref[vrow]
            s = s * jnp.exp(gv)[:, None]
            kc = kv.T  # [Dk, 1]
            kv_mem = jnp.sum(s * kc, axis=0, keepdims=True)  # [1, BV]
            s = s + kc * ((vv - kv_mem) * bv[:, None])
            o = jnp.sum(s * qv.T, axis=0, keepdims=True)
            plgpu.store(o_ref.at[vrow[:, None], cols], o.astype(o_ref.dtype))
            if snap_width:
                snap = snap_ref[b * snap_width + jnp.minimum(i, snap_width - 1)]

                @pl.when((q_len <= snap_width) & (snap >= 0) & (snap < num_slots))
                def _():
                    rows = (snap * hv + h) * dk + lax.broadcasted_iota(jnp.int32, (dk,), 0)
                    plgpu.store(s_ref.at[rows[:, None], cols], s)

            return s

        return lax.fori_loop(0, q_len, token, s)

    dot = functools.partial(_dot, precision=precision)

    def prefill_row(s):
        pos = lax.broadcasted_iota(jnp.int32, (chunk,), 0)
        r2 = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
        c2 = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
        num_rows = o_ref.shape[0]

        def one_chunk(c, s):
            live = pos < q_len - c * chunk
            t = jnp.where(live, q0 + c * chunk + pos, 0)
            qv, kv = load_qk(t * hk + head_k)  # [C, Dk]
            kv = jnp.where(live[:, None], kv, 0.0)
            vrow = t * hv + h
            vv = jnp.where(live[:, None], v_ref[vrow].astype(jnp.float32), 0.0)  # [C, BV]
            gv = jnp.where(live, g_ref[vrow], 0.0)
            bv = jnp.where(live, b_ref[vrow], 0.0)
            gc = jnp.cumsum(gv)
            g_last = jnp.sum(jnp.where(pos == chunk - 1, gc, 0.0))
            lower = r2 >= c2
            decay = jnp.exp(jnp.where(lower, gc[:, None] - gc[None, :], -jnp.inf))
            kb = kv * bv[:, None]
            # M = -(strictly lower part of diag(beta) K K^T o decay); (I - M)^-1 row by row.
            m = jnp.where(r2 > c2, -dot(kb, kv, 1, 1) * decay, 0.0)

            def subst(i, m):
                row = jnp.sum(jnp.where(r2 == i, m, 0.0), axis=0)  # M[i, :]
                new = row + jnp.sum(row[:, None] * m, axis=0)
                return jnp.where(r2 == i, new[None, :], m)

            tinv = lax.fori_loop(1, chunk, subst, m) + jnp.where(r2 == c2, 1.0, 0.0)
            eg = jnp.exp(gc)[:, None]
            u = dot(tinv, vv * bv[:, None], 1, 0)  # [C, BV]
            w = dot(tinv, kb * eg, 1, 0)  # [C, Dk]
            v_new = u - dot(w, s, 1, 0)
            o = dot(qv * eg, s, 1, 0) + dot(dot(qv, kv, 1, 1) * decay, v_new, 1, 0)
            idx = jnp.where(live, vrow, num_rows + pos)  # not real: past the end, dropped
            plgpu.store(o_ref.at[idx[:, None], cols], o.astype(o_ref.dtype),
                        mask=live[:, None])
            k_tail = kv * jnp.exp(g_last - gc)[:, None]
            return s * jnp.exp(g_last) + dot(k_tail, v_new, 0, 0)

        n_chunks = (q_len + chunk - 1) // chunk
        return lax.fori_loop(0, n_chunks, one_chunk, s)

    @pl.when(mine)
    def _():
        s_rows = (slot * hv + h) * dk + lax.broadcasted_iota(jnp.int32, (dk,), 0)
        s = jnp.where(fresh, 0.0, s_in_ref[s_rows].astype(jnp.float32))  # [Dk, BV]
        s = decode_row(s) if decode else prefill_row(s)
        plgpu.store(s_ref.at[s_rows[:, None], cols], s)


def _call(out, state, meta, q_flat, k_flat, v_flat, g_flat, b_flat, snap, *, decode, cfg, hk, hv,
          dk, scale, l2, interpret):
    s_len = meta[1].shape[0]
    snap_width = 0 if snap is None else snap.shape[0] // s_len
    dv = v_flat.shape[1]
    bv = cfg.block_v
    num_slots = state.shape[0] // (hv * dk)
    kernel = functools.partial(
        _gdn_kernel, decode=decode, hk=hk, hv=hv, dk=dk, block_v=bv, chunk=cfg.chunk_size,
        max_dec=cfg.decode_max_tokens, scale=scale, l2=l2, num_slots=num_slots,
        snap_width=snap_width, precision=cfg.dot_precision)
    whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)
    cols = lambda a: pl.BlockSpec((a.shape[0], bv), lambda b, h, j: (0, j))
    # The pool is read through its aliased input: each program reads and writes only its own
    # row's (slot, head, columns) tile, so no program sees another's write.
    # A snapshot goes to another slot, which no other program reads.
    extra = () if snap is None else (snap,)
    args = (*meta, q_flat, k_flat, v_flat, g_flat, b_flat, *extra, out, state)
    in_specs = [whole(a) for a in meta] + [whole(q_flat), whole(k_flat), cols(v_flat),
                                           whole(g_flat), whole(b_flat)]
    in_specs += [whole(a) for a in extra] + [cols(out), cols(state)]
    warps = cfg.decode_num_warps if decode else cfg.prefill_num_warps
    name = "gdn_decode" if decode else f"gdn_prefill_c{cfg.chunk_size}"
    # At most T // (decode_max_tokens + 1) rows of a bucket are long.
    rows = s_len if decode else min(s_len, q_flat.shape[0] // hk // (cfg.decode_max_tokens + 1))
    return pl.pallas_call(
        kernel, grid=(rows, hv, dv // bv), in_specs=in_specs,
        out_specs=[cols(out), cols(state)],
        out_shape=[jax.ShapeDtypeStruct(out.shape, out.dtype),
                   jax.ShapeDtypeStruct(state.shape, state.dtype)],
        input_output_aliases={len(args) - 2: 0, len(args) - 1: 1},
        compiler_params=_TritonParams(num_warps=warps, num_stages=cfg.num_stages),
        interpret=interpret, name=f"{name}_bv{bv}",
    )(*args)


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "cfg", "interpret"))
def _gated_delta_rule(q, k, v, g, beta, state, query_start, seq_lens, state_slots,
                      snapshot_slots, *, scale, use_qk_l2norm, cfg, interpret):
    t, hk, dk = q.shape
    hv, dv = v.shape[1:]
    n = state.shape[0]
    meta = (query_start.astype(jnp.int32), seq_lens.astype(jnp.int32),
            state_slots.astype(jnp.int32))
    flat = dict(q_flat=q.reshape(t * hk, dk), k_flat=k.reshape(t * hk, dk),
                v_flat=v.reshape(t * hv, dv), g_flat=g.astype(jnp.float32).reshape(-1),
                b_flat=beta.astype(jnp.float32).reshape(-1))
    common = dict(cfg=cfg, hk=hk, hv=hv, dk=dk, scale=scale, l2=use_qk_l2norm,
                  interpret=interpret)
    out = jnp.zeros((t * hv, dv), q.dtype)
    s_flat = state.reshape(n * hv * dk, dv)
    snap = None if snapshot_slots is None else snapshot_slots.astype(jnp.int32).reshape(-1)
    if t > cfg.decode_max_tokens:  # else no row can be long
        out, s_flat = _call(out, s_flat, meta, **flat, snap=None, decode=False, **common)
    out, s_flat = _call(out, s_flat, meta, **flat, snap=snap, decode=True, **common)
    return out.reshape(t, hv, dv), s_flat.reshape(state.shape)


def gated_delta_rule(q, k, v, g, beta, state, query_start, seq_lens, state_slots, *,
                     scale: float | None = None, use_qk_l2norm: bool = True,
                     snapshot_slots=None, interpret: bool = False, **config):
    """The gated delta rule over a ragged step (see :func:`reference.gated_delta_rule`).

    ``snapshot_slots [S, W]``: per-token state snapshots of rows of at most W tokens (taken by
    the decode call, whose row limit is raised to W if lower). ``config`` overrides
    :class:`GDNConfig` fields. Returns ``(o [T, H_v, D_v] in q's dtype,
    state)``; donate ``state`` at the caller's jit boundary for an in-place update."""
    cfg = GDNConfig(**config)
    if q.ndim != 3 or k.shape != q.shape or v.ndim != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"q, k must be [T, H_k, D_k] and v [T, H_v, D_v]; got {q.shape}, "
                         f"{k.shape}, {v.shape}")
    t, hk, dk = q.shape
    hv, dv = v.shape[1:]
    if hv % hk:
        raise ValueError(f"value heads {hv} not a multiple of key heads {hk}")
    if g.shape != (t, hv) or beta.shape != (t, hv):
        raise ValueError(f"g {g.shape} and beta {beta.shape} must be [T, H_v] = {(t, hv)}")
    if state.ndim != 4 or state.shape[1:] != (hv, dk, dv) or state.dtype != jnp.float32:
        raise ValueError(f"state must be float32 [N, {hv}, {dk}, {dv}], got {state.dtype} "
                         f"{state.shape}")
    block_v = min(cfg.block_v, dv)
    cfg = dataclasses.replace(cfg, block_v=block_v)
    for name, val in (("D_k", dk), ("block_v", block_v), ("chunk_size", cfg.chunk_size)):
        if not _is_pow2(val) or val < 16:  # Triton's dot needs every dimension >= 16
            raise ValueError(f"{name} must be a power of two >= 16, got {val}")
    if dv % block_v:
        raise ValueError(f"D_v {dv} not a multiple of block_v {block_v}")
    if cfg.dot_precision not in _PRECISION:
        raise ValueError(f"dot_precision must be one of {sorted(_PRECISION)}, got "
                         f"{cfg.dot_precision!r}")
    if cfg.decode_max_tokens < 1:
        raise ValueError(f"decode_max_tokens must be >= 1, got {cfg.decode_max_tokens}")
    if snapshot_slots is not None:
        if snapshot_slots.ndim != 2 or snapshot_slots.shape[0] != seq_lens.shape[0]:
            raise ValueError(f"snapshot_slots must be [S, W] with S = {seq_lens.shape[0]}, got "
                             f"{snapshot_slots.shape}")
        width = snapshot_slots.shape[1]
        cfg = dataclasses.replace(cfg, decode_max_tokens=max(cfg.decode_max_tokens, width))
    scale = float(dk ** -0.5 if scale is None else scale)
    return _gated_delta_rule(q, k, v, g, beta, state, query_start, seq_lens, state_slots,
                             snapshot_slots, scale=scale, use_qk_l2norm=bool(use_qk_l2norm),
                             cfg=cfg, interpret=bool(interpret))
