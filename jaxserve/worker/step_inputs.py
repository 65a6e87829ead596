"""The jit boundary of a step: typed pytrees of fixed shape, each sent as one packed buffer.

The host's ``StepPlan`` (``core.step_plan``, built by ``InputBatch.prepare_inputs``) becomes
two device-side views here: :class:`StepInputs`, what the forward (and the MTP head, the state
rollback, the pipeline stages) read, and :class:`SamplerInputs`, what the sampler reads. Every
feature a step may use has a field of fixed shape with an "off" value (no LoRA: slots -1; no
drafts: ``num_draft`` 0, ``draft_token_ids`` ``[S, 0]``), so a program's trace depends only on
the bucket and the engine's configuration, never on what a step happens to carry.

One transfer per program: :func:`pack` lays a pytree's leaves end to end in one int32 buffer
(float32 / uint32 by bit pattern, bools as 0/1) described by a static :class:`Layout`, and
:func:`unpack` cuts it back inside the jitted function (free slices). A jitted call pays per
host argument, so ~25 small arrays cost measurably more than one buffer of the same bytes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.step_plan import StepPlan


class StepImages(NamedTuple):
    """A vision-language step's image inputs (``worker.mm_step.EncoderRunner``), a pytree
    beside :class:`StepInputs`: every step of such a runner carries them (off values without
    images; the optional fields are None or present for the engine's lifetime), so a bucket
    has one trace."""

    positions: Any  # [T] int32 text positions, or Qwen's M-RoPE [3, T]
    rows: Any  # [T] int32 the encoder-buffer row replacing each token's embedding; -1 text
    embeds: Any  # [C + 1, H] the encoder buffer (image embeddings, a trash row last)
    kv_limit: Any = None  # [T] int32 last visible position (bidirectional image runs); -1
    next_rows: Any = None  # [S] int32 buffer row of the token after each row's chunk (MTP)


@dataclass(frozen=True)
class StepInputs:
    """What the model half of a step reads. T = token bucket, S = sequence bucket,
    G = paged cache groups, M = max pages per sequence, k = speculative tokens."""

    token_ids: np.ndarray  # [T] int32; 0 where prev_ref >= 0
    positions: np.ndarray  # [T] int32
    slot_mapping: np.ndarray  # [G, T] int32 page * block_size + offset; the trash page pads
    query_start: np.ndarray  # [S+1] int32 prefix sums of new tokens per row
    seq_lens: np.ndarray  # [S] int32 context length after the step; 0 = padding row
    block_tables: np.ndarray  # [G, S, M] int32
    logits_indices: np.ndarray  # [S] int32, or [S, k+1] when speculating (every verified pos)
    prev_ref: np.ndarray  # [T] int32 the last-token buffer row holding this token's id; -1
    state_slots: np.ndarray  # [S] int32 state-pool slot (LinearState layers); -1 none
    lora_slots: np.ndarray  # [T] int32 adapter slot of each token; -1 = the base model
    num_draft: np.ndarray  # [S] int32 draft tokens verified in each row; 0 = none
    next_token_ids: np.ndarray  # [S] int32 the known token after a row (MTP head); -1
    num_seqs: np.ndarray  # [] int32 real rows
    # [S, K] int32 layers whose residual stream each row's tokens return (-1: none); K is
    # the engine's max_hidden_state_layers, [S, 0] when it captures nothing
    hidden_layers: np.ndarray
    # [T] bool tokens that read the step's prompt embeddings (a forward argument of its own)
    # instead of their id's embedding; [0] when the engine takes none
    embed_mask: np.ndarray

    @classmethod
    def from_plan(cls, plan: StepPlan) -> StepInputs:
        """The one constructor: the plan's forward fields, absent features at their off
        values."""
        s = plan.seq_bucket
        off = np.full(s, -1, np.int32)
        return cls(
            token_ids=plan.token_ids, positions=plan.positions, slot_mapping=plan.slot_mapping,
            query_start=plan.query_start, seq_lens=plan.seq_lens,
            block_tables=plan.block_tables,
            logits_indices=(plan.spec_logits_indices if plan.spec_logits_indices is not None
                            else plan.logits_indices),
            prev_ref=plan.prev_ref, state_slots=plan.state_slots, lora_slots=plan.lora_slots,
            num_draft=plan.num_draft if plan.num_draft is not None else np.zeros(s, np.int32),
            next_token_ids=plan.next_token_ids if plan.next_token_ids is not None else off,
            num_seqs=np.asarray(plan.num_seqs, np.int32),
            hidden_layers=(plan.hidden_layers if plan.hidden_layers is not None
                           else np.zeros((s, 0), np.int32)),
            embed_mask=(plan.embed_mask if plan.embed_mask is not None
                        else np.zeros(0, np.bool_)))

    def replace(self, **changes) -> StepInputs:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class SamplerInputs:
    """What the sampler half of a step reads (S = sequence bucket, k = speculative tokens)."""

    sampling: dict  # SAMPLING_FIELDS -> [S] or [S, width] (core.sampling_metadata layouts)
    history_ref: np.ndarray  # [S, 2] int32 (last-token buffer row, history index); -1: none
    token_rows: np.ndarray  # [S] int32 the buffer row each sampled id is kept in; -1: not kept
    draft_token_ids: np.ndarray  # [S, k] int32 (k = 0: the engine does not speculate)
    num_draft: np.ndarray  # [S] int32
    # custom jax logits processors' state rows, one dict of [S, ...] arrays each; () = none
    processors: tuple = ()

    @classmethod
    def from_plan(cls, plan: StepPlan, num_spec_tokens: int = 0,
                  processors: tuple = ()) -> SamplerInputs:
        s = plan.seq_bucket
        if plan.draft_token_ids is not None:
            drafts, num_draft = plan.draft_token_ids, plan.num_draft
        else:
            drafts = np.zeros((s, num_spec_tokens), np.int32)
            num_draft = np.zeros(s, np.int32)
        return cls(sampling=plan.sampling, history_ref=plan.history_ref,
                   token_rows=plan.token_rows, draft_token_ids=drafts, num_draft=num_draft,
                   processors=(plan.processor_state if plan.processor_state is not None
                               else processors))

    @property
    def speculating(self) -> bool:
        return self.draft_token_ids.shape[1] > 0


for _cls in (StepInputs, SamplerInputs):
    jax.tree_util.register_dataclass(
        _cls, data_fields=[f.name for f in dataclasses.fields(_cls)], meta_fields=[])


class Layout:
    """Where each leaf of a packed pytree lies: its tree structure and each leaf's shape and
    dtype. A static argument of the jitted functions; interned (one object per layout) with
    its hash computed once, so the per-call lookup costs nothing."""

    __slots__ = ("treedef", "leaves", "_hash")

    def __init__(self, treedef, leaves: tuple):
        self.treedef, self.leaves = treedef, leaves
        self._hash = hash((treedef, leaves))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, Layout) and self.treedef == other.treedef
                                 and self.leaves == other.leaves)

    @property
    def size(self) -> int:
        return sum(int(np.prod(shape)) for shape, _ in self.leaves)


_LAYOUTS: dict = {}


def pack(tree) -> tuple[np.ndarray, Layout]:
    """One int32 buffer holding every leaf of ``tree`` (numpy arrays of 4-byte or bool
    dtype), and its layout."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    arrays = [np.asarray(x) for x in leaves]
    key = (treedef, tuple((a.shape, a.dtype.str) for a in arrays))
    layout = _LAYOUTS.get(key)
    if layout is None:
        for a in arrays:
            if a.dtype != np.bool_ and a.dtype.itemsize != 4:
                raise TypeError(f"cannot pack a leaf of dtype {a.dtype}")
        layout = _LAYOUTS.setdefault(key, Layout(treedef, key[1]))
    parts = [a.astype(np.int32).reshape(-1) if a.dtype == np.bool_
             else np.ascontiguousarray(a).view(np.int32).reshape(-1) for a in arrays]
    return np.concatenate(parts) if parts else np.zeros(0, np.int32), layout


def unpack(buf, layout: Layout):
    """Inside a jitted function: the pytree :func:`pack` laid into ``buf``."""
    out, o = [], 0
    for shape, dtype in layout.leaves:
        n = int(np.prod(shape))
        x = buf[o:o + n].reshape(shape)
        o += n
        dt = np.dtype(dtype)
        if dt == np.bool_:
            x = x != 0
        elif dt != np.int32:
            x = jax.lax.bitcast_convert_type(x, jnp.dtype(dt))
        out.append(x)
    return jax.tree_util.tree_unflatten(layout.treedef, out)
