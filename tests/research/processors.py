"""Custom logits processors the research tests run: each bans a token for the rows whose
extra_args ask (one jax, one host), and one that raises."""
import numpy as np

from jaxserve.core.logits_processor import (BatchUpdate, JaxLogitsProcessor, LogitsProcessor,
                                            MoveDirectionality)


class _Rows:
    """Per-row value from extra_args[key], kept by batch index (vLLM's update protocol)."""

    key = ""

    def _update(self, rows: dict, update: BatchUpdate | None):
        if update is None:
            return
        for i in update.removed:
            rows.pop(i, None)
        for i, params, _prompt, _out in update.added:
            v = (params.extra_args or {}).get(self.key)
            rows.pop(i, None)
            if v is not None:
                rows[i] = v
        for a, b, how in update.moved:
            va, vb = rows.pop(a, None), rows.pop(b, None)
            if va is not None:
                rows[b] = va
            if vb is not None and how is MoveDirectionality.SWAP:
                rows[a] = vb


class BanJax(_Rows, JaxLogitsProcessor):
    key = "ban_jax"

    def __init__(self, vllm_config, device, is_pin_memory):
        self.rows = {}
        self.ban = np.full(vllm_config.scheduler.max_num_seqs, -1, np.int32)

    def is_argmax_invariant(self):
        return False

    def update_state(self, update):
        self._update(self.rows, update)
        self.ban[:] = -1
        for i, tok in self.rows.items():
            self.ban[i] = tok

    def state(self):
        return {"ban": self.ban}

    @staticmethod
    def apply_jax(logits, state):
        import jax.numpy as jnp
        ids = jnp.arange(logits.shape[-1], dtype=jnp.int32)[None, :]
        return jnp.where(ids == state["ban"][:, None], -jnp.inf, logits)


class BanHost(_Rows, LogitsProcessor):
    key = "ban_host"

    def __init__(self, vllm_config, device, is_pin_memory):
        self.rows = {}

    def is_argmax_invariant(self):
        return False

    def update_state(self, update):
        self._update(self.rows, update)

    def apply(self, logits):
        for i, tok in self.rows.items():
            logits[i, tok] = -np.inf
        return logits


class Exploding(_Rows, LogitsProcessor):
    key = "explode"

    def __init__(self, vllm_config, device, is_pin_memory):
        self.rows = {}

    @classmethod
    def validate_params(cls, params):
        if (params.extra_args or {}).get("explode") == "at admission":
            raise ValueError("explode must be true")

    def is_argmax_invariant(self):
        return True

    def update_state(self, update):
        self._update(self.rows, update)

    def apply(self, logits):
        if self.rows:
            raise RuntimeError("boom")
        return logits
