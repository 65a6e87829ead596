"""Random ragged attention batches in the step-plan layout, for kernel tests and benchmarks.

Numpy only: builds what a StepPlan would hand the attention kernel (query_start, seq_lens,
block_tables padded to static buckets) plus a random page pool with each sequence's pages
scattered at random over it. Page 0 stays the trash page and is never allocated.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class RaggedBatch:
    q: np.ndarray  # [T, Hq, D]
    k_pages: np.ndarray  # [Hkv, P, page, D]
    v_pages: np.ndarray
    query_start: np.ndarray  # [S+1] int32
    seq_lens: np.ndarray  # [S] int32, 0 = padding row
    block_tables: np.ndarray  # [S, M] int32
    num_seqs: int
    num_tokens: int

    def args(self):
        return (self.q, self.k_pages, self.v_pages, self.query_start, self.seq_lens, self.block_tables)


def make_ragged_batch(
    rng: np.random.Generator,
    q_lens,
    ctx_lens,
    *,
    num_tokens: int,
    num_seqs: int,
    max_pages: int,
    num_pages: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype=np.float32,
    padding_tables: str = "trash",
    fill: bool = True,
) -> RaggedBatch:
    """``q_lens[i]`` new tokens of sequence i end its context of ``ctx_lens[i]`` tokens.

    ``padding_tables``: what the block-table rows of padding sequences hold — ``"trash"`` (page 0,
    as the step plan writes) or ``"random"`` (arbitrary pages, which the kernel must not read).
    ``fill=False`` leaves q/k_pages/v_pages as None (callers that generate them on device).
    """
    q_lens = np.asarray(q_lens, np.int32)
    ctx_lens = np.asarray(ctx_lens, np.int32)
    n = len(q_lens)
    if n > num_seqs or q_lens.sum() > num_tokens:
        raise ValueError(f"{n} sequences / {q_lens.sum()} tokens exceed buckets {num_seqs}/{num_tokens}")
    if np.any(q_lens < 1) or np.any(q_lens > ctx_lens):
        raise ValueError("need 1 <= q_len <= ctx_len for every sequence")
    pages_per_seq = -(-ctx_lens // page_size)
    if np.any(pages_per_seq > max_pages) or pages_per_seq.sum() > num_pages - 1:
        raise ValueError("contexts do not fit the block tables / page pool")
    query_start = np.zeros(num_seqs + 1, np.int32)
    query_start[1 : n + 1] = np.cumsum(q_lens)
    query_start[n + 1 :] = query_start[n]
    seq_lens = np.zeros(num_seqs, np.int32)
    seq_lens[:n] = ctx_lens
    block_tables = np.zeros((num_seqs, max_pages), np.int32)
    free = rng.permutation(np.arange(1, num_pages, dtype=np.int32))
    used = 0
    for i, np_ in enumerate(pages_per_seq):
        block_tables[i, :np_] = free[used : used + np_]
        used += np_
    if padding_tables == "random" and n < num_seqs:
        block_tables[n:] = rng.integers(0, num_pages, size=(num_seqs - n, max_pages))
    q = k = v = None
    if fill:
        q = rng.standard_normal((num_tokens, num_q_heads, head_dim)).astype(np.float32).astype(dtype)
        k = rng.standard_normal((num_kv_heads, num_pages, page_size, head_dim)).astype(np.float32)
        v = rng.standard_normal((num_kv_heads, num_pages, page_size, head_dim)).astype(np.float32)
        k, v = k.astype(dtype), v.astype(dtype)
    return RaggedBatch(
        q=q, k_pages=k, v_pages=v,
        query_start=query_start, seq_lens=seq_lens, block_tables=block_tables,
        num_seqs=n, num_tokens=int(q_lens.sum()),
    )


def naive_attention(batch: RaggedBatch, *, sm_scale, sliding_window=None, soft_cap=None,
                    kv_limit=None):
    """Per-sequence, per-token float64 numpy attention: the slow obvious ground truth
    (``kv_limit [T]``: each token's last visible position, reference.py)."""
    q = np.asarray(batch.q, np.float64)
    k_pages = np.asarray(batch.k_pages, np.float64)
    v_pages = np.asarray(batch.v_pages, np.float64)
    t, hq, d = q.shape
    hkv, _, page_size, _ = k_pages.shape
    group = hq // hkv
    out = np.zeros_like(q)
    for i in range(batch.num_seqs):
        ctx = int(batch.seq_lens[i])
        lo, hi = int(batch.query_start[i]), int(batch.query_start[i + 1])
        pages = batch.block_tables[i, : -(-ctx // page_size)]
        k = k_pages[:, pages].reshape(hkv, -1, d)[:, :ctx]
        v = v_pages[:, pages].reshape(hkv, -1, d)[:, :ctx]
        for tok in range(lo, hi):
            pos = ctx - (hi - lo) + (tok - lo)
            first = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            last = pos if kv_limit is None else min(max(pos, int(kv_limit[tok])), ctx - 1)
            for h in range(hq):
                kh, vh = k[h // group, first : last + 1], v[h // group, first : last + 1]
                s = kh @ q[tok, h] * sm_scale
                if soft_cap is not None:
                    s = soft_cap * np.tanh(s / soft_cap)
                p = np.exp(s - s.max())
                out[tok, h] = p @ vh / p.sum()
    return out


def random_kv_limits(rng: np.random.Generator, batch: RaggedBatch, max_run: int = 12
                     ) -> np.ndarray:
    """``kv_limit [T]`` of random runs inside each row's new tokens (every token of a run
    sees up to the run's last position, as an image's tokens do); -1 (causal) elsewhere,
    padding included."""
    lim = np.full(batch.q.shape[0], -1, np.int32)
    for i in range(batch.num_seqs):
        lo, hi = int(batch.query_start[i]), int(batch.query_start[i + 1])
        first_pos = int(batch.seq_lens[i]) - (hi - lo)
        t = lo + int(rng.integers(0, 3))
        while t < hi:
            n = int(rng.integers(1, max_run + 1))
            end = min(t + n, hi)
            if rng.random() < 0.7:
                lim[t:end] = first_pos + (end - 1 - lo)
            t = end + int(rng.integers(0, 4))
    return lim


@dataclass
class StateRows:
    """Step metadata of a ragged batch over a state pool (the linear-attention layers' view)."""

    query_start: np.ndarray  # [S+1] int32
    seq_lens: np.ndarray  # [S] int32, 0 = padding row
    state_slots: np.ndarray  # [S] int32
    num_seqs: int
    num_tokens: int

    def args(self):
        return (self.query_start, self.seq_lens, self.state_slots)


def make_state_rows(rng: np.random.Generator, q_lens, ctx_lens, *, num_tokens: int,
                    num_seqs: int, num_slots: int) -> StateRows:
    """``q_lens[i]`` new tokens end a context of ``ctx_lens[i]`` tokens (``ctx == q_len``: the row
    starts from a zero state); each real row gets its own random slot in ``1 .. num_slots-1``,
    padding rows a random slot (which they must not touch)."""
    q_lens = np.asarray(q_lens, np.int32)
    ctx_lens = np.asarray(ctx_lens, np.int32)
    n = len(q_lens)
    if n > num_seqs or q_lens.sum() > num_tokens or n > num_slots - 1:
        raise ValueError(f"{n} rows / {q_lens.sum()} tokens exceed {num_seqs}/{num_tokens}/slots")
    if np.any(q_lens < 1) or np.any(q_lens > ctx_lens):
        raise ValueError("need 1 <= q_len <= ctx_len for every row")
    query_start = np.zeros(num_seqs + 1, np.int32)
    query_start[1 : n + 1] = np.cumsum(q_lens)
    query_start[n + 1 :] = query_start[n]
    seq_lens = np.zeros(num_seqs, np.int32)
    seq_lens[:n] = ctx_lens
    slots = rng.integers(0, num_slots, size=num_seqs).astype(np.int32)
    slots[:n] = rng.permutation(np.arange(1, num_slots, dtype=np.int32))[:n]
    return StateRows(query_start, seq_lens, slots, n, int(q_lens.sum()))
