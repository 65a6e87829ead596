"""Host side of the sampler: SamplingParams of the rows in a step -> padded numpy arrays.

Numpy only (no jax). The arrays are exactly the fields of ``jaxserve.worker.sampler.SamplingMetadata``
(``SAMPLING_FIELDS``). Padding rows (and ``None`` rows, e.g. a prefill chunk that samples
nothing) are greedy and inert.

Shapes, and why they cannot cause recompiles: every array is ``[S]`` or ``[S, W]`` where W comes
from one of exactly two layouts, so the step has at most two sampler variants per S bucket:

* ``compact`` (the normal case): history width 1, logit_bias width ``COMPACT_BIAS_WIDTH``,
  stop-id width ``COMPACT_STOP_WIDTH``;
* ``full`` — used for the whole batch when any row has a penalty, more logit_bias entries or more
  stop ids (with min_tokens active) than the compact widths: history width ``history_len``
  (the engine passes max_model_len, so any prompt+output fits), bias width ``MAX_LOGIT_BIAS``,
  stop width ``FULL_STOP_WIDTH``.

Both layouts are fixed by the engine's config, never by request values; ``dummy_sampling_arrays``
builds either one for warm-up.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from jaxserve.core.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, SamplingParams


class SamplingRow(NamedTuple):
    """What the sampler needs of one sampled row, beyond its ``SamplingParams``."""

    params: SamplingParams
    output_token_ids: Sequence[int]
    prompt_token_ids: Sequence[int]
    eos_token_ids: Sequence[int] | int | None  # masked with stop_token_ids under min_tokens
    num_generated: int  # tokens generated so far: the row's key step and min_tokens counter


# The sampler's arrays: name -> (dtype, padding value, width: None = [S], "stop" / "bias" /
# "history" = [S, that layout width], or an int). The device side's SamplingMetadata has exactly
# these fields (tests/worker/test_sampler.py checks it). Padding rows are greedy and inert.
_ARRAYS = {
    "temperature": (np.float32, 0.0, None),
    "top_p": (np.float32, 1.0, None),
    "top_k": (np.int32, 0, None),
    "min_p": (np.float32, 0.0, None),
    "presence_penalty": (np.float32, 0.0, None),
    "frequency_penalty": (np.float32, 0.0, None),
    "repetition_penalty": (np.float32, 1.0, None),
    "seeds": (np.uint32, 0, 2),
    "steps": (np.int32, 0, None),
    "num_logprobs": (np.int32, -1, None),
    "mask_stop": (np.bool_, False, None),
    "stop_ids": (np.int32, -1, "stop"),
    "bias_ids": (np.int32, -1, "bias"),
    "bias_values": (np.float32, 0.0, "bias"),
    "history": (np.int32, -1, "history"),
    "prompt_lens": (np.int32, 0, None),
}
SAMPLING_FIELDS = tuple(_ARRAYS)

COMPACT_BIAS_WIDTH = 8
COMPACT_STOP_WIDTH = 8
FULL_STOP_WIDTH = MAX_STOP_TOKEN_IDS + 65  # stop_token_ids + EOS ids from the generation config

_default_rng = np.random.default_rng()


def layout_widths(full: bool, history_len: int) -> tuple[int, int, int]:
    """(history, bias, stop) widths of a layout."""
    if full:
        return history_len, MAX_LOGIT_BIAS, FULL_STOP_WIDTH
    return 1, COMPACT_BIAS_WIDTH, COMPACT_STOP_WIDTH


def _eos_list(eos) -> list[int]:
    if eos is None:
        return []
    if isinstance(eos, (int, np.integer)):
        return [int(eos)]
    return [int(t) for t in eos]


def dummy_sampling_arrays(s_bucket: int, *, full: bool = False, history_len: int = 1) -> dict:
    """All-padding arrays of a layout (greedy rows): what warm-up compiles with."""
    L, B, E = layout_widths(full, history_len)
    widths = {None: (), "stop": (E,), "bias": (B,), "history": (L,)}
    return {name: np.full((s_bucket,) + (widths[w] if not isinstance(w, int) else (w,)), fill,
                          dtype)
            for name, (dtype, fill, w) in _ARRAYS.items()}


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
