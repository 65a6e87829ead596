"""Logits processors with vLLM V1's batch-level interface (``vllm.v1.sample.logits_processor``).

A processor is one object for the whole engine. Before each step it hears how the batch changed
(:class:`BatchUpdate`: requests added at a batch index, removed, moved) and keeps whatever
per-row state it needs; then it edits the step's logits, row ``i`` being batch index ``i``.
The batch of a step is its scheduled rows in order; a request left out of a step (not scheduled
then) is removed and added again when it comes back (``output_tok_ids`` is its live list of
output ids, so a processor can rebuild what it counted).

Two kinds, one interface:

* :class:`LogitsProcessor` (host): ``apply(logits)`` gets the step's ``[batch_size, V]``
  float32 logits as a writable numpy array (``torch.from_numpy`` shares it) and returns the
  edited array. It runs between the forward and the sampler, which costs a device -> host ->
  device round trip of the logits and a synchronisation every step it is active (the next step
  cannot be dispatched before this one's logits are on the host).
* :class:`JaxLogitsProcessor`: ``state()`` returns fixed-shape per-row numpy arrays
  (``[max_num_seqs, ...]``, 4-byte dtypes or bool) and the static ``apply_jax(logits, state)``
  is a pure ``jax.numpy`` function of ``[S, V]`` logits and those arrays' first ``S`` rows; it
  runs inside the jitted sampler (no copy, no sync, no recompile: the shapes never change).

Order, as vLLM's sampler: processors that are not argmax-invariant edit the logits with
logit_bias and min_tokens, before penalties and greedy's argmax; argmax-invariant ones only
after the temperature, for random rows. ``min_p``, ``logit_bias`` and ``min_tokens`` are the
built-in processors (:data:`BUILTIN_LOGITS_PROCESSORS`): the sampler runs them in its jitted
fast path. A processor that raises fails the requests of the step it raised in (finish reason
``abort``, the error in ``stop_reason``); the engine keeps serving.

Host side only (no jax here: a ``JaxLogitsProcessor``'s ``apply_jax`` imports it itself).
"""
from __future__ import annotations

import enum
import importlib
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np


class MoveDirectionality(enum.Enum):
    UNIDIRECTIONAL = enum.auto()  # the state at a moves to b (a is empty afterwards)
    SWAP = enum.auto()  # the states at a and b are exchanged


# (index, SamplingParams, prompt ids, output ids: the request's live list)
AddedRequest = tuple
RemovedRequest = int
MovedRequest = tuple  # (a, b, MoveDirectionality)


@dataclass(frozen=True)
class BatchUpdate:
    """How the batch changed since the previous step: apply ``removed``, then ``added``, then
    ``moved`` (vLLM's order)."""

    batch_size: int
    removed: Sequence[RemovedRequest] = ()
    added: Sequence[AddedRequest] = ()
    moved: Sequence[MovedRequest] = ()


class LogitsProcessor:
    """vLLM V1's interface. ``vllm_config``: the engine's ``EngineConfig`` (with
    ``max_num_seqs`` at ``vllm_config.scheduler.max_num_seqs``); ``device``: the JAX device
    the step runs on; ``is_pin_memory``: False (kept for vLLM signatures)."""

    def __init__(self, vllm_config, device, is_pin_memory: bool):
        pass

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        """Raise ``ValueError`` for a request this processor cannot serve (at admission)."""

    def is_argmax_invariant(self) -> bool:
        raise NotImplementedError

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        raise NotImplementedError

    def apply(self, logits: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class JaxLogitsProcessor(LogitsProcessor):
    """A processor run inside the jitted sampler (see the module docstring)."""

    def apply(self, logits):  # the host path is never taken for it
        raise NotImplementedError("a JaxLogitsProcessor runs inside the sampler (apply_jax)")

    def state(self) -> dict[str, np.ndarray]:
        """Per-row arrays ``[max_num_seqs, ...]`` of fixed shape and dtype."""
        raise NotImplementedError

    @staticmethod
    def apply_jax(logits, state: dict):
        """Pure ``jax.numpy``: ``[S, V]`` float32 logits, the state's first ``S`` rows."""
        raise NotImplementedError


@dataclass
class BatchTracker:
    """Turns each step's rows (request ids in order) into the :class:`BatchUpdate` from the
    previous step's: removals, additions into free slots, then swaps into place."""

    slots: list = field(default_factory=list)  # batch index -> request id or None

    def update(self, req_ids: Sequence[str], added_info) -> BatchUpdate:
        """``added_info(req_id) -> (params, prompt ids, output ids)`` of a request new to the
        batch."""
        want = set(req_ids)
        n = len(req_ids)
        cur = self.slots + [None] * max(0, n - len(self.slots))
        removed = [i for i, r in enumerate(cur) if r is not None and r not in want]
        for i in removed:
            cur[i] = None
        present = {r: i for i, r in enumerate(cur) if r is not None}
        free = (i for i, r in enumerate(cur) if r is None)
        added = []
        for rid in req_ids:
            if rid not in present:
                i = next(free)
                cur[i] = rid
                present[rid] = i
                added.append((i, *added_info(rid)))
        moved = []
        for j, rid in enumerate(req_ids):
            i = present[rid]
            if i != j:
                other = cur[j]
                cur[i], cur[j] = other, rid
                present[rid] = j
                if other is not None:
                    present[other] = i
                moved.append((i, j, MoveDirectionality.SWAP))
        self.slots = cur[:n]
        return BatchUpdate(n, removed, added, moved)


def load_logits_processors(specs) -> list[type]:
    """Processor classes from ``module:Class`` / ``module.Class`` strings or classes
    (``--logits-processors``, ``LLM(logits_processors=[...])``)."""
    out = []
    for spec in specs or ():
        if isinstance(spec, type):
            cls = spec
        elif isinstance(spec, str) and (":" in spec or "." in spec):
            mod, _, name = spec.rpartition(":") if ":" in spec else spec.rpartition(".")
            try:
                cls = getattr(importlib.import_module(mod), name)
            except (ImportError, AttributeError) as e:
                raise ValueError(f"logits_processors: cannot load {spec!r} ({e})") from None
        else:
            raise ValueError(f"logits_processors: {spec!r} is not a class nor 'module:Class'")
        if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)) and not all(
                hasattr(cls, m) for m in ("apply", "update_state", "is_argmax_invariant")):
            raise ValueError(f"logits_processors: {spec!r} is not a LogitsProcessor")
        out.append(cls)
    return out


# ---- the built-in processors: their interface (the sampler runs their jitted twins) ------------
class _PerRow(LogitsProcessor):
    """A built-in's per-row parameter, kept by batch index from the batch updates."""

    def __init__(self, vllm_config=None, device=None, is_pin_memory: bool = False):
        self.rows: dict[int, Any] = {}

    def _of(self, params, output_ids):
        raise NotImplementedError

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for i in batch_update.removed:
            self.rows.pop(i, None)
        for i, params, _prompt, output_ids in batch_update.added:
            v = self._of(params, output_ids)
            if v is None:
                self.rows.pop(i, None)
            else:
                self.rows[i] = v
        for a, b, how in batch_update.moved:
            va, vb = self.rows.pop(a, None), self.rows.pop(b, None)
            if va is not None:
                self.rows[b] = va
            if vb is not None and how is MoveDirectionality.SWAP:
                self.rows[a] = vb


class MinPLogitsProcessor(_PerRow):
    """Drop tokens whose probability is below ``min_p`` times the top one's."""

    def is_argmax_invariant(self) -> bool:
        return True

    def _of(self, params, output_ids):
        return params.min_p if params.min_p > 0 and not params.is_greedy else None

    def apply(self, logits: np.ndarray) -> np.ndarray:
        for i, p in self.rows.items():
            row = logits[i]
            row[row < row.max() + np.log(p)] = -np.inf
        return logits


class LogitBiasLogitsProcessor(_PerRow):
    """Add each request's ``logit_bias`` to its tokens."""

    def is_argmax_invariant(self) -> bool:
        return False

    def _of(self, params, output_ids):
        return dict(params.logit_bias) if params.logit_bias else None

    def apply(self, logits: np.ndarray) -> np.ndarray:
        for i, bias in self.rows.items():
            for tok, b in bias.items():
                logits[i, tok] += b
        return logits


class MinTokensLogitsProcessor(_PerRow):
    """Forbid the stop ids (EOS and ``stop_token_ids``) until ``min_tokens`` are out;
    ``eos_token_ids`` from the engine."""

    def __init__(self, vllm_config=None, device=None, is_pin_memory: bool = False,
                 eos_token_ids: Sequence[int] = ()):
        super().__init__(vllm_config, device, is_pin_memory)
        self.eos_token_ids = list(eos_token_ids)

    def is_argmax_invariant(self) -> bool:
        return False

    def _of(self, params, output_ids):
        if not params.min_tokens:
            return None
        stops = sorted(set(params.stop_token_ids or ()) | set(self.eos_token_ids))
        return params.min_tokens, stops, output_ids

    def apply(self, logits: np.ndarray) -> np.ndarray:
        for i, (n, stops, out) in self.rows.items():
            if len(out) < n and stops:
                logits[i, stops] = -np.inf
        return logits


BUILTIN_LOGITS_PROCESSORS = (MinPLogitsProcessor, LogitBiasLogitsProcessor,
                             MinTokensLogitsProcessor)
