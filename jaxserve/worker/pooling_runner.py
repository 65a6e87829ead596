"""The encoder's runner: whole prompts packed into fixed-shape rows, one compiled step per
token bucket, pooled on the device.

A step's tokens are laid out as ``rows[R, W]``: ``W`` is the row width (the smallest power of
two holding ``max_model_len``), so any prompt fits one row and several short prompts share one
(attention is masked to each prompt's own tokens, so a packed row costs ``W`` per token, not
the step's whole width). Buckets: one row of ``16, 32, ... < W`` tokens, then ``R = 1, 2, 4,
...`` full rows up to ``max_num_batched_tokens``; ``S`` = ``max_num_seqs`` rows of output.
Warm-up compiles every bucket; a step never compiles after it (``num_compiles``).
"""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

logger = logging.getLogger(__name__)


@dataclass
class PackedStep:
    """Host arrays of one step (int32): ``[R, W]`` token grid, ``[S]`` per-sequence rows."""

    token_ids: np.ndarray
    positions: np.ndarray
    token_type_ids: np.ndarray
    segment_ids: np.ndarray  # sequence index per token, -1 = padding
    starts: np.ndarray  # flat index of each sequence's first token (0 for padding rows)
    lens: np.ndarray  # 0 = padding row
    num_seqs: int


def pack(prompts: list[tuple[list[int], list[int] | None]], rows: int, width: int,
         max_seqs: int) -> PackedStep | None:
    """First-fit of whole prompts into ``rows`` rows of ``width``; None when they do not fit."""
    free = [width] * rows
    place = []
    for ids, _ in prompts:
        n = len(ids)
        for r in range(rows):
            if free[r] >= n:
                place.append((r, width - free[r]))
                free[r] -= n
                break
        else:
            return None
    tok = np.zeros((rows, width), np.int32)
    pos = np.zeros((rows, width), np.int32)
    typ = np.zeros((rows, width), np.int32)
    seg = np.full((rows, width), -1, np.int32)
    starts = np.zeros(max_seqs, np.int32)
    lens = np.zeros(max_seqs, np.int32)
    for s, ((ids, types), (r, o)) in enumerate(zip(prompts, place)):
        n = len(ids)
        tok[r, o:o + n] = ids
        pos[r, o:o + n] = np.arange(n)
        if types is not None:
            typ[r, o:o + n] = types
        seg[r, o:o + n] = s
        starts[s], lens[s] = r * width + o, n
    return PackedStep(tok, pos, typ, seg, starts, lens, len(prompts))


def token_buckets(width: int, max_tokens: int, min_bucket: int = 16) -> list[tuple[int, int]]:
    """``(rows, width)`` shapes, smallest first: one short row, then whole rows in steps of
    about 1.5x (1, 2, 3, 4, 6, 8, 12, 16, ...), so a step pads by at most a third."""
    out = []
    t = min(min_bucket, width)
    while t < width:
        out.append((1, t))
        t *= 2
    r = 1
    while True:
        out.append((r, width))
        if r * width >= max_tokens:
            break
        if r >= 2 and r & (r - 1) == 0 and (r + r // 2) * width < max_tokens:
            out.append((r + r // 2, width))
        r *= 2
    return out


@functools.partial(jax.jit, static_argnums=(0, 1))
def _pool_step(graphdef, pooling_type: str, state, token_ids, positions, token_type_ids,
               segment_ids, starts, lens):
    """The step: encoder forward, then the model's pooling (``[S, H]``, or a classifier's
    ``[S, labels]``; ALL/STEP: every token's hidden state ``[R*W, H]``)."""
    model = nnx.merge(graphdef, state)
    hidden = model(token_ids, positions, token_type_ids, segment_ids)
    flat = hidden.reshape(-1, hidden.shape[-1])
    num_seqs = starts.shape[0]
    if model.num_labels:
        first = flat[starts] if pooling_type == "CLS" else flat[starts + jnp.maximum(lens, 1) - 1]
        return model.head(first)
    if pooling_type == "CLS":
        return flat[starts].astype(jnp.float32)
    if pooling_type == "LAST":
        return flat[starts + jnp.maximum(lens, 1) - 1].astype(jnp.float32)
    if pooling_type == "MEAN":
        seg = segment_ids.reshape(-1)
        seg = jnp.where(seg < 0, num_seqs, seg)  # padding: dropped by segment_sum
        sums = jax.ops.segment_sum(flat.astype(jnp.float32), seg, num_segments=num_seqs)
        return sums / jnp.maximum(lens, 1)[:, None].astype(jnp.float32)
    return flat.astype(jnp.float32)  # ALL / STEP: sliced per sequence on the host


class EncoderRunner:
    """Runs packed steps of an encoder-only model (``jaxserve.models.bert``)."""

    def __init__(self, model, pooling_type: str, max_model_len: int, max_num_batched_tokens: int,
                 max_num_seqs: int, min_bucket: int = 16):
        self.graphdef, self.state = nnx.split(model)
        self.pooling_type = pooling_type
        # ALL / STEP of an embedder: every token's hidden state comes back
        self.per_token = pooling_type in ("ALL", "STEP") and not model.num_labels
        self.width = 1 << max(0, (max_model_len - 1).bit_length())
        self.max_num_seqs = max_num_seqs
        self.buckets = token_buckets(self.width, max(max_num_batched_tokens, self.width),
                                     min_bucket)
        self.max_rows = self.buckets[-1][0]
        self.max_num_batched_tokens = max(max_num_batched_tokens, self.width)
        self.num_compiles = 0  # new programs this runner's steps caused (jit cache misses)
        self.compiles_at_warmup = 0  # of which warm-up's: a later one is a bug
        self.warmed_up = False

    def _compiled(self) -> int:
        return _pool_step._cache_size()

    def plan(self, prompts) -> PackedStep | None:
        """The smallest bucket the prompts pack into (None: they do not fit the largest)."""
        total = sum(len(ids) for ids, _ in prompts)
        if len(prompts) > self.max_num_seqs or total > self.max_num_batched_tokens:
            return None
        for rows, width in self.buckets:
            if rows * width < total:
                continue
            packed = pack(prompts, rows, width, self.max_num_seqs)
            if packed is not None:
                return packed
        return None

    def plan_prefix(self, prompts) -> tuple[int, PackedStep | None]:
        """The step for a leading run of ``prompts`` (first come, first served): of the
        prefixes that fit, the longest whose bucket is filled to 3/4 or within 10 % of the best
        filled one, so a step does not pad a bucket half empty for one more prompt, nor cut a
        well-filled batch short. (0, None): the first prompt does not fit."""
        free: list[int] = []  # first-fit over whole rows of ``width``
        tokens, best, fills = 0, 0.0, []
        for k, (ids, _) in enumerate(prompts[:self.max_num_seqs]):
            n = len(ids)
            for r in range(len(free)):
                if free[r] >= n:
                    free[r] -= n
                    break
            else:
                free.append(self.width - n)
            if len(free) > self.max_rows or tokens + n > self.max_num_batched_tokens:
                break
            tokens += n
            size = self._bucket_tokens(len(free), self.width - free[0])
            fills.append(tokens / size)
            best = max(best, fills[-1])
        if not fills:
            return 0, None
        k = max(i for i, f in enumerate(fills) if f >= min(0.9 * best, 0.75)) + 1
        step = self.plan(list(prompts[:k]))
        return (k, step) if step is not None else (0, None)

    def _bucket_tokens(self, rows: int, first_row_fill: int) -> int:
        for r, w in self.buckets:
            if (rows == 1 and w >= first_row_fill) or r >= rows:
                return r * w
        return self.buckets[-1][0] * self.buckets[-1][1]

    def run(self, step: PackedStep) -> list[np.ndarray]:
        """The pooled output of each sequence, in order (ALL/STEP: ``[len, H]`` blocks)."""
        before = self._compiled()
        out = _pool_step(self.graphdef, self.pooling_type, self.state, step.token_ids,
                         step.positions, step.token_type_ids, step.segment_ids, step.starts,
                         step.lens)
        out = np.asarray(out)
        grew = self._compiled() - before
        if grew:
            self.num_compiles += grew
            if self.warmed_up:
                logger.warning("pooling step compiled a new shape %s after warm-up",
                               step.token_ids.shape)
        if self.per_token:
            return [out[step.starts[i]:step.starts[i] + step.lens[i]]
                    for i in range(step.num_seqs)]
        return [out[i] for i in range(step.num_seqs)]

    def warmup(self) -> None:
        """Compile every bucket (a one-token prompt in each shape)."""
        t0 = time.perf_counter()
        for rows, width in self.buckets:
            self.run(pack([([0], None)], rows, width, self.max_num_seqs))
        self.warmed_up = True
        self.compiles_at_warmup = self.num_compiles
        logger.info("pooling runner: %d buckets %s compiled in %.1f s", len(self.buckets),
                    self.buckets, time.perf_counter() - t0)
