"""From-scratch step inputs: the reference the persistent batch is checked against.

Production builds every step with ``InputBatch.prepare_inputs`` (rows kept across steps, a
diff applied). Tests and ``benchmarks/step_plan.py`` rebuild the same ``StepPlan`` here from
every row's full description each step, the way the engine once did, and assert both agree.
"""
from __future__ import annotations

from itertools import chain
from typing import Sequence

import numpy as np

from jaxserve.core.request import PLACEHOLDER
from jaxserve.core.sampling_metadata import (COMPACT_BIAS_WIDTH, COMPACT_STOP_WIDTH, SamplingRow,
                                             dummy_sampling_arrays, layout_widths)
from jaxserve.core.step_plan import (TRASH_PAGE, ScheduledSeq, StepPlan, pick_bucket,
                                     seq_bucket, verify_arrays)

_default_rng = np.random.default_rng()


def _eos_list(eos) -> list[int]:
    if eos is None:
        return []
    if isinstance(eos, (int, np.integer)):
        return [int(eos)]
    return [int(t) for t in eos]


def build_sampling_arrays(
    rows: Sequence[SamplingRow | tuple | None],
    s_bucket: int,
    *,
    history_len: int,
    rng: np.random.Generator | None = None,
) -> dict:
    """rows[i]: a ``SamplingRow`` (or the same 5-tuple), or None for a row that samples nothing.

    ``eos_token_id``: int, list of ints or None (min_tokens masks it with stop_token_ids, like
    vLLM's all_stop_token_ids). ``num_generated`` = tokens generated so far (the row's key step
    and the min_tokens counter). ``history_len``: width of the full layout's history (the
    engine's max_model_len). ``rng`` draws fresh seeds for unseeded rows (the engine passes one
    seeded from its global seed, so whole runs are reproducible).
    """
    if len(rows) > s_bucket:
        raise ValueError(f"{len(rows)} rows exceed the sequence bucket {s_bucket}")
    rng = _default_rng if rng is None else rng
    n = len(rows)
    # One pass over the rows: each real row's scalars, and the few rows that need more
    # (a seed, a logit bias, penalties, stop ids masked under min_tokens).
    real, vals, extra = [], [], []
    stop_lists: dict[int, list[int]] = {}
    full = False  # whether a row needs wide tables (decides the layout for the whole batch)
    for i, row in enumerate(rows):
        if row is None:
            continue
        p, _, _, eos, n_gen = row
        real.append(i)
        # greedy rows (decided once, SamplingParams.is_greedy) get temperature 0: the device's
        # rule; their other sampling fields are inert
        g = p.is_greedy
        vals.append((0.0 if g else p.temperature, 1.0 if g else p.top_p,
                     0 if g else max(p.top_k, 0), 0.0 if g else p.min_p, p.presence_penalty,
                     p.frequency_penalty, p.repetition_penalty, n_gen,
                     -1 if p.logprobs is None else p.logprobs))
        if p.min_tokens and n_gen < p.min_tokens:
            ids = list(dict.fromkeys(list(p.stop_token_ids) + _eos_list(eos)))
            stop_lists[i] = ids
            full |= len(ids) > COMPACT_STOP_WIDTH
        penalties = p.uses_penalties
        if penalties or p.logit_bias or p.seed is not None:
            extra.append(i)
            full |= penalties or len(p.logit_bias or ()) > COMPACT_BIAS_WIDTH

    a = dummy_sampling_arrays(s_bucket, full=full, history_len=history_len)
    if not real:
        return a
    L, B, E = layout_widths(full, history_len)

    idx = np.asarray(real)
    cols = np.array(vals, dtype=np.float64)
    for j, name in enumerate(("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                              "frequency_penalty", "repetition_penalty", "steps",
                              "num_logprobs")):
        a[name][idx] = cols[:, j]

    seeds = rng.integers(0, 2**32, size=(s_bucket, 2), dtype=np.uint32)
    seeds[n:] = 0
    a["seeds"] = seeds

    for i, ids in stop_lists.items():
        if len(ids) > E:
            raise ValueError(f"row {i} has {len(ids)} stop ids, more than {E}")
        a["mask_stop"][i] = True
        a["stop_ids"][i, : len(ids)] = ids

    for i in extra:
        p, out_ids, prompt_ids, _, _ = rows[i]
        if p.seed is not None:
            seeds[i] = (p.seed & 0xFFFFFFFF, p.seed >> 32)
        if p.logit_bias:
            nb = len(p.logit_bias)
            a["bias_ids"][i, :nb] = np.fromiter(p.logit_bias.keys(), np.int32, nb)
            a["bias_values"][i, :nb] = np.fromiter(p.logit_bias.values(), np.float32, nb)
        if p.uses_penalties:
            n_p, n_o = len(prompt_ids), len(out_ids)
            if n_p + n_o > L:
                raise ValueError(f"row {i}: {n_p + n_o} tokens exceed history_len={L}")
            a["history"][i, :n_p] = prompt_ids
            a["history"][i, n_p : n_p + n_o] = out_ids
            a["prompt_lens"][i] = n_p
    return a


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


def to_rows(out, prev_rows: dict[str, int] | None = None) -> list[ScheduledSeq]:
    """A ``SchedulerOutput``'s scheduled requests as rows for :func:`build_step_plan`, in
    ``scheduled`` order. ``prev_rows``: request id -> its row in the previous (still running)
    step, for pending tokens."""
    prev_rows = prev_rows or {}
    return [
        ScheduledSeq(
            new_token_ids=s.new_token_ids,
            start_pos=s.start_pos,
            block_ids=s.request.pages_per_group(),
            sample=s.sample,
            prev_row=prev_rows.get(s.request.request_id, -1),
            num_draft=s.num_draft,
            state_slot=s.request.state_slot,
        )
        for s in out.scheduled
    ]
