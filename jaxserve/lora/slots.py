"""The device side of multi-LoRA: ``max_loras`` slots of stacked A/B weights per projection.

Every adaptable projection of every layer has ``A [L, in, R]`` and ``B [L, R, out]`` (L =
max_loras, R = max_lora_rank; a smaller rank is zero-padded, an untargeted projection is all
zeros) and all slots share ``scale [L]``. Shapes never change, so writing an adapter into a slot
is one compiled update and the step graph never recompiles for an adapter or a mix. Under
tensor parallelism A and B are sharded like the projection they adapt: B over the outputs of a
column-parallel projection, A over the inputs of a row-parallel one.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.loaders.peft import LoRAAdapter, LoRATargets

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _layer_and_module(path: str) -> tuple[int, str]:
    m = _LAYER.search(path)
    if m is None:
        raise ValueError(f"{path!r} is not inside a decoder layer")
    return int(m.group(1)), path.rsplit(".", 1)[1]


class LoRASlots:
    """The stacked adapter weights on the device and the update that fills one slot."""

    def __init__(self, targets: LoRATargets, num_layers: int, max_loras: int, max_rank: int,
                 dtype, mesh=None, weight_specs: dict[str, PartitionSpec] | None = None,
                 layers: tuple[int, int] | None = None):
        """``layers``: ``[lo, hi)``, the model layers these slots cover (a pipeline stage's);
        their weights sit at ``layer - lo``. Default: every layer."""
        self.max_loras, self.max_rank, self.dtype = max_loras, max_rank, jnp.dtype(dtype)
        lo, hi = layers if layers is not None else (0, num_layers)
        num_layers = hi - lo
        where = {p: _layer_and_module(p) for p in targets.shapes}
        self.paths = sorted(p for p, (i, _) in where.items() if lo <= i < hi)
        self._where = {p: (where[p][0] - lo, where[p][1]) for p in self.paths}
        self._shapes = targets.shapes
        layers: list[dict] = [dict() for _ in range(num_layers)]
        shardings: list[dict] = [dict() for _ in range(num_layers)]
        for p in self.paths:
            i, mod = self._where[p]
            d_in, d_out = targets.shapes[p]
            layers[i][mod] = (np.zeros((max_loras, d_in, max_rank), self.dtype),
                              np.zeros((max_loras, max_rank, d_out), self.dtype))
            if mesh is not None:
                spec = tuple((weight_specs or {}).get(p, PartitionSpec()))
                out_s, in_s = spec + (None,) * (2 - len(spec))  # the weight is [out, in]
                shardings[i][mod] = (NamedSharding(mesh, PartitionSpec(None, in_s, None)),
                                     NamedSharding(mesh, PartitionSpec(None, None, out_s)))
        tree = (np.zeros((max_loras,), np.float32), tuple(layers))
        if mesh is None:
            self.arrays = jax.device_put(tree)
            self._update = jax.jit(_write_slot, donate_argnums=0)
        else:
            rep = NamedSharding(mesh, PartitionSpec())
            tree_sh = (rep, tuple(shardings))
            self.arrays = jax.device_put(tree, tree_sh)
            self._update = jax.jit(_write_slot, donate_argnums=0, out_shardings=tree_sh)
        self.clear(0)  # compiles the update now, not on the first request

    def _slot_tree(self, adapter: LoRAAdapter | None):
        """One slot's content: the adapter's weights padded to the slot rank, zeros elsewhere."""
        layers = [dict() for _ in self.arrays[1]]
        r = 0 if adapter is None else adapter.rank
        for p in self.paths:
            i, mod = self._where[p]
            d_in, d_out = self._shapes[p]
            a = np.zeros((d_in, self.max_rank), self.dtype)
            b = np.zeros((self.max_rank, d_out), self.dtype)
            if adapter is not None and p in adapter.weights:
                wa, wb = adapter.weights[p]
                a[:, :r], b[:r] = wa, wb
            layers[i][mod] = (a, b)
        scale = np.float32(0.0 if adapter is None else adapter.scale)
        return scale, tuple(layers)

    def write(self, slot: int, adapter: LoRAAdapter) -> None:
        if adapter.rank > self.max_rank:
            raise ValueError(f"adapter {adapter.name!r}: rank {adapter.rank} > {self.max_rank}")
        self.arrays = self._update(self.arrays, jnp.int32(slot), self._slot_tree(adapter))

    def clear(self, slot: int) -> None:
        self.arrays = self._update(self.arrays, jnp.int32(slot), self._slot_tree(None))


def _write_slot(tree, slot, new):
    return jax.tree_util.tree_map(lambda w, n: w.at[slot].set(n.astype(w.dtype)), tree, new)
