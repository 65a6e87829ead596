"""The LoRA delta inside a model's projections (many adapters in one batch).

``LoRABatch`` rides into the forward next to the attention metadata: each token's adapter slot
(``-1``: the base model), the slots' scales, and per layer the stacked ``(A, B)`` of each
adapted projection (``jaxserve.lora.slots``). A projection adds
``scale[s] * (x @ A[s]) @ B[s]`` to exactly the rows whose slot is ``s``.
"""
from __future__ import annotations

from typing import NamedTuple

import jax

from pallas_kernels import lora as lora_kernels


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


def project(linear, x, lora: LayerLoRA | None, module: str):
    """``linear(x)`` plus each row's adapter delta when ``module`` is adapted."""
    return _add_delta(linear(x), x, lora, module)


def project_many(linears, x, lora: LayerLoRA | None, modules):
    """``project`` of one input through several projections (q/k/v, gate/up). int8 (W8A8)
    projections share one matmul call that quantizes ``x`` once
    (``quantization.int8_dynamic_matmuls``)."""
    if len(linears) > 1 and all(hasattr(m, "int8_operands") for m in linears):
        from jaxserve.models.quantization import int8_dynamic_matmuls

        ys = int8_dynamic_matmuls(x, [m.int8_operands() for m in linears])
        ys = [m.add_bias(y) for m, y in zip(linears, ys)]
        return [_add_delta(y, x, lora, name) for y, name in zip(ys, modules)]
    return [project(m, x, lora, name) for m, name in zip(linears, modules)]


def _add_delta(y, x, lora: LayerLoRA | None, module: str):
    if lora is None or module not in lora.modules:
        return y
    a, b = lora.modules[module]
    if lora.kernel == "pallas":
        delta = lora_kernels.lora_delta_pallas(x.astype(a.dtype), a, b, lora.slots, lora.scale)
    else:
        delta = lora_kernels.lora_delta(x.astype(a.dtype), a, b, lora.slots, lora.scale)
    return y + delta.astype(y.dtype)
