"""Ragged paged attention in plain jnp/lax: the fast CPU (XLA) serving path.

Drop-in for ``reference.ragged_paged_attention`` (same signature, same result), but it only
touches the pages a step needs. The reference scores every token against every sequence's
whole block table (T * S * max_context); this does about (real tokens) * context of work with
two loops over the real rows only, both with an online softmax over chunks of pages:

* **short rows** (decodes, up to ``SHORT_QUERY`` new tokens): their tokens are gathered into
  blocks of ``TOKEN_BLOCK``; each token reads its own sequence's pages, chunk by chunk, up to
  the longest context in its block.
* **long rows** (prompts, prefill chunks): a loop over those sequences; inside, blocks of
  ``Q_BLOCK`` query rows read their sequence's pages once per chunk, up to the block's causal
  limit.

A step that mixes decodes and a prefill chunk runs each row on the loop that suits it. Small
ops inside XLA CPU loops cost mostly dispatch, so the blocks and chunks are sized to keep the
trip counts low. Page layout as in the reference: ``[num_kv_heads, num_pages, page_size, D]``.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from pallas_kernels.reference import scaled_output, scaled_queries, visible_limit

_HI = lax.Precision.HIGHEST
_NEG = -1e30  # finite "minus infinity": fully masked chunks then contribute exactly zero

SHORT_QUERY = 4  # rows with at most this many new tokens take the per-token loop
# Measured on a 2-core x86 CPU with SmolLM2's shapes (benchmarks/xla_attention_timing.py): each
# loop trip costs far more than its arithmetic, and gathered pages past a row's context are
# wasted, so decode takes a batch of tokens in one block and reads about SHORT_TRIP_POSITIONS
# (tokens x KV positions) per trip: two pages each for 16-32 tokens, 32 pages for one token
# (a long chat history then takes a few trips, not hundreds), and prefill uses small query
# blocks so the causal limit skips most chunks.
TOKEN_BLOCK = 32  # tokens per block in the per-token loop
SHORT_TRIP_POSITIONS = 512  # tokens x KV positions per trip of the per-token loop
SHORT_CHUNK_TOKENS = 32  # at least this many KV positions per trip (whole pages)
Q_BLOCK = 32  # query rows per block in the per-sequence loop
CHUNK_TOKENS = 64  # KV positions per trip of the per-sequence loop (whole pages)


def _online_update(carry, s, pv):
    """One online-softmax step; s: masked scores (``_NEG`` where masked), pv(p) -> p @ V."""
    m, l, acc = carry
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(s > _NEG / 2, jnp.exp(s - m_new[..., None]), 0.0)
    return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv(p)


def _mask(kv_pos, pos, ctx, sliding_window, hi=None):
    """[rows, C]: up to ``hi`` (each row's last visible position; causal: ``pos``), inside the
    context, inside the sliding window (measured from ``pos``)."""
    hi = pos if hi is None else hi
    m = (kv_pos[None, :] <= hi[:, None]) & (kv_pos[None, :] < ctx[:, None])
    if sliding_window is not None:
        m = m & (kv_pos[None, :] > pos[:, None] - sliding_window)
    return m


def _short_rows(out, qg, k_pages, v_pages, rows_idx, n_rows, seq_of, pos, seq_lens, tables, *,
                sliding_window, soft_cap, chunk, tb, limit=None):
    """Tokens ``rows_idx[:n_rows]`` (each against its own sequence) in blocks of ``tb``."""
    hkv, _, page_size, d = k_pages.shape
    g = qg.shape[2]
    ctx_c = chunk * page_size
    t_pad = out.shape[0] - 1  # the last row of ``out`` is the trash row for padding

    def block_body(b, out):
        rows = lax.dynamic_slice_in_dim(rows_idx, b * tb, tb)  # [tb], t_pad = padding
        live = (b * tb + jnp.arange(tb)) < n_rows
        rows = jnp.where(live, rows, t_pad)
        sq = seq_of[rows]
        p_ = jnp.where(live, pos[rows], -1)
        ctx = jnp.where(live, seq_lens[sq], 0)
        lim = None if limit is None else jnp.where(live, limit[rows], -1)
        tab = tables[sq]  # [tb, M]
        qb = qg[rows].swapaxes(0, 1)  # [K, tb, g, D]
        hi = jnp.max(jnp.where(live, (p_ if lim is None else lim) + 1, 0))
        lo = jnp.int32(0)
        if sliding_window is not None:
            lo = jnp.min(jnp.where(live, jnp.maximum(p_ - sliding_window + 1, 0), hi)) // ctx_c

        def kv_body(c, carry):
            pages = lax.dynamic_slice_in_dim(tab, c * chunk, chunk, axis=1)  # [tb, chunk]
            k = k_pages[:, pages].reshape(hkv, tb, ctx_c, d).astype(jnp.float32)
            v = v_pages[:, pages].reshape(hkv, tb, ctx_c, d).astype(jnp.float32)
            s = jnp.einsum("ktgd,ktcd->ktgc", qb, k, precision=_HI)
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            kv_pos = c * ctx_c + jnp.arange(ctx_c, dtype=jnp.int32)
            s = jnp.where(_mask(kv_pos, p_, ctx, sliding_window, lim)[None, :, None, :], s,
                          _NEG)
            return _online_update(
                carry, s, lambda p: jnp.einsum("ktgc,ktcd->ktgd", p, v, precision=_HI))

        init = (jnp.full((hkv, tb, g), _NEG, jnp.float32), jnp.zeros((hkv, tb, g), jnp.float32),
                jnp.zeros((hkv, tb, g, d), jnp.float32))
        _, l, acc = lax.fori_loop(lo, (hi + ctx_c - 1) // ctx_c, kv_body, init)
        o = (acc / jnp.where(l == 0, 1.0, l)[..., None]).swapaxes(0, 1)  # [tb, K, g, D]
        return out.at[rows].set(o)  # padding rows all land on the trash row

    return lax.fori_loop(0, (n_rows + tb - 1) // tb, block_body, out)


def _long_rows(out, qg, k_pages, v_pages, seq_idx, n_long, query_start, seq_lens, tables, *,
               sliding_window, soft_cap, chunk, qb_rows, limit=None):
    """Sequences ``seq_idx[:n_long]``, blocks of ``qb_rows`` query rows, chunks of pages."""
    hkv, _, page_size, d = k_pages.shape
    g = qg.shape[2]
    ctx_c = chunk * page_size
    rows = jnp.arange(qb_rows, dtype=jnp.int32)

    def seq_body(i, out):
        s = seq_idx[i]
        q0, q1, ctx = query_start[s], query_start[s + 1], seq_lens[s]
        first_pos = ctx - (q1 - q0)
        table = tables[s]

        def block_body(b, out):
            r0 = q0 + b * qb_rows
            pos = first_pos + b * qb_rows + rows  # [Bq]
            live = (r0 + rows) < q1
            qb = lax.dynamic_slice_in_dim(qg, r0, qb_rows, axis=0)  # [Bq, K, g, D]
            qb = qb.transpose(1, 0, 2, 3).reshape(hkv, qb_rows * g, d)
            hi = jnp.minimum(ctx, pos[-1] + 1)
            lim = None
            if limit is not None:  # [Bq] each row's last visible position
                lim = jnp.where(live, lax.dynamic_slice_in_dim(limit, r0, qb_rows), pos)
                hi = jnp.minimum(ctx, jnp.max(lim) + 1)
            lo = jnp.int32(0)
            if sliding_window is not None:
                lo = jnp.maximum(pos[0] - sliding_window + 1, 0) // ctx_c
            ctx_v = jnp.full((qb_rows,), ctx)

            def kv_body(c, carry):
                pages = lax.dynamic_slice_in_dim(table, c * chunk, chunk)
                k = k_pages[:, pages].reshape(hkv, ctx_c, d).astype(jnp.float32)
                v = v_pages[:, pages].reshape(hkv, ctx_c, d).astype(jnp.float32)
                sc = jnp.einsum("kqd,kcd->kqc", qb, k, precision=_HI)
                sc = sc.reshape(hkv, qb_rows, g, ctx_c)
                if soft_cap is not None:
                    sc = soft_cap * jnp.tanh(sc / soft_cap)
                kv_pos = c * ctx_c + jnp.arange(ctx_c, dtype=jnp.int32)
                sc = jnp.where(
                    _mask(kv_pos, pos, ctx_v, sliding_window, lim)[None, :, None, :], sc, _NEG)

                def pv(p):
                    o = jnp.einsum("kqc,kcd->kqd", p.reshape(hkv, qb_rows * g, ctx_c), v,
                                   precision=_HI)
                    return o.reshape(hkv, qb_rows, g, d)

                return _online_update(carry, sc, pv)

            init = (jnp.full((hkv, qb_rows, g), _NEG, jnp.float32),
                    jnp.zeros((hkv, qb_rows, g), jnp.float32),
                    jnp.zeros((hkv, qb_rows, g, d), jnp.float32))
            _, l, acc = lax.fori_loop(lo, (hi + ctx_c - 1) // ctx_c, kv_body, init)
            blk = (acc / jnp.where(l == 0, 1.0, l)[..., None]).transpose(1, 0, 2, 3)
            old = lax.dynamic_slice_in_dim(out, r0, qb_rows, axis=0)
            blk = jnp.where(live[:, None, None, None], blk, old)
            return lax.dynamic_update_slice_in_dim(out, blk, r0, axis=0)

        return lax.fori_loop(0, (q1 - q0 + qb_rows - 1) // qb_rows, block_body, out)

    return lax.fori_loop(0, n_long, seq_body, out)


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

    Same contract as ``reference.ragged_paged_attention``: q ``[T, Hq, D]``; query_start
    ``[S+1]``; seq_lens ``[S]`` (0 = padding row, padding rows last); block_tables ``[S, M]``;
    ``num_seqs`` the number of real rows (counted from seq_lens when None); ``kv_scale`` the
    optional ``[Hkv, 2]`` scales of float8 pages; ``kv_limit`` the optional ``[T]`` last
    visible key position of each token (reference.py). The new K/V must already be in the pages.
    Padded tokens come back as zeros. Returns ``[T, Hq, D]`` in q's dtype.
    """
    return attention(q, k_pages, v_pages, query_start, seq_lens, block_tables, num_seqs,
                     sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                     kv_scale=kv_scale, kv_limit=kv_limit)


def attention(q, k_pages, v_pages, query_start, seq_lens, block_tables, num_seqs=None, *,
              sm_scale, sliding_window=None, soft_cap=None, kv_scale=None, kv_limit=None,
              short_query=SHORT_QUERY,
              token_block=TOKEN_BLOCK, q_block=Q_BLOCK, chunk_tokens=CHUNK_TOKENS,
              short_chunk_tokens=None):
    """``ragged_paged_attention`` with its tuning knobs exposed for tests and timing.

    ``short_query``: rows with at most this many new tokens use the per-token loop (0: every
    row takes the per-sequence loop; a huge value: every row the per-token loop).
    ``short_chunk_tokens``: KV positions per trip of the per-token loop (default: from
    ``SHORT_TRIP_POSITIONS`` and the token block)."""
    t_len, hq, d = q.shape
    hkv, _, page_size, _ = k_pages.shape
    s_len, max_pages = block_tables.shape
    g = hq // hkv
    tb, qb_rows = min(t_len, token_block), min(t_len, q_block)
    if short_chunk_tokens is None:
        short_chunk_tokens = max(SHORT_CHUNK_TOKENS, SHORT_TRIP_POSITIONS // tb)
    chunk = max(1, min(max_pages, chunk_tokens // page_size))
    short_chunk = max(1, min(max_pages, short_chunk_tokens // page_size))
    whole = math.lcm(chunk, short_chunk)
    pad = (-max_pages) % whole
    if max_pages + pad == max(chunk, short_chunk):
        # One chunk would span the whole table: compiled that way, a one-token step made XLA
        # copy every layer's pool (test_kv_write; 3x slower single-request decode). A second
        # chunk of trash-page columns avoids it; the loops still stop at each row's context.
        pad += whole
    if pad:  # whole chunks only; the extra columns point at the trash page and are masked
        block_tables = jnp.pad(block_tables, ((0, 0), (0, pad)))
    seq_lens = seq_lens.astype(jnp.int32)
    query_start = query_start.astype(jnp.int32)
    if num_seqs is None:
        n_seqs = jnp.sum(seq_lens > 0).astype(jnp.int32)
    else:
        n_seqs = jnp.minimum(jnp.asarray(num_seqs, jnp.int32), s_len)

    # Per-token metadata (the reference's token_metadata).
    t = jnp.arange(t_len, dtype=jnp.int32)
    seq_of = jnp.minimum(jnp.searchsorted(query_start[1:], t, side="right"), s_len - 1)
    seq_of = seq_of.astype(jnp.int32)
    q_lens = query_start[1:] - query_start[:-1]
    pos = seq_lens[seq_of] - q_lens[seq_of] + (t - query_start[seq_of])
    # each token's last visible position, inside its context; padded by a block for the slices
    limit = None
    if kv_limit is not None:
        limit = jnp.minimum(visible_limit(pos, kv_limit), seq_lens[seq_of] - 1)
        limit = jnp.pad(limit, (0, max(qb_rows, 1) + 1))
    live_seq = (jnp.arange(s_len) < n_seqs) & (seq_lens > 0)
    short_seq = live_seq & (q_lens <= short_query)
    long_seq = live_seq & (q_lens > short_query)
    short_tok = (t < query_start[n_seqs]) & short_seq[seq_of]

    # Compact index lists: the loops run over real work only.
    n_short = jnp.sum(short_tok).astype(jnp.int32)
    short_idx = jnp.nonzero(short_tok, size=t_len + tb, fill_value=t_len)[0].astype(jnp.int32)
    n_long = jnp.sum(long_seq).astype(jnp.int32)
    long_idx = jnp.nonzero(long_seq, size=s_len, fill_value=0)[0].astype(jnp.int32)

    # Queries pre-scaled, padded by one block so dynamic slices never clamp; ``out`` has one
    # extra trash row for the per-token loop's padding.
    # The K scales ride on the queries (scores come out scaled, before the soft cap).
    qg = scaled_queries(q.reshape(t_len, hkv, g, d).astype(jnp.float32), kv_scale) * sm_scale
    qg = jnp.pad(qg, ((0, max(qb_rows, 1)), (0, 0), (0, 0), (0, 0)))
    out = jnp.zeros((t_len + max(qb_rows, 1), hkv, g, d), jnp.float32)
    kw = dict(sliding_window=sliding_window, soft_cap=soft_cap, limit=limit)
    out_short = _short_rows(out[: t_len + 1], qg, k_pages, v_pages, short_idx, n_short, seq_of,
                            pos, seq_lens, block_tables, tb=tb, chunk=short_chunk, **kw)
    out = out.at[: t_len + 1].set(out_short)
    out = _long_rows(out, qg, k_pages, v_pages, long_idx, n_long, query_start, seq_lens,
                     block_tables, qb_rows=qb_rows, chunk=chunk, **kw)
    return scaled_output(out[:t_len], kv_scale).reshape(t_len, hq, d).astype(q.dtype)
