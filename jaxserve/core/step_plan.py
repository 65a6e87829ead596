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
from typing import Sequence

import numpy as np

from jaxserve.core.sampling_metadata import SamplingRow

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
    Built only by ``InputBatch.prepare_inputs`` (``jaxserve.testing.reference_plan`` rebuilds it
    from scratch for tests); frozen, so nothing adds to it afterwards. The worker
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
    # [S, K] int32 the layers whose residual stream each row's tokens return
    # (return_hidden_states; -1 padded); None: the engine captures none (K = 0)
    hidden_layers: np.ndarray | None = None
    # prompt embeddings (--enable-prompt-embeds): [T] bool tokens that read their row of
    # prompt_embeds [T, H] float32 (None: no row of the step reads any) instead of their id's
    embed_mask: np.ndarray | None = None
    prompt_embeds: np.ndarray | None = None
    # custom jax logits processors' state rows (one dict of [S, ...] arrays each); None:
    # their zero template (core.logits_processor)
    processor_state: tuple | None = None
    # [S] bool rows whose final hidden state at their last token reaches the host (pooling
    # requests' last prompt chunk); None: no row of the step pools
    pool_rows: np.ndarray | None = None

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
