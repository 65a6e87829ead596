"""Sleep and wake of a runner's device memory: the KV pool and the weights, each a "tag".

vLLM's levels: level 1 drops the KV pool and keeps the weights in host memory; level 2 drops
both (a wake reloads the weights from their source). The pool comes back as zeros of the same
shapes, dtypes and shardings, and the weights as arrays of the same placement, so the compiled
steps run on as before (no recompile). Dropping means dropping every reference the engine holds:
the buffers go back to the allocator unless someone else (a trainer sharing its arrays) holds
them too.
"""
from __future__ import annotations

from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.worker.weight_update import abstract_leaves

TAGS = ("weights", "kv_cache")


def check_tags(tags) -> tuple[str, ...]:
    """The tags named (all of them when None); an unknown tag is a ValueError naming it."""
    if tags is None:
        return TAGS
    if isinstance(tags, str):
        tags = [tags]
    bad = [t for t in tags if t not in TAGS]
    if bad:
        raise ValueError(f"tags: unknown tag {bad[0]!r} (expected some of {', '.join(TAGS)})")
    return tuple(dict.fromkeys(tags))


class RunnerSleep:
    """What a sleeping runner keeps: the pool's and the weights' shapes and placements, and the
    weights' host copies at level 1."""

    def __init__(self):
        self.asleep: set[str] = set()  # tags whose device memory is released
        self.level = 0
        self._pool_abstract = None
        self._host_weights: list[np.ndarray] | None = None
        self._weights_abstract: list | None = None

    @property
    def weights_abstract(self) -> list | None:
        return self._weights_abstract

    def sleep(self, runner, level: int) -> None:
        """Release the KV pool (and the weights: to host memory at level 1, dropped at 2)."""
        if level not in (1, 2):
            raise ValueError(f"level: expected 1 or 2, got {level!r}")
        with runner._pool_lock:
            if "kv_cache" not in self.asleep:
                self._pool_abstract = jax.tree_util.tree_map(
                    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                    runner.kv_pages)
                runner.kv_pages = None
                self.asleep.add("kv_cache")
            if "weights" not in self.asleep:
                leaves = runner._state_leaves
                self._weights_abstract = abstract_leaves(leaves)
                self._host_weights = jax.device_get(leaves) if level == 1 else None
                runner.set_params(self._weights_abstract)
                self.asleep.add("weights")
            elif level == 1 and self._host_weights is None:
                raise ValueError("level: the weights were dropped (level 2) and cannot be kept "
                                 "in host memory; wake them up first")
            self.level = max(self.level, level)

    def wake_up(self, runner, tags, reload=None) -> None:
        """Bring back the tags named. ``reload(abstract leaves) -> leaves``: the weights of a
        level-2 sleep, read from their source."""
        with runner._pool_lock:
            if "kv_cache" in tags and "kv_cache" in self.asleep:
                runner.kv_pages = jax.tree_util.tree_map(_zeros, self._pool_abstract)
                self.asleep.discard("kv_cache")
            if "weights" in tags and "weights" in self.asleep:
                if self._host_weights is not None:
                    leaves = [jax.device_put(h, a.sharding)
                              for h, a in zip(self._host_weights, self._weights_abstract)]
                else:
                    if reload is None:
                        raise ValueError("tags: the weights slept at level 2 and there is no "
                                         "source to reload them from")
                    leaves = reload(self._weights_abstract)
                runner.set_params(leaves)
                self.weights_restored()
            if not self.asleep:
                self.level = 0

    def weights_restored(self) -> None:
        """New weights were installed while asleep (``update_weights``): nothing to bring."""
        self._host_weights = None
        self.asleep.discard("weights")
        if not self.asleep:
            self.level = 0


def _zeros(a: jax.ShapeDtypeStruct) -> jax.Array:
    return _zeros_fn(a.shape, np.dtype(a.dtype), a.sharding)()


@lru_cache(maxsize=None)
def _zeros_fn(shape, dtype, sharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)

