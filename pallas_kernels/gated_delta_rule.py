"""Gated DeltaNet over a ragged step: the XLA path (CPU, and any device without a kernel).

Same arguments and results as :func:`pallas_kernels.reference.gated_delta_rule` and
:func:`pallas_kernels.reference.causal_conv1d` (the state-pool layout and the row rules are
described there). One fixed-shape graph serves any mix of prefill chunks, decodes and padding:

* **Decode rows** (one new token; up to W with ``snapshot_slots [S, W]``, the verify rows of
  speculative decoding) take the recurrent update, all rows at once, W steps, each token's state
  snapshotted where asked (see :mod:`pallas_kernels.reference`).
* **Longer rows** are cut into chunks of ``chunk_size`` (64) tokens, taken one after another by a
  loop whose trip count is the step's real number of chunks (zero in a decode-only step). A
  chunk is the WY/UT form of the rule: with ``gc`` the cumulative decay inside the chunk and
  ``Γ[i,j] = exp(gc_i - gc_j)`` for ``i >= j``,

      (I + tril(diag(β) K Kᵀ ∘ Γ, -1)) [U | W] = [diag(β) V | diag(β exp(gc)) K]
      V' = U - W S;   O = diag(exp(gc)) Q S + (Q Kᵀ ∘ Γ) V'
      S  = exp(gc_last) S + (diag(exp(gc_last - gc)) K)ᵀ V'

  which is the token-by-token recurrence regrouped into matmuls (HF's
  ``torch_chunk_gated_delta_rule``). Tokens past a row's end enter a chunk with k = v = β = g = 0,
  which leaves the state and the other tokens untouched.

The pool is updated functionally (donate it at the jit boundary to update it in place); only real
rows write their slot.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.reference import (
    apply_activation,
    gdn_inputs,
    row_metadata,
    token_metadata,
)

CHUNK_SIZE = 64
STATE_DTYPE = jnp.float32
_HI = lax.Precision.HIGHEST


def state_shapes(*, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel: int) -> dict[str, tuple[int, ...]]:
    """Per-slot shapes of one GDN layer's two state pools (both :data:`STATE_DTYPE`): the conv
    history over the q/k/v channels (in ``in_proj_qkv``'s order) and the delta-rule state."""
    conv_dim = 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim
    return {"conv": (conv_dim, conv_kernel - 1),
            "recurrent": (num_v_heads, head_k_dim, head_v_dim)}


def _mm(spec, a, b):
    return jnp.einsum(spec, a, b, precision=_HI)


def recurrent_step(s, q, k, v, g, beta):
    """One token of every (row, head): ``s [..., Dk, Dv]``, ``q, k [..., Dk]``, ``v [..., Dv]``,
    ``g, beta [...]``. Returns (output ``[..., Dv]``, new state)."""
    s = s * jnp.exp(g)[..., None, None]
    kv_mem = jnp.sum(s * k[..., :, None], axis=-2)
    delta = (v - kv_mem) * beta[..., None]
    s = s + k[..., :, None] * delta[..., None, :]
    return jnp.sum(s * q[..., :, None], axis=-2), s


def _forward_substitution(a, b):
    """``x`` with ``a x = b`` for unit lower triangular ``a [..., C, C]``, one row at a time."""
    c = a.shape[-1]
    cols = jnp.arange(c)

    def row(i, x):
        done = _mm("...j,...jd->...d", jnp.where(cols < i, a[..., i, :], 0.0), x)
        return x.at[..., i, :].set(b[..., i, :] - done)

    return lax.fori_loop(0, c, row, jnp.zeros_like(b))


def solve_unit_lower(a, b):
    """The chunk's unit lower triangular system. On CPU by forward substitution: LAPACK's
    triangular solve is a custom call that deadlocks inside a program over several CPU devices
    (tensor parallelism on forced host devices); elsewhere the platform's triangular solve."""
    return lax.platform_dependent(
        a, b, cpu=_forward_substitution,
        default=lambda a, b: jax.scipy.linalg.solve_triangular(a, b, lower=True,
                                                               unit_diagonal=True))


def chunk_step(s, q, k, v, g, beta):
    """One chunk of one row, every head: ``s [H, Dk, Dv]``, ``q, k [C, H, Dk]``, ``v [C, H, Dv]``,
    ``g, beta [C, H]`` (tokens past the row's end zeroed). Returns (``o [C, H, Dv]``, new state)."""
    c = q.shape[0]
    q, k, v = (jnp.swapaxes(a, 0, 1) for a in (q, k, v))  # [H, C, D]
    g, beta = g.T, beta.T  # [H, C]
    gc = jnp.cumsum(g, axis=-1)
    row = lax.broadcasted_iota(jnp.int32, (c, c), 0)
    col = lax.broadcasted_iota(jnp.int32, (c, c), 1)
    decay = jnp.exp(jnp.where(row >= col, gc[:, :, None] - gc[:, None, :], -jnp.inf))
    kb = k * beta[..., None]
    a = jnp.where(row > col, _mm("hik,hjk->hij", kb, k) * decay, 0.0)
    system = a + jnp.eye(c, dtype=a.dtype)
    rhs = jnp.concatenate([v * beta[..., None], kb * jnp.exp(gc)[..., None]], axis=-1)
    uw = solve_unit_lower(system, rhs)
    u, w = uw[..., : v.shape[-1]], uw[..., v.shape[-1]:]
    v_new = u - _mm("hck,hkv->hcv", w, s)
    o = _mm("hck,hkv->hcv", q * jnp.exp(gc)[..., None], s)
    o = o + _mm("hij,hjv->hiv", _mm("hik,hjk->hij", q, k) * decay, v_new)
    g_last = gc[:, -1]
    k_tail = k * jnp.exp(g_last[:, None] - gc)[..., None]
    s = s * jnp.exp(g_last)[:, None, None] + _mm("hck,hcv->hkv", k_tail, v_new)
    return jnp.swapaxes(o, 0, 1), s


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "chunk_size"))
def gated_delta_rule(q, k, v, g, beta, state, query_start, seq_lens, state_slots, *,
                     scale: float | None = None, use_qk_l2norm: bool = True,
                     chunk_size: int = CHUNK_SIZE, snapshot_slots=None):
    """The gated delta rule over a ragged step (see :func:`reference.gated_delta_rule`).

    Returns ``(o [T, H_v, D_v] in q's dtype, state)``."""
    t_len = q.shape[0]
    num_slots = state.shape[0]
    hv, dv = v.shape[1:]
    qf, kf, vf, gf, bf = gdn_inputs(q, k, v, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm)
    _, _, valid = token_metadata(query_start, seq_lens, t_len)
    q_len, real, fresh = row_metadata(query_start, seq_lens)
    slots = jnp.clip(state_slots, 0, num_slots - 1)
    states = jnp.where(fresh[:, None, None, None], 0.0, state[slots].astype(jnp.float32))
    row_start = query_start[:-1]

    # Decode rows: the recurrent update of every row at once, token j of each in step j.
    width = 1 if snapshot_slots is None else max(1, snapshot_slots.shape[1])
    is_dec = real & (q_len <= width)
    out = jnp.zeros((t_len + chunk_size, hv, dv), jnp.float32)
    snaps = []
    for j in range(width):
        act = is_dec & (q_len > j)
        tj = jnp.clip(row_start + j, 0, t_len - 1)
        o_j, s_j = recurrent_step(states, qf[tj], kf[tj], vf[tj], gf[tj], bf[tj])
        states = jnp.where(act[:, None, None, None], s_j, states)
        out = out.at[jnp.where(act, row_start + j, t_len + chunk_size)].set(o_j, mode="drop")
        if snapshot_slots is not None:
            sj = snapshot_slots[:, j]
            snaps.append((jnp.where(act & (sj >= 0) & (sj < num_slots), sj, num_slots), s_j))

    # Longer rows: their chunks one after another.
    n_chunks = jnp.where(real & (q_len > width), (q_len + chunk_size - 1) // chunk_size, 0)
    chunk_end = jnp.cumsum(n_chunks)
    pad = lambda a: jnp.concatenate([a, jnp.zeros((chunk_size,) + a.shape[1:], a.dtype)])
    qp, kp, vp, gp, bp = (pad(a) for a in (qf, kf, vf, gf, bf))
    pos = jnp.arange(chunk_size, dtype=jnp.int32)

    def body(c, carry):
        states, out = carry
        row = jnp.searchsorted(chunk_end, c, side="right").astype(jnp.int32)
        j = c - (chunk_end[row] - n_chunks[row])
        start = row_start[row] + j * chunk_size
        live = pos < q_len[row] - j * chunk_size
        take = lambda a: lax.dynamic_slice_in_dim(a, start, chunk_size, 0)
        m3 = live[:, None, None]
        o, s = chunk_step(
            states[row], take(qp), jnp.where(m3, take(kp), 0.0), jnp.where(m3, take(vp), 0.0),
            jnp.where(live[:, None], take(gp), 0.0), jnp.where(live[:, None], take(bp), 0.0),
        )
        states = lax.dynamic_update_index_in_dim(states, s, row, 0)
        out = lax.dynamic_update_slice_in_dim(out, jnp.where(m3, o, take(out)), start, 0)
        return states, out

    states, out = lax.fori_loop(0, chunk_end[-1], body, (states, out))
    out = jnp.where(valid[:, None, None], out[:t_len], 0.0)
    target = jnp.where(real, slots, num_slots)  # out of range: dropped
    state = state.at[target].set(states.astype(state.dtype), mode="drop")
    for snap, s_j in snaps:
        state = state.at[snap].set(s_j.astype(state.dtype), mode="drop")
    return out.astype(q.dtype), state


@functools.partial(jax.jit, static_argnames=("activation",))
def causal_conv1d(x, weight, bias, conv_state, query_start, seq_lens, state_slots, *,
                  activation: str | None = "silu", snapshot_slots=None):
    """Depthwise causal conv with its history in the conv-state pool, every token at once
    (see :func:`reference.causal_conv1d`). Returns ``(y [T, C] in x's dtype, conv_state)``."""
    t_len, _ = x.shape
    num_slots, _, km1 = conv_state.shape
    kernel = km1 + 1
    if weight.shape != (x.shape[1], kernel):
        raise ValueError(f"weight {weight.shape} does not match x {x.shape} and conv_state "
                         f"{conv_state.shape} (want [C, K] with K-1 state columns)")
    seq_of, _, valid = token_metadata(query_start, seq_lens, t_len)
    q_len, real, fresh = row_metadata(query_start, seq_lens)
    slots = jnp.clip(state_slots, 0, num_slots - 1)
    hist = jnp.where(fresh[:, None, None], 0.0, conv_state[slots].astype(jnp.float32))  # [S,C,K-1]
    xf = x.astype(jnp.float32)
    t = jnp.arange(t_len, dtype=jnp.int32)
    off = t - query_start[seq_of]  # token's offset in its row

    # Input j steps back: from this step's tokens, or the row's history column K-1-j+off.
    y = jnp.zeros_like(xf)
    for j in range(kernel):
        from_x = xf[jnp.clip(t - j, 0, t_len - 1)]
        col = jnp.clip(km1 - j + off, 0, max(km1 - 1, 0))
        from_hist = hist[seq_of, :, col] if km1 else jnp.zeros_like(xf)
        y = y + weight[:, kernel - 1 - j].astype(jnp.float32) * jnp.where(
            (j <= off)[:, None], from_x, from_hist)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    y = jnp.where(valid[:, None], apply_activation(y, activation), 0.0)

    # New history: the last K-1 of [history, this step's first n inputs] per row.
    def history_after(n):  # n: [S, ...] tokens taken -> [S, ..., C, K-1]
        src = n[..., None] + jnp.arange(km1, dtype=jnp.int32)  # position in the concatenation
        tok = jnp.clip(query_start[:-1].reshape((-1,) + (1,) * (src.ndim - 1)) + src - km1,
                       0, t_len - 1)
        from_x = jnp.swapaxes(xf[tok], -1, -2)
        col = jnp.clip(src, 0, max(km1 - 1, 0))
        hist_b = hist.reshape(hist.shape[:1] + (1,) * (src.ndim - 2) + hist.shape[1:])
        from_hist = jnp.take_along_axis(
            jnp.broadcast_to(hist_b, src.shape[:-1] + hist.shape[1:]),
            jnp.broadcast_to(col[..., None, :], src.shape[:-1] + hist.shape[1:]), axis=-1)
        return jnp.where((src >= km1)[..., None, :], from_x, from_hist)

    target = jnp.where(real, slots, num_slots)
    conv_state = conv_state.at[target].set(history_after(q_len).astype(conv_state.dtype),
                                           mode="drop")
    if snapshot_slots is not None:
        width = snapshot_slots.shape[1]
        i = jnp.arange(width, dtype=jnp.int32)
        ok = (real & (q_len <= width))[:, None] & (i[None, :] < q_len[:, None])
        ok = ok & (snapshot_slots >= 0) & (snapshot_slots < num_slots)
        snap = jnp.where(ok, snapshot_slots, num_slots).reshape(-1)
        after = history_after(jnp.broadcast_to(i[None, :] + 1, ok.shape))  # [S, W, C, K-1]
        conv_state = conv_state.at[snap].set(
            after.reshape((-1,) + after.shape[2:]).astype(conv_state.dtype), mode="drop")
    return y.astype(x.dtype), conv_state
