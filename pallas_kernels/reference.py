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
):
    """Causal attention of every new token against its sequence's pages.

    q: ``[T, Hq, D]``; query_start: ``[S+1]`` prefix sums of new tokens; seq_lens: ``[S]`` context
    length after this step (0 = padding row); block_tables: ``[S, M]``. A row may be a prefill
    chunk whose earlier context is already in the pages, or a single decode token. The new K/V
    must already be written to the pages. Rows of padded tokens come back as zeros. kv_scale:
    optional ``[Hkv, 2]`` K/V scales of float8 pages (module docstring).
    Returns ``[T, Hq, D]`` in q's dtype.
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
    mask = mask & (kv_pos[None, None, :] <= pos[:, None, None])
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
