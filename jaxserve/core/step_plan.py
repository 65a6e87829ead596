"""The StepPlan: what one device step runs, as fixed-shape padded numpy arrays.

Host side only (numpy, no jax). The shapes come from one ladder of token buckets T; the
sequence dimension S is tied to T (``S = min(T, max_num_seqs)``), so a step has exactly one
compiled graph per token bucket and the compile count is ``len(ladder)``. Padded tokens write
their K/V to the trash page 0 and padded sequence rows have ``seq_lens == 0``.

Async scheduling: a token the previous step sampled is still on the device when the next plan
is built. The host writes a placeholder (``PLACEHOLDER``) for it and points ``prev_ref`` at the
previous step's row; the step reads the real id from the device (``history_ref`` does the same
for the one pending token in a penalty row's history).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from jaxserve.core.request import PLACEHOLDER

TRASH_PAGE = 0


def token_ladder(max_num_batched_tokens: int, min_bucket: int = 16, growth: int = 2
                 ) -> tuple[int, ...]:
    """Buckets ``min_bucket * growth**i`` up to (and always including) the token budget.

    Growth 2 pads at most 2x; a larger growth compiles fewer buckets and pads more.
    """
    if growth < 2:
        raise ValueError(f"bucket growth must be >= 2, got {growth}")
    if max_num_batched_tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
    ladder = []
    b = max(1, min(min_bucket, max_num_batched_tokens))
    while b < max_num_batched_tokens:
        ladder.append(b)
        b *= growth
    ladder.append(max_num_batched_tokens)
    return tuple(ladder)


def seq_bucket(token_bucket: int, max_num_seqs: int) -> int:
    """The sequence dimension that goes with a token bucket (every sequence has >= 1 token)."""
    return min(token_bucket, max_num_seqs)


def pick_bucket(ladder: Sequence[int], n: int) -> int:
    for b in ladder:
        if b >= n:
            return b
    raise ValueError(f"{n} tokens exceed the largest bucket {ladder[-1]}")


@dataclass
class ScheduledSeq:
    """One row of a step: ``new_token_ids`` start at absolute position ``start_pos``."""

    new_token_ids: Sequence[int] | np.ndarray
    start_pos: int
    block_ids: Sequence[int]
    sample: bool = True  # False for a prefill chunk that does not finish its prompt
    prev_row: int = -1  # the request's row in the previous step, if that step sampled for it
    num_draft: int = 0  # speculative tokens at the end of new_token_ids (verified this step)


@dataclass
class StepPlan:
    token_ids: np.ndarray  # [T] int32
    positions: np.ndarray  # [T] int32
    slot_mapping: np.ndarray  # [T] int32, page*block_size+offset; trash page for padding
    query_start: np.ndarray  # [S+1] int32 prefix sums of new tokens per row
    seq_lens: np.ndarray  # [S] int32 context length after this step; 0 = padding row
    block_tables: np.ndarray  # [S, M] int32
    logits_indices: np.ndarray  # [S] int32 index in T of each row's last new token
    num_seqs: int  # real rows
    num_tokens: int  # real tokens
    sample_mask: np.ndarray  # [S] bool: rows whose sampled token is used
    sampling: dict = field(default_factory=dict)  # [S] arrays for the sampler
    # [T] row of the previous step whose sampled id replaces this token (-1: token_ids holds it)
    prev_ref: np.ndarray | None = None
    # [S, 2] (previous-step row, history index) of a pending token in a penalty row; -1: none
    history_ref: np.ndarray | None = None
    # [S, ceil(V/32)] int32 structured-output mask (bit t%32 of word t//32 = token t allowed);
    # None = nothing constrained (the runner passes its all-ones mask: same shapes either way)
    token_bitmask: np.ndarray | None = None
    # speculative decoding (jaxserve.core.spec_decode.add_verify_arrays): [S, k+1] logits
    # positions of each row, [S, k] draft ids, [S] draft counts; None without speculation
    spec_logits_indices: np.ndarray | None = None
    draft_token_ids: np.ndarray | None = None
    num_draft: np.ndarray | None = None

    def __post_init__(self):
        if self.prev_ref is None:
            self.prev_ref = np.full(self.token_bucket, -1, dtype=np.int32)
        if self.history_ref is None:
            self.history_ref = np.full((self.seq_bucket, 2), -1, dtype=np.int32)

    @property
    def token_bucket(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def seq_bucket(self) -> int:
        return int(self.seq_lens.shape[0])

    def device_arrays(self) -> dict:
        """The arrays the jitted step takes (the ints stay on the host)."""
        return dict(
            token_ids=self.token_ids,
            positions=self.positions,
            slot_mapping=self.slot_mapping,
            query_start=self.query_start,
            seq_lens=self.seq_lens,
            block_tables=self.block_tables,
            logits_indices=self.logits_indices,
            num_seqs=np.int32(self.num_seqs),
            prev_ref=self.prev_ref,
        )


def build_step_plan(
    rows: Sequence[ScheduledSeq],
    *,
    block_size: int,
    max_pages_per_seq: int,
    ladder: Sequence[int],
    max_num_seqs: int,
) -> StepPlan:
    """Pad the scheduled rows into the smallest bucket that holds them (vectorised numpy)."""
    n_rows = len(rows)
    if n_rows == 0:
        raise ValueError("a step needs at least one scheduled sequence")
    if n_rows > max_num_seqs:
        raise ValueError(f"{n_rows} sequences exceed max_num_seqs={max_num_seqs}")
    q_lens = np.fromiter((len(r.new_token_ids) for r in rows), dtype=np.int32, count=n_rows)
    if np.any(q_lens < 1):
        raise ValueError("every scheduled sequence needs at least one new token")
    n_tok = int(q_lens.sum())
    t_bucket = pick_bucket(ladder, max(n_tok, n_rows))
    s_bucket = seq_bucket(t_bucket, max_num_seqs)
    if n_rows > s_bucket:  # only when the ladder's smallest bucket is tiny
        t_bucket = pick_bucket(ladder, n_rows)
        s_bucket = seq_bucket(t_bucket, max_num_seqs)

    starts = np.fromiter((r.start_pos for r in rows), dtype=np.int32, count=n_rows)
    query_start = np.zeros(s_bucket + 1, dtype=np.int32)
    np.cumsum(q_lens, out=query_start[1 : n_rows + 1])
    query_start[n_rows + 1 :] = n_tok

    token_ids = np.zeros(t_bucket, dtype=np.int32)
    token_ids[:n_tok] = np.concatenate([np.asarray(r.new_token_ids, dtype=np.int32) for r in rows])
    prev_ref = np.full(t_bucket, -1, dtype=np.int32)
    pending = np.flatnonzero(token_ids[:n_tok] == PLACEHOLDER)
    if pending.size:
        rows_of = np.repeat(np.fromiter((r.prev_row for r in rows), np.int32, n_rows), q_lens)
        if np.any(rows_of[pending] < 0):
            raise ValueError("a placeholder token without a previous-step row")
        prev_ref[pending] = rows_of[pending]
        token_ids[pending] = 0
    row_of_tok = np.repeat(np.arange(n_rows, dtype=np.int32), q_lens)
    offs = np.arange(n_tok, dtype=np.int32) - query_start[row_of_tok]
    positions = np.zeros(t_bucket, dtype=np.int32)
    positions[:n_tok] = starts[row_of_tok] + offs

    block_tables = np.zeros((s_bucket, max_pages_per_seq), dtype=np.int32)
    for i, r in enumerate(rows):
        nb = len(r.block_ids)
        if nb > max_pages_per_seq:
            raise ValueError(f"sequence {i} needs {nb} pages > max {max_pages_per_seq}")
        block_tables[i, :nb] = r.block_ids
    pos = positions[:n_tok]
    page_idx = pos // block_size
    needed = (starts + q_lens - 1) // block_size + 1
    have = np.fromiter((len(r.block_ids) for r in rows), dtype=np.int32, count=n_rows)
    if np.any(needed > have):
        bad = int(np.argmax(needed > have))
        raise ValueError(f"sequence {bad} has {have[bad]} pages, needs {needed[bad]}")
    slot_mapping = np.full(t_bucket, TRASH_PAGE * block_size, dtype=np.int32)
    slot_mapping[:n_tok] = block_tables[row_of_tok, page_idx] * block_size + pos % block_size

    seq_lens = np.zeros(s_bucket, dtype=np.int32)
    seq_lens[:n_rows] = starts + q_lens
    logits_indices = np.zeros(s_bucket, dtype=np.int32)
    logits_indices[:n_rows] = query_start[1 : n_rows + 1] - 1
    sample_mask = np.zeros(s_bucket, dtype=bool)
    sample_mask[:n_rows] = [r.sample for r in rows]
    return StepPlan(
        token_ids=token_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        query_start=query_start,
        seq_lens=seq_lens,
        block_tables=block_tables,
        logits_indices=logits_indices,
        num_seqs=n_rows,
        num_tokens=n_tok,
        sample_mask=sample_mask,
        prev_ref=prev_ref,
        history_ref=np.full((s_bucket, 2), -1, dtype=np.int32),
    )
