"""Every projection a model runs: the plain ``Linear``, its quantized forms (fp8, int8 W8A8,
int4/int8 groups), the LM head's table, and the LoRA delta added to a projection's output.

One module so the families, the quantizer (``jaxserve.models.quantization``, which swaps a
``Linear`` for a quantized one before loading) and LoRA all import downwards from here.
Parameters keep Hugging Face's ``[out, in]`` layout (see ``quantization`` for the quantized
layouts). The matmuls dequantize inside the jitted step (one XLA fusion feeding the dot); on
Hopper fp8 layers run fp8 x fp8 with per-token dynamic activation scales.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
from flax import nnx

from jaxserve.models.lora import LayerLoRA
from pallas_kernels import cpu_kernels, reference
from pallas_kernels import lora as lora_kernels

FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
FP8 = jnp.float8_e4m3fn


# ----------------------------------------------------------------------------- plain

def normal(rngs: nnx.Rngs, shape, dtype, std=0.02):
    return _normal_values(rngs.params(), tuple(shape), jnp.dtype(dtype), std)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _normal_values(key, shape: tuple, dtype, std: float):
    """One program per (shape, dtype, std): a model built op by op (dummy weights) compiles
    each weight shape once, not each of its ops."""
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


class Linear(nnx.Module):
    """``y = x @ weight.T (+ bias)`` with HF's ``[out, in]`` weight layout."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(normal(rngs, (out_features, in_features), dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None

    def __call__(self, x):
        w = self.weight[...]
        y = jax.lax.dot_general(x.astype(w.dtype), w, (((x.ndim - 1,), (1,)), ((), ())))
        if self.bias is not None:
            y = y + self.bias[...]
        return y


# ----------------------------------------------------------------------------- quantized matmuls

def _dot(x, w):
    """``x[..., in] @ w[out, in].T`` accumulated in float32."""
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)


def fp8_weight_only_matmul(x, weight, weight_scale):
    """fp8 storage, upcast to the activation dtype inside the matmul; scale per output column."""
    y = _dot(x, weight.astype(x.dtype))
    return (y * weight_scale).astype(x.dtype)


def quantize_fp8_per_token(x):
    """Dynamic per-token activation quantization: ``x ~ xq * scale`` with ``scale [..., 1]``."""
    xf = x.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(xf), axis=-1, keepdims=True) / FP8_MAX, 1e-12)
    return jnp.clip(xf / scale, -FP8_MAX, FP8_MAX).astype(FP8), scale


def fp8_dynamic_matmul(x, weight, weight_scale, *, emulate: bool = False):
    """Hopper's path: fp8 x fp8 ``dot_general`` with per-token activation scales, float32
    accumulation, output in the activation dtype. ``emulate`` upcasts both fp8 operands to
    float32 first (same numbers, any backend): the CPU check of this path."""
    xq, a_scale = quantize_fp8_per_token(x)
    if emulate:
        y = _dot(xq.astype(jnp.float32), weight.astype(jnp.float32))
    else:
        y = _dot(xq, weight)
    return (y * a_scale * weight_scale).astype(x.dtype)


def int8_kernel_enabled() -> bool:
    """The C++ W8A8 kernel serves int8 matmuls (``pallas_kernels.cpu_kernels.available``)."""
    return cpu_kernels.available()


def int8_dynamic_matmul(x, weight, weight_scale):
    """W8A8 with a two-term activation: ``x / a = hi + lo / 254`` per token (``a = max|x| /
    127``; ``hi``, ``lo`` int8), both rows through one int8 x int8 -> int32 ``dot_general``
    against the stored int8 ``weight [out, in]``, then ``(hi_acc + lo_acc / 254) * a *
    weight_scale``. The second term makes the activation ~15 bits (one int8 row per token
    lost SmolLM2 1.7 % of held-out perplexity; two keep it at float32's). On one CPU device
    the C++ kernel runs it (``pallas_kernels.cpu_kernels``: XLA:CPU reads a one-row int8 dot
    at a quarter of the machine's bandwidth); elsewhere XLA runs the same rule."""
    return int8_dynamic_matmuls(x, [(weight, weight_scale)])[0]


def int8_dynamic_matmuls(x, weights):
    """:func:`int8_dynamic_matmul` of one input against 1 to 3 ``(weight, weight_scale)``
    (q/k/v, gate/up): with the CPU kernel, one call that quantizes ``x`` once."""
    lead, n = x.shape[:-1], x.shape[-1]
    xf = x.reshape(-1, n).astype(jnp.float32)
    if int8_kernel_enabled():
        ys = cpu_kernels.int8_matmul(xf, list(weights))
    else:
        ys = [reference.int8_matmul_reference(xf, w, s) for w, s in weights]
    return [y.reshape(*lead, -1).astype(x.dtype) for y in ys]


def int4_dequantize(qweight, scales, zeros, dtype, bits: int = 4, group_size: int | None = None):
    """``qweight [out, in/2]`` uint8 nibbles (or ``[out, in]`` bytes for 8 bits),
    ``scales``/``zeros [out, G]`` -> ``[out, in]``, input channel ``j`` in group
    ``j // group_size`` (None: ``in / G``); the last group may be short (GPTQ's when the group
    size does not divide ``in``). Float zero points are applied in float32."""
    out, groups = scales.shape
    if bits == 4:
        q = jnp.stack([qweight & 0xF, qweight >> 4], axis=-1).reshape(out, -1)
    else:
        q = qweight
    n_in = q.shape[1]
    size = group_size or n_in // groups
    if groups * size != n_in:  # a short last group: pad it to a whole one, then cut
        q = jnp.pad(q, ((0, 0), (0, groups * size - n_in)))
    q = q.reshape(out, groups, size)
    zdt = dtype if zeros.dtype == jnp.uint8 else jnp.float32
    w = (q.astype(zdt) - zeros[..., None].astype(zdt)) * scales[..., None].astype(zdt)
    return w.astype(dtype).reshape(out, -1)[:, :n_in]


def int4_matmul(x, qweight, scales, zeros, perm=None, bits: int = 4,
                group_size: int | None = None):
    if perm is not None:
        x = jnp.take(x, perm, axis=-1)
    dtype = x.dtype
    if perm is not None and dtype == jnp.bfloat16 and jax.default_backend() == "cpu":
        x = x.astype(jnp.float32)  # XLA CPU: no bf16 x bf16 -> f32 dot after the gather
    w = int4_dequantize(qweight, scales, zeros, x.dtype, bits, group_size)
    return _dot(x, w).astype(dtype)


# ----------------------------------------------------------------------------- modules

class Fp8Linear(nnx.Module):
    """A ``Linear`` with float8_e4m3fn weights and per-output-channel float32 scales."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype,
                 fp8_compute: bool = False):
        self.weight = nnx.Param(jnp.zeros((out_features, in_features), FP8))
        self.weight_scale = nnx.Param(jnp.ones((out_features,), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None
        self.fp8_compute = fp8_compute  # static: part of the graph

    def __call__(self, x):
        mm = fp8_dynamic_matmul if self.fp8_compute else fp8_weight_only_matmul
        y = mm(x, self.weight[...], self.weight_scale[...])
        if self.bias is not None:
            y = y + self.bias[...]
        return y


class Int8Linear(nnx.Module):
    """A ``Linear`` with int8 weights (one float32 scale per output channel) run as W8A8 with
    per-token dynamic activation scales (:func:`int8_dynamic_matmul`)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype):
        self.weight = nnx.Param(jnp.zeros((out_features, in_features), jnp.int8))
        self.weight_scale = nnx.Param(jnp.ones((out_features,), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None

    def __call__(self, x):
        return self.add_bias(int8_dynamic_matmul(x, self.weight[...], self.weight_scale[...]))

    def int8_operands(self):
        """(weight, weight_scale): for a matmul call shared with other projections."""
        return self.weight[...], self.weight_scale[...]

    def add_bias(self, y):
        return y if self.bias is None else y + self.bias[...]


class Int4Linear(nnx.Module):
    """A ``Linear`` with group-quantized 4-bit (AWQ, GPTQ, GGUF Q4_0/Q4_1) or 8-bit (GGUF Q8_0)
    weights, dequantized in the matmul."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype,
                 group_size: int, act_order: bool, bits: int = 4, zero_dtype=jnp.uint8):
        if in_features % 2:
            raise ValueError(f"in_features {in_features} is not even")
        groups = -(-in_features // group_size)  # GPTQ: the last group may be short
        self.bits, self.group_size = bits, group_size  # static
        self.qweight = nnx.Param(jnp.zeros((out_features, in_features * bits // 8), jnp.uint8))
        self.scales = nnx.Param(jnp.ones((out_features, groups), dtype))
        self.zeros = nnx.Param(jnp.zeros((out_features, groups), zero_dtype))
        self.perm = nnx.Param(jnp.arange(in_features, dtype=jnp.int32)) if act_order else None
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None

    def __call__(self, x):
        perm = None if self.perm is None else self.perm[...]
        y = int4_matmul(x, self.qweight[...], self.scales[...], self.zeros[...], perm,
                        self.bits, self.group_size)
        if self.bias is not None:
            y = y + self.bias[...]
        return y


class Int8Table(nnx.Module):
    """A vocabulary table ``[V, H]`` (the LM head, or the embedding tied to it) in int8 with
    one float32 scale per row. int8 rather than fp8: the head's matmul is weight-only anyway,
    and at the same bytes int8 has half fp8's rounding error on such a table (SmolLM2: 1.2 % vs
    2.6 % relative RMS), which the logits of every token see. The gather dequantizes only the
    rows it takes; as the head (:func:`lm_head_logits`) a row's scale is its logit's scale, so
    a tied table serves both."""

    def __init__(self, num_embeddings: int, features: int, *, dtype, int8_compute=False):
        self.weight = nnx.Param(jnp.zeros((num_embeddings, features), jnp.int8))
        self.weight_scale = nnx.Param(jnp.ones((num_embeddings,), jnp.float32))
        self.dtype_name = jnp.dtype(dtype).name  # static: the serving dtype of the output
        self.int8_compute = int8_compute  # static: the head runs W8A8 (quantization int8)

    def __call__(self, ids):
        rows = jnp.take(self.weight[...], ids, axis=0).astype(jnp.float32)
        scale = jnp.take(self.weight_scale[...], ids, axis=0)
        return (rows * scale[..., None]).astype(self.dtype_name)


def lm_head_logits(head, hidden):
    """``[N, H]`` hidden states -> ``[N, V]`` float32 logits through the LM head's (or tied
    embedding's) ``weight [V, H]``. An int8 table is upcast to the activation dtype inside the
    matmul (exactly: |q| <= 127; weight-only on every backend, so the logits keep the full
    activation precision) and each logit takes its row's scale."""
    w = head.weight[...]
    scale = getattr(head, "weight_scale", None)
    if scale is None:
        return _dot(hidden.astype(w.dtype), w)
    if getattr(head, "int8_compute", False):
        return int8_dynamic_matmul(hidden.astype(jnp.float32), w, scale[...])
    return _dot(hidden, w.astype(hidden.dtype)) * scale[...]


# ----------------------------------------------------------------------------- LoRA

def project(linear, x, lora: LayerLoRA | None, module: str):
    """``linear(x)`` plus each row's adapter delta when ``module`` is adapted."""
    return _add_delta(linear(x), x, lora, module)


def project_many(linears, x, lora: LayerLoRA | None, modules):
    """``project`` of one input through several projections (q/k/v, gate/up). int8 (W8A8)
    projections share one matmul call that quantizes ``x`` once
    (:func:`int8_dynamic_matmuls`)."""
    if len(linears) > 1 and all(hasattr(m, "int8_operands") for m in linears):
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
