"""The adapters of one batch as the model sees them (many adapters in one batch).

``LoRABatch`` rides into the forward next to the attention metadata: each token's adapter slot
(``-1``: the base model), the slots' scales, and per layer the stacked ``(A, B)`` of each
adapted projection (``jaxserve.lora.slots``). A projection adds
``scale[s] * (x @ A[s]) @ B[s]`` to exactly the rows whose slot is ``s``
(``jaxserve.models.linear.project``).
"""
from __future__ import annotations

from typing import NamedTuple

import jax


class LoRABatch(NamedTuple):
    slots: jax.Array  # [T] int32 adapter slot of each token; -1 = base
    scale: jax.Array  # [L] float32
    layers: tuple  # per layer: {module name: (A [L, in, R], B [L, R, out])}


class LayerLoRA(NamedTuple):
    """One layer's share of a ``LoRABatch`` and the kernel path (static)."""

    slots: jax.Array
    scale: jax.Array
    modules: dict
    kernel: str  # "xla" | "pallas"


def layer_lora(lora: LoRABatch | None, i: int, mesh=None) -> LayerLoRA | None:
    """Layer ``i``'s weights; the Pallas SGMV/BGMV kernels on one GPU, the XLA path elsewhere
    (CPU, and tensor parallelism, where XLA partitions the matmuls like the projection's)."""
    if lora is None:
        return None
    kernel = "pallas" if jax.default_backend() == "gpu" and mesh is None else "xla"
    return LayerLoRA(lora.slots, lora.scale, lora.layers[i], kernel)


