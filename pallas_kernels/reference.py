"""Pure-jnp references of every kernel.

They are the ground truth for the kernel tests and the XLA path used on CPU (never interpret-mode
Pallas outside tests), so they are written to be vectorised, not clever.

KV page layout (one layer): ``k_pages``, ``v_pages`` of shape ``[num_kv_heads, num_pages,
page_size, head_dim]``. A page of one KV head is contiguous, which is what the GPU kernel wants
to stream. Page 0 is the trash page: padded tokens write there.

KV scales (float8 pages): ``kv_scale`` is float32 ``[num_kv_heads, 2]``, column 0 the K scale and
column 1 the V scale of each KV head. A page holds ``k / k_scale`` (saturated at the format's
maximum); attention reads ``page * k_scale``, which every path folds in as ``scores *= k_scale``
(before the soft cap and softmax) and ``output *= v_scale``. ``None`` (the default, and always
with serving-dtype pages) means 1.0 and adds no work.

Visibility limits (bidirectional runs, e.g. Gemma 4's image tokens on its sliding layers):
``kv_limit`` is int32 ``[T]``, the last key position each new token may see. A token sees the
key positions ``<= max(pos, kv_limit)`` (and inside its context and sliding window, whose lower
bound stays ``pos - window``): a value below the token's position (-1 is the "off" value) keeps
it causal; a token inside a run of tokens that see each other carries the run's last position.
``None`` (the default) is causal attention, and every kernel then compiles as without it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def write_kv(k_pages, v_pages, k, v, slot_mapping, kv_scale=None):
    """Scatter the step's new K/V (``[T, Hkv, D]``) into their slots (page*page_size+offset),
    divided by ``kv_scale`` (``[Hkv, 2]``, see the module docstring) when given.

    Under buffer donation XLA performs this scatter in place: no copy of the pool.
    """
    hkv, num_pages, page_size, d = k_pages.shape
    k_s = v_s = None
    if kv_scale is not None:
        k_s, v_s = kv_scale[:, 0, None, None], kv_scale[:, 1, None, None]
    kf = k_pages.reshape(hkv, num_pages * page_size, d)
    vf = v_pages.reshape(hkv, num_pages * page_size, d)
    kf = kf.at[:, slot_mapping].set(to_page_dtype(jnp.swapaxes(k, 0, 1), k_pages.dtype, k_s),
                                    mode="drop")
    vf = vf.at[:, slot_mapping].set(to_page_dtype(jnp.swapaxes(v, 0, 1), v_pages.dtype, v_s),
                                    mode="drop")
    return kf.reshape(k_pages.shape), vf.reshape(v_pages.shape)


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype).itemsize == 1 and jnp.issubdtype(dtype, jnp.floating)


def to_page_dtype(x, dtype, scale=None):
    """Cast new K/V to the pool's dtype; float8 pages hold ``x / scale`` and saturate
    (e4m3fn has no infinity)."""
    if is_fp8(dtype):
        x = x.astype(jnp.float32)
        if scale is not None:
            x = x / scale
        big = float(jnp.finfo(dtype).max)
        x = jnp.clip(x, -big, big)
    return x.astype(dtype)


def scaled_queries(q, kv_scale):
    """``q [..., Hkv, G, D]`` (float32) times each KV head's K scale: the scores then come out
    multiplied by ``k_scale``, as if the pages had been dequantized."""
    if kv_scale is None:
        return q
    return q * kv_scale[:, 0, None, None].astype(jnp.float32)


def scaled_output(out, kv_scale):
    """``out [..., Hkv, G, D]`` (float32) times each KV head's V scale."""
    if kv_scale is None:
        return out
    return out * kv_scale[:, 1, None, None].astype(jnp.float32)


def visible_limit(pos, kv_limit):
    """Each token's last visible key position: its own, or ``kv_limit`` where that is later."""
    return pos if kv_limit is None else jnp.maximum(pos, kv_limit.astype(jnp.int32))


def token_metadata(query_start, seq_lens, num_tokens):
    """Per-token (sequence index, absolute position, valid) from the ragged step metadata."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq_of = jnp.searchsorted(query_start[1:], t, side="right").astype(jnp.int32)
    num_seqs = seq_lens.shape[0]
    valid = seq_of < num_seqs
    seq_c = jnp.minimum(seq_of, num_seqs - 1)
    q_len = query_start[seq_c + 1] - query_start[seq_c]
    pos = seq_lens[seq_c] - q_len + (t - query_start[seq_c])
    valid = valid & (seq_lens[seq_c] > 0)
    return seq_c, pos, valid


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
):
    """Causal attention of every new token against its sequence's pages.

    q: ``[T, Hq, D]``; query_start: ``[S+1]`` prefix sums of new tokens; seq_lens: ``[S]`` context
    length after this step (0 = padding row); block_tables: ``[S, M]``. A row may be a prefill
    chunk whose earlier context is already in the pages, or a single decode token. The new K/V
    must already be written to the pages. Rows of padded tokens come back as zeros. kv_scale:
    optional ``[Hkv, 2]`` K/V scales of float8 pages; kv_limit: optional ``[T]`` last visible
    key position of each token (module docstring). Returns ``[T, Hq, D]`` in q's dtype.
    """
    del num_seqs  # padding rows have seq_lens == 0; the reference needs no count
    t_len, hq, d = q.shape
    hkv, _, page_size, _ = k_pages.shape
    group = hq // hkv
    s_len, max_pages = block_tables.shape
    ctx = max_pages * page_size

    # Gather every sequence's context: [S, Hkv, ctx, D].
    k_ctx = k_pages[:, block_tables].reshape(hkv, s_len, ctx, d).swapaxes(0, 1)
    v_ctx = v_pages[:, block_tables].reshape(hkv, s_len, ctx, d).swapaxes(0, 1)

    seq_of, pos, valid = token_metadata(query_start, seq_lens, t_len)
    qg = scaled_queries(q.reshape(t_len, hkv, group, d).astype(jnp.float32), kv_scale)
    # Scores of every token against every sequence's context; the mask keeps its own.
    scores = jnp.einsum(
        "tkgd,skcd->tkgsc", qg, k_ctx.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    ) * sm_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    kv_pos = jnp.arange(ctx, dtype=jnp.int32)
    mask = (seq_of[:, None] == jnp.arange(s_len)[None, :])[:, :, None]  # [T, S, 1]
    hi = visible_limit(pos, kv_limit)
    mask = mask & (kv_pos[None, None, :] <= hi[:, None, None])
    mask = mask & (kv_pos[None, None, :] < seq_lens[None, :, None])
    if sliding_window is not None:
        mask = mask & (kv_pos[None, None, :] > pos[:, None, None] - sliding_window)
    mask = mask & valid[:, None, None]
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    scores = scores.reshape(t_len, hkv, group, s_len * ctx)
    m = jnp.max(scores, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(scores - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0, 1.0, denom)
    p = p.reshape(t_len, hkv, group, s_len, ctx)
    out = jnp.einsum(
        "tkgsc,skcd->tkgd", p, v_ctx.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    )
    return scaled_output(out, kv_scale).reshape(t_len, hq, d).astype(q.dtype)


# ------------------------------------------------------------------------------------------
# Gated DeltaNet (Qwen3.5 / Qwen3.6 linear-attention layers)
#
# State pools, one slot per running request (float32):
#   delta-rule state ``[num_slots, H_v, D_k, D_v]``; conv state ``[num_slots, conv_dim, K-1]``
#   (the last K-1 conv inputs, oldest first).
# A row of the step reads its slot (``state_slots[S]``) and writes it back after its last token.
# A row whose context before this step is empty (``seq_lens - q_len == 0``: a new request, or
# one recomputed after preemption) starts from zeros instead. Padding rows (``seq_lens == 0``)
# neither read nor write the pool, whatever their slot, and their tokens come back as zeros.
#
# Snapshots (speculative decoding): with ``snapshot_slots [S, W]``, a real row of at most W new
# tokens (a decode, or a verify row of k+1 tokens) also writes its state after its i-th new token
# to slot ``snapshot_slots[b, i]`` (skipped where < 0), so a step that accepts only some draft
# tokens can resume from the state of the last accepted one. Longer rows write no snapshots.
# Snapshot slots must differ from every row's state slot.
# ------------------------------------------------------------------------------------------


def row_metadata(query_start, seq_lens):
    """Per row: number of new tokens, whether it is real, whether it starts from a zero state."""
    q_len = query_start[1:] - query_start[:-1]
    real = (seq_lens > 0) & (q_len > 0)
    fresh = seq_lens - q_len <= 0
    return q_len, real, fresh


def l2_normalize(x, eps: float = 1e-6):
    """``x / sqrt(sum(x^2) + eps)`` over the last axis, in float32 (the FLA / HF definition)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def gdn_inputs(q, k, v, g, beta, *, scale, use_qk_l2norm):
    """float32 q (normalised, scaled), k (normalised) repeated to the value heads, v, g, beta.

    Key head ``j`` serves value heads ``j*G .. j*G+G-1`` (HF's ``repeat_interleave``)."""
    hk, hv = q.shape[1], v.shape[1]
    if hv % hk:
        raise ValueError(f"value heads {hv} not a multiple of key heads {hk}")
    q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    q, k = jnp.repeat(q, hv // hk, axis=1), jnp.repeat(k, hv // hk, axis=1)
    return q, k, v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32)


def snapshot_targets(query_start, seq_lens, snapshot_slots, num_tokens, num_slots):
    """Per token: the slot its post-token state is snapshotted to, ``num_slots`` (out of range,
    dropped) where none."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq_of, _, valid = token_metadata(query_start, seq_lens, num_tokens)
    width = snapshot_slots.shape[1]
    q_len, _, _ = row_metadata(query_start, seq_lens)
    off = t - query_start[seq_of]
    slot = snapshot_slots[seq_of, jnp.clip(off, 0, width - 1)]
    ok = valid & (q_len[seq_of] <= width) & (slot >= 0) & (slot < num_slots)
    return jnp.where(ok, slot, num_slots).astype(jnp.int32)


def gated_delta_rule(q, k, v, g, beta, state, query_start, seq_lens, state_slots, *,
                     scale: float | None = None, use_qk_l2norm: bool = True,
                     snapshot_slots=None):
    """The gated delta rule over a ragged step, one token at a time (the definition).

    q, k: ``[T, H_k, D_k]``; v: ``[T, H_v, D_v]``; g: ``[T, H_v]`` the decay in log space (<= 0);
    beta: ``[T, H_v]``; state: the pool ``[N, H_v, D_k, D_v]`` float32; query_start ``[S+1]``,
    seq_lens ``[S]``, state_slots ``[S]`` as in the step plan. Per token, per value head::

        S = exp(g) * S;  S += k (beta * (v - k^T S))^T;  o = q^T S

    with q, k l2-normalised (``use_qk_l2norm``) and q scaled by ``scale`` (default D_k^-0.5).
    Returns ``(o [T, H_v, D_v] in q's dtype, state)`` with each real row's final state written to
    its slot (and its snapshots, when ``snapshot_slots`` is given).
    """
    t_len = q.shape[0]
    num_slots = state.shape[0]
    qf, kf, vf, gf, bf = gdn_inputs(q, k, v, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm)
    seq_of, _, valid = token_metadata(query_start, seq_lens, t_len)
    _, real, fresh = row_metadata(query_start, seq_lens)
    slots = jnp.clip(state_slots, 0, num_slots - 1)
    init = jnp.where(fresh[:, None, None, None], 0.0, state[slots].astype(jnp.float32))

    def step(states, xs):
        seq, ok, qt, kt, vt, gt, bt = xs
        s = states[seq] * jnp.exp(gt)[:, None, None]
        kv_mem = jnp.einsum("hkv,hk->hv", s, kt, precision=jax.lax.Precision.HIGHEST)
        delta = (vt - kv_mem) * bt[:, None]
        s = s + kt[:, :, None] * delta[:, None, :]
        o = jnp.einsum("hkv,hk->hv", s, qt, precision=jax.lax.Precision.HIGHEST)
        states = states.at[seq].set(jnp.where(ok, s, states[seq]))
        return states, (jnp.where(ok, o, 0.0), None if snapshot_slots is None else s)

    states, (out, per_token) = jax.lax.scan(step, init, (seq_of, valid, qf, kf, vf, gf, bf))
    target = jnp.where(real, slots, num_slots)  # out of range: dropped
    state = state.at[target].set(states.astype(state.dtype), mode="drop")
    if snapshot_slots is not None:
        snap = snapshot_targets(query_start, seq_lens, snapshot_slots, t_len, num_slots)
        state = state.at[snap].set(per_token.astype(state.dtype), mode="drop")
    return out.astype(q.dtype), state


def causal_conv1d(x, weight, bias, conv_state, query_start, seq_lens, state_slots, *,
                  activation: str | None = "silu", snapshot_slots=None):
    """Depthwise causal conv over a ragged step, its history carried in the conv-state pool.

    x: ``[T, C]``; weight: ``[C, K]`` (HF's ``conv1d.weight.squeeze(1)``); bias: ``[C]`` or None;
    conv_state: the pool ``[N, C, K-1]``. Token t of a row sees the row's K-1 inputs before it
    (from the pool where they precede this step), ``y = act(sum_j w[:, j] * x[t-K+1+j] + b)``.
    Returns ``(y [T, C] in x's dtype, conv_state)`` with each real row's last K-1 inputs written
    to its slot (and its snapshots, when ``snapshot_slots`` is given).
    """
    t_len = x.shape[0]
    num_slots = conv_state.shape[0]
    seq_of, _, valid = token_metadata(query_start, seq_lens, t_len)
    _, real, fresh = row_metadata(query_start, seq_lens)
    slots = jnp.clip(state_slots, 0, num_slots - 1)
    init = jnp.where(fresh[:, None, None], 0.0, conv_state[slots].astype(jnp.float32))
    w = weight.astype(jnp.float32)

    def step(states, xs):
        seq, ok, xt = xs
        window = jnp.concatenate([states[seq], xt[:, None]], axis=1)  # [C, K] oldest first
        y = jnp.sum(window * w, axis=1)
        states = states.at[seq].set(jnp.where(ok, window[:, 1:], states[seq]))
        return states, (jnp.where(ok, y, 0.0), None if snapshot_slots is None else window[:, 1:])

    states, (y, per_token) = jax.lax.scan(step, init, (seq_of, valid, x.astype(jnp.float32)))
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    y = apply_activation(y, activation)
    y = jnp.where(valid[:, None], y, 0.0)
    target = jnp.where(real, slots, num_slots)
    conv_state = conv_state.at[target].set(states.astype(conv_state.dtype), mode="drop")
    if snapshot_slots is not None:
        snap = snapshot_targets(query_start, seq_lens, snapshot_slots, t_len, num_slots)
        conv_state = conv_state.at[snap].set(per_token.astype(conv_state.dtype), mode="drop")
    return y.astype(x.dtype), conv_state


def apply_activation(y, activation):
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return jax.nn.silu(y)
    raise ValueError(f"unsupported conv activation {activation!r} (silu or None)")


# ------------------------------------------------------------------------------------------
# LoRA (many adapters in one batch)
#
# Adapter slots on the device: ``A [L, in, r]``, ``B [L, r, out]`` (ranks padded with zeros to
# the slots' ``r``), ``scale [L]`` (lora_alpha / r, or / sqrt(r) with rsLoRA). ``slot [T]`` picks
# each token's adapter; -1 is the base model (no delta).
# ------------------------------------------------------------------------------------------


def lora_delta(x, lora_a, lora_b, slot, scale):
    """``scale[slot] * (x @ A[slot]) @ B[slot]`` per token, zeros where ``slot == -1``.

    x: ``[T, in]``; returns ``[T, out]`` in x's dtype (accumulated in float32)."""
    num_loras = lora_a.shape[0]
    on = (slot >= 0) & (slot < num_loras)
    s = jnp.clip(slot, 0, num_loras - 1)
    hi = jax.lax.Precision.HIGHEST
    xa = jnp.einsum("ti,tir->tr", x.astype(jnp.float32), lora_a[s].astype(jnp.float32),
                    precision=hi)
    out = jnp.einsum("tr,tro->to", xa, lora_b[s].astype(jnp.float32), precision=hi)
    # selected, not masked by multiplication: a base row never touches a slot's values
    out = jnp.where(on[:, None], out * scale[s].astype(jnp.float32)[:, None], 0.0)
    return out.astype(x.dtype)


def int8_matmul_reference(x, weight, weight_scale):
    """``x[M, K] @ (weight[N, K] * weight_scale[N]).T`` with the activation in two int8 terms
    per row: ``x / a = hi + lo / 254``, ``a = max|x| / 127``; int8 x int8 -> int32 dots;
    ``(hi_acc + lo_acc / 254) * a * weight_scale``. float32 in and out."""
    xf = x.astype(jnp.float32)
    a_scale = jnp.maximum(jnp.max(jnp.abs(xf), axis=-1, keepdims=True) / 127.0, 1e-12)
    hi = jnp.clip(jnp.round(xf / a_scale), -127, 127)
    lo = jnp.clip(jnp.round((xf / a_scale - hi) * 254.0), -127, 127)
    rows = xf.shape[0]
    xq = jnp.concatenate([hi, lo]).astype(jnp.int8)
    acc = jax.lax.dot_general(xq, weight, (((1,), (1,)), ((), ())),
                              preferred_element_type=jnp.int32).astype(jnp.float32)
    return (acc[:rows] + acc[rows:] * (1.0 / 254.0)) * a_scale * weight_scale
