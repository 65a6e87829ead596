"""The engine's logits processors (``core.logits_processor``): built once, told each step's
batch, their jax halves handed to the jitted sampler and their host halves run between the
forward and the sampler.

Nothing here runs when no processor is configured: the built-ins (min_p, logit_bias,
min_tokens) are the sampler's own jitted code (``worker.sampler``).
"""
from __future__ import annotations

import numpy as np

from jaxserve.core.logits_processor import (BUILTIN_LOGITS_PROCESSORS, BatchTracker,
                                            JaxLogitsProcessor, load_logits_processors)


class LogitsProcessorError(RuntimeError):
    """A processor raised: the requests of its step fail, the engine goes on."""


def _name(p) -> str:
    return type(p).__name__


class LogitsProcessors:
    def __init__(self, specs, config, device):
        classes = [c for c in load_logits_processors(specs)
                   if c not in BUILTIN_LOGITS_PROCESSORS]  # the sampler runs those itself
        self.classes = classes
        self.custom = [cls(config, device, False) for cls in classes]
        self.jax = [p for p in self.custom if isinstance(p, JaxLogitsProcessor)]
        self.host = [p for p in self.custom if not isinstance(p, JaxLogitsProcessor)]
        self.tracker = BatchTracker()
        self._templates = [{k: np.zeros_like(np.asarray(v)) for k, v in p.state().items()}
                           for p in self.jax]

    @property
    def active(self) -> bool:
        return bool(self.custom)

    def sampler_spec(self) -> tuple:
        """Static ``(apply_jax, argmax invariant)`` of each jax processor (the sampler's
        trace key: fixed for the engine's life)."""
        return tuple((type(p).apply_jax, bool(p.is_argmax_invariant())) for p in self.jax)

    def template(self, s: int) -> tuple:
        """Zero state of ``s`` rows (warm-up and steps without custom state)."""
        return tuple({k: v[:s] for k, v in t.items()} for t in self._templates)

    def validate(self, params) -> None:
        for cls in self.classes:
            try:
                cls.validate_params(params)
            except Exception as e:  # noqa: BLE001 - any refusal is the request's error
                raise ValueError(f"logits processor {cls.__name__} refused the request: "
                                 f"{e}") from None

    def begin_step(self, req_ids, added_info, seq_bucket: int):
        """Tell every processor the step's batch; returns (the jax processors' state rows for
        the sampler, the host processors' function on ``[batch, V]`` numpy logits or None).
        Raises :class:`LogitsProcessorError` naming the processor that failed."""
        update = self.tracker.update(req_ids, added_info)
        for p in self.custom:
            try:
                p.update_state(update)
            except Exception as e:  # noqa: BLE001 - a user processor: its step fails
                raise LogitsProcessorError(
                    f"logits processor {_name(p)} failed in update_state: "
                    f"{type(e).__name__}: {e}") from e
        state = []
        for p, t in zip(self.jax, self._templates):
            try:
                st = p.state()
                rows = {}
                for k, v in t.items():
                    a = np.asarray(st[k])
                    if a.shape != v.shape or a.dtype != v.dtype:
                        raise ValueError(f"state {k!r} is {a.dtype}{list(a.shape)}, was "
                                         f"{v.dtype}{list(v.shape)} (it must keep one shape)")
                    rows[k] = a[:seq_bucket]
            except Exception as e:  # noqa: BLE001
                raise LogitsProcessorError(f"logits processor {_name(p)} failed in state: "
                                           f"{type(e).__name__}: {e}") from e
            state.append(rows)
        return tuple(state), (self._apply_host if self.host else None)

    def _apply_host(self, logits: np.ndarray) -> np.ndarray:
        for p in self.host:
            try:
                out = p.apply(logits)
                logits = np.asarray(out, dtype=np.float32) if out is not None else logits
            except Exception as e:  # noqa: BLE001
                raise LogitsProcessorError(f"logits processor {_name(p)} failed in apply: "
                                           f"{type(e).__name__}: {e}") from e
        return logits
