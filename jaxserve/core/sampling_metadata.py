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
builds either one (the persistent batch fills it in).
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



def layout_widths(full: bool, history_len: int) -> tuple[int, int, int]:
    """(history, bias, stop) widths of a layout."""
    if full:
        return history_len, MAX_LOGIT_BIAS, FULL_STOP_WIDTH
    return 1, COMPACT_BIAS_WIDTH, COMPACT_STOP_WIDTH


def dummy_sampling_arrays(s_bucket: int, *, full: bool = False, history_len: int = 1) -> dict:
    """All-padding arrays of a layout (greedy rows): what warm-up compiles with."""
    L, B, E = layout_widths(full, history_len)
    widths = {None: (), "stop": (E,), "bias": (B,), "history": (L,)}
    return {name: np.full((s_bucket,) + (widths[w] if not isinstance(w, int) else (w,)), fill,
                          dtype)
            for name, (dtype, fill, w) in _ARRAYS.items()}
