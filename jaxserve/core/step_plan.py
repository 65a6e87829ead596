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

from dataclasses import dataclass
from itertools import chain
from typing import Sequence

import numpy as np

from jaxserve.core.request import PLACEHOLDER
from jaxserve.core.sampling_metadata import SamplingRow, build_sampling_arrays

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


@dataclass(slots=True)
class ScheduledSeq:
    """One row of a step: ``new_token_ids`` start at absolute position ``start_pos``."""

    new_token_ids: Sequence[int] | np.ndarray
    start_pos: int
    block_ids: Sequence[Sequence[int]]  # the row's pages, one list per paged cache group
    sample: bool = True  # False for a prefill chunk that does not finish its prompt
    prev_row: int = -1  # the request's row in the previous step, if that step sampled for it
    num_draft: int = 0  # speculative tokens at the end of new_token_ids (verified this step)
    sampling: SamplingRow | None = None  # None: greedy and inert (samples nothing kept)
    # (previous-step row, history index) of the one pending token in a penalty row's history
    history_ref: tuple[int, int] | None = None
    # prompt_logprobs: the prompt token after each of the row's first len(...) new tokens
    prompt_next_ids: Sequence[int] | None = None
    state_slot: int = -1  # the row's recurrent-state pool slot (LinearState layers); -1: none
    lora_slot: int = -1  # the device slot of the row's adapter; -1: the base model
    # the known token after the row's last new one (a prefill chunk's next prompt token), read
    # by the MTP head; -1: the token this row samples
    next_token: int = -1


# StepPlan fields the jitted forward reads (the sampler reads ``sampling`` and the extras).
FORWARD_FIELDS = ("token_ids", "positions", "slot_mapping", "query_start", "seq_lens",
                  "block_tables", "logits_indices", "prev_ref", "state_slots")


@dataclass(frozen=True)
class StepPlan:
    """Everything one device step reads. T = token bucket, S = sequence bucket, G = paged cache
    groups, M = max pages per sequence, W = ceil(vocab / 32), k = speculative tokens.
    Built only by :func:`build_step_plan`; frozen, so nothing adds to it afterwards. The worker
    registers it as a pytree (``jaxserve.worker.runner``): array fields are leaves, the two
    counts are static."""

    # -- the forward
    token_ids: np.ndarray  # [T] int32; 0 where prev_ref >= 0
    positions: np.ndarray  # [T] int32
    slot_mapping: np.ndarray  # [G, T] int32 page*block_size+offset; trash page for padding
    query_start: np.ndarray  # [S+1] int32 prefix sums of new tokens per row
    seq_lens: np.ndarray  # [S] int32 context length after this step; 0 = padding row
    block_tables: np.ndarray  # [G, S, M] int32, one table per paged cache group
    logits_indices: np.ndarray  # [S] int32 index in T of each row's last new token
    prev_ref: np.ndarray  # [T] int32 row of the previous step whose sampled id this token is; -1
    state_slots: np.ndarray  # [S] int32 state-pool slot of each row (LinearState groups); -1
    lora_slots: np.ndarray  # [T] int32 adapter slot of each token; -1 = the base model
    # [S] int32 the row of the device's last-token buffer each row's sampled id is kept in
    # (what a later step's prev_ref / history_ref name); -1: not kept
    token_rows: np.ndarray
    # -- the sampler
    sampling: dict  # SAMPLING_FIELDS -> [S] or [S, width] arrays (core.sampling_metadata)
    history_ref: np.ndarray  # [S, 2] int32 (previous-step row, history index); -1: none
    sample_mask: np.ndarray  # [S] bool rows whose sampled token is used
    # -- optional extras (None: the step does not need them)
    token_bitmask: np.ndarray | None  # [S, W] int32 bit t%32 of word t//32 = token t allowed
    spec_logits_indices: np.ndarray | None  # [S, k+1] int32 logits positions of a verify row
    draft_token_ids: np.ndarray | None  # [S, k] int32
    num_draft: np.ndarray | None  # [S] int32
    prompt_next_ids: np.ndarray | None  # [T] int32 next prompt token (prompt_logprobs)
    next_token_ids: np.ndarray | None  # [S] int32 ScheduledSeq.next_token (speculating steps)
    # -- host counts (static)
    num_seqs: int  # real rows
    num_tokens: int  # real tokens

    @property
    def token_bucket(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def seq_bucket(self) -> int:
        return int(self.seq_lens.shape[0])

    def forward_arrays(self) -> dict:
        """What the jitted forward takes: the forward fields (logits at every verified
        position when speculating) and the real row count."""
        arrays = {name: getattr(self, name) for name in FORWARD_FIELDS}
        if self.spec_logits_indices is not None:
            arrays["logits_indices"] = self.spec_logits_indices
        arrays["num_seqs"] = np.int32(self.num_seqs)
        return arrays


ARRAY_FIELDS = tuple(f for f in StepPlan.__dataclass_fields__ if f not in ("num_seqs", "num_tokens"))


def build_step_plan(
    rows: Sequence[ScheduledSeq],
    *,
    block_size: int,
    max_pages_per_seq: int,
    ladder: Sequence[int],
    max_num_seqs: int,
    history_len: int = 1,
    rng: np.random.Generator | None = None,
    token_bitmask: np.ndarray | None = None,
    num_spec_tokens: int = 0,
) -> StepPlan:
    """Pad the scheduled rows into the smallest bucket that holds them (vectorised numpy).

    ``history_len``: the sampler's full-layout history width (max_model_len); ``rng`` draws the
    seeds of unseeded rows; ``token_bitmask[len(rows), W]``: the rows' allowed tokens (padding
    rows allow all); ``num_spec_tokens`` k > 0 gives every step the verify shapes."""
    n_rows = len(rows)
    if n_rows == 0:
        raise ValueError("a step needs at least one scheduled sequence")
    if n_rows > max_num_seqs:
        raise ValueError(f"{n_rows} sequences exceed max_num_seqs={max_num_seqs}")
    # every per-row scalar in one pass over the rows (a pass per field costs more than numpy)
    q_lens, starts, prev_rows, samples, state_slots, lora_slots = np.array(
        [(len(r.new_token_ids), r.start_pos, r.prev_row, r.sample, r.state_slot, r.lora_slot)
         for r in rows], dtype=np.int32).reshape(n_rows, 6).T
    if np.any(q_lens < 1):
        raise ValueError("every scheduled sequence needs at least one new token")
    n_tok = int(q_lens.sum())
    t_bucket = pick_bucket(ladder, max(n_tok, n_rows))
    s_bucket = seq_bucket(t_bucket, max_num_seqs)
    if n_rows > s_bucket:  # only when the ladder's smallest bucket is tiny
        t_bucket = pick_bucket(ladder, n_rows)
        s_bucket = seq_bucket(t_bucket, max_num_seqs)

    query_start = np.zeros(s_bucket + 1, dtype=np.int32)
    np.cumsum(q_lens, out=query_start[1 : n_rows + 1])
    query_start[n_rows + 1 :] = n_tok

    token_ids = np.zeros(t_bucket, dtype=np.int32)
    token_ids[:n_tok] = np.fromiter(chain.from_iterable(r.new_token_ids for r in rows),
                                    np.int32, n_tok)
    prev_ref = np.full(t_bucket, -1, dtype=np.int32)
    pending = np.flatnonzero(token_ids[:n_tok] == PLACEHOLDER)
    if pending.size:
        rows_of = np.repeat(prev_rows, q_lens)
        if np.any(rows_of[pending] < 0):
            raise ValueError("a placeholder token without a previous-step row")
        prev_ref[pending] = rows_of[pending]
        token_ids[pending] = 0
    row_of_tok = np.repeat(np.arange(n_rows, dtype=np.int32), q_lens)
    offs = np.arange(n_tok, dtype=np.int32) - query_start[row_of_tok]
    positions = np.zeros(t_bucket, dtype=np.int32)
    positions[:n_tok] = starts[row_of_tok] + offs

    block_tables, slot_mapping = _pages(rows, positions[:n_tok], row_of_tok,
                                        (starts + q_lens - 1) // block_size + 1,
                                        block_size, max_pages_per_seq, s_bucket, t_bucket)

    seq_lens = np.zeros(s_bucket, dtype=np.int32)
    seq_lens[:n_rows] = starts + q_lens
    logits_indices = np.zeros(s_bucket, dtype=np.int32)
    logits_indices[:n_rows] = query_start[1 : n_rows + 1] - 1
    sample_mask = np.zeros(s_bucket, dtype=bool)
    sample_mask[:n_rows] = samples

    history_ref, prompt_next_ids = _row_extras(rows, query_start, s_bucket, t_bucket)
    if token_bitmask is not None:
        mask = np.full((s_bucket, token_bitmask.shape[1]), -1, dtype=np.int32)
        mask[:n_rows] = token_bitmask
        token_bitmask = mask
    spec = (None, None, None)
    next_token_ids = None
    if num_spec_tokens:
        spec = verify_arrays(logits_indices, token_ids, prev_ref,
                             [r.num_draft for r in rows], num_spec_tokens)
        next_token_ids = np.full(s_bucket, -1, dtype=np.int32)
        next_token_ids[:n_rows] = [r.next_token for r in rows]
    return StepPlan(
        token_ids=token_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        query_start=query_start,
        seq_lens=seq_lens,
        block_tables=block_tables,
        logits_indices=logits_indices,
        prev_ref=prev_ref,
        state_slots=_padded(state_slots, s_bucket, -1),
        lora_slots=_padded(np.repeat(lora_slots, q_lens), t_bucket, -1),
        token_rows=_padded(np.where(samples, np.arange(n_rows, dtype=np.int32), -1),
                           s_bucket, -1),
        sampling=build_sampling_arrays([r.sampling for r in rows], s_bucket,
                                       history_len=history_len, rng=rng),
        history_ref=history_ref,
        sample_mask=sample_mask,
        token_bitmask=token_bitmask,
        spec_logits_indices=spec[0],
        draft_token_ids=spec[1],
        num_draft=spec[2],
        prompt_next_ids=prompt_next_ids,
        next_token_ids=next_token_ids,
        num_seqs=n_rows,
        num_tokens=n_tok,
    )


def _padded(values: np.ndarray, n: int, fill: int) -> np.ndarray:
    """``values`` in an int32 array of length ``n``, the rest ``fill`` (padding rows/tokens)."""
    out = np.full(n, fill, dtype=np.int32)
    out[:len(values)] = values
    return out


def _pages(rows, pos, row_of_tok, needed, block_size: int, max_pages: int, s_bucket: int,
           t_bucket: int) -> tuple[np.ndarray, np.ndarray]:
    """Block tables ``[G, S, M]`` and slot mapping ``[G, T]``: each row's pages per cache group,
    and where each new token's K/V goes (``needed[i]`` pages hold row i's last position)."""
    n_rows, n_groups = len(rows), len(rows[0].block_ids)
    lists = [pages for r in rows for pages in r.block_ids]  # row-major: (row, group)
    if any(len(r.block_ids) != n_groups for r in rows):
        raise ValueError("every row needs one page list per cache group")
    lens = np.fromiter(map(len, lists), np.int64, len(lists))
    if lens.max(initial=0) > max_pages:
        bad = int(np.argmax(lens > max_pages))
        raise ValueError(f"sequence {bad // n_groups} needs {lens[bad]} pages > max {max_pages}")
    have = lens.reshape(n_rows, n_groups).T  # [G, n_rows]
    if np.any(needed > have):
        g, bad = map(int, np.argwhere(needed > have)[0])
        raise ValueError(f"sequence {bad} has {have[g, bad]} pages, needs {needed[bad]}")
    # one scatter of every page id: list k = (row i, group g) starts at (g*S + i)*M
    block_tables = np.zeros((n_groups, s_bucket, max_pages), dtype=np.int32)
    n_ids = int(lens.sum())
    if n_ids:
        k = np.arange(len(lists))
        first = (k % n_groups * s_bucket + k // n_groups) * max_pages
        ends = np.cumsum(lens)
        dest = np.arange(n_ids) + np.repeat(first - (ends - lens), lens)
        block_tables.reshape(-1)[dest] = np.fromiter(chain.from_iterable(lists), np.int32,
                                                     n_ids)
    slot_mapping = np.full((n_groups, t_bucket), TRASH_PAGE * block_size, dtype=np.int32)
    slot_mapping[:, :len(pos)] = (block_tables[:, row_of_tok, pos // block_size] * block_size
                                  + pos % block_size)
    return block_tables, slot_mapping


def _row_extras(rows, query_start, s_bucket: int, t_bucket: int):
    """``history_ref[S, 2]`` and ``prompt_next_ids[T]`` (None when no row asks for it)."""
    history_ref = np.full((s_bucket, 2), -1, dtype=np.int32)
    prompt_next_ids = None
    for i, r in enumerate(rows):
        if r.history_ref is not None:
            history_ref[i] = r.history_ref
        if r.prompt_next_ids is not None:
            if prompt_next_ids is None:
                prompt_next_ids = np.zeros(t_bucket, np.int32)
            t0 = int(query_start[i])
            prompt_next_ids[t0:t0 + len(r.prompt_next_ids)] = r.prompt_next_ids
    return history_ref, prompt_next_ids


def padding_plan(t: int, s: int, num_groups: int, max_pages_per_seq: int, *,
                 sampling: dict, num_spec_tokens: int = 0) -> StepPlan:
    """A plan of bucket (t, s) with no real row (warm-up of a bucket no real rows fill)."""
    z = lambda *shape: np.zeros(shape, dtype=np.int32)  # noqa: E731
    spec = (None, None, None)
    if num_spec_tokens:
        spec = verify_arrays(z(s), z(t), np.full(t, -1, np.int32), [], num_spec_tokens)
    return StepPlan(token_ids=z(t), positions=z(t), slot_mapping=z(num_groups, t),
                    query_start=z(s + 1), seq_lens=z(s),
                    block_tables=z(num_groups, s, max_pages_per_seq), logits_indices=z(s),
                    prev_ref=np.full(t, -1, np.int32), state_slots=np.full(s, -1, np.int32),
                    lora_slots=np.full(t, -1, np.int32), token_rows=np.full(s, -1, np.int32),
                    sampling=sampling,
                    history_ref=np.full((s, 2), -1, np.int32), sample_mask=np.zeros(s, bool),
                    token_bitmask=None, spec_logits_indices=spec[0], draft_token_ids=spec[1],
                    num_draft=spec[2], prompt_next_ids=None,
                    next_token_ids=np.full(s, -1, np.int32) if num_spec_tokens else None,
                    num_seqs=0, num_tokens=0)


def verify_arrays(logits_indices: np.ndarray, token_ids: np.ndarray, prev_ref: np.ndarray,
                  num_draft: Sequence[int], k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The fixed-shape verify arrays for ``k`` speculative tokens per row:
    ``(spec_logits_indices[S, k+1], draft_token_ids[S, k], num_draft[S])``.

    A row with ``d`` drafts ends in ``[last known token, draft_1 .. draft_d]``; its logits are
    taken at those ``d + 1`` positions (the last one repeated as padding). Column 0 is the
    position a row without drafts samples at, so plain rows are unchanged.
    """
    S = logits_indices.shape[0]
    nd = np.zeros(S, np.int32)
    nd[:len(num_draft)] = num_draft
    if np.any(nd > k):
        raise ValueError(f"a row has more than {k} draft tokens")
    last = logits_indices.astype(np.int32)
    j = np.arange(k + 1, dtype=np.int32)[None, :]
    base = last - nd
    spec_logits_indices = (base[:, None] + np.minimum(j, nd[:, None])).astype(np.int32)
    drafts = np.zeros((S, k), np.int32)
    if k and nd.any():
        idx = base[:, None] + 1 + np.arange(k, dtype=np.int32)[None, :]
        valid = np.arange(k)[None, :] < nd[:, None]
        drafts = np.where(valid, token_ids[np.where(valid, idx, 0)], 0).astype(np.int32)
        if np.any(prev_ref[np.where(valid, idx, 0)][valid] >= 0):
            raise ValueError("a draft row holds a pending token")
    return spec_logits_indices, drafts, nd
