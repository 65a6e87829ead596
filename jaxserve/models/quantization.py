"""Quantized linear layers (fp8, AWQ/GPTQ int4) and the checkpoint conversions that fill them.

A quantized model is the family's ordinary model with its projection ``Linear`` modules
(``*_proj``) swapped for a quantized module before loading (:func:`quantize_linears`); norms and
MoE routers keep the serving dtype, and so do the LM head and embeddings unless the plan asks
for the head (``lm_head_quantized``, with fp8 only, vLLM's name): the head's table (an untied
``lm_head``, or the embedding tied to it, quantized once for both uses) becomes an
:class:`Int8Table`. Every quantized tensor is an ordinary ``nnx.Param`` of its layer module,
so the state tree (and anything that stacks or shards it) sees plain leaves.

Layouts in memory (HF ``[out, in]`` orientation, so tensor-parallel specs follow the weight's):

* fp8: ``weight [out, in]`` float8_e4m3fn and ``weight_scale [out]`` float32 (per output
  channel); ``W = weight * weight_scale[:, None]``.
* the LM head's table ``[V, H]``: ``weight`` int8 and ``weight_scale [V]`` float32, one scale
  per vocabulary entry, which is the head's output channel and the embedding's row.
* int4 / int8 groups (AWQ, GPTQ, GGUF Q4_0/Q4_1/Q8_0): ``qweight [out, in/2]`` uint8 (two
  4-bit values a byte, low nibble first) or ``[out, in]`` uint8 for 8 bits, ``scales [out, G]``
  serving dtype and ``zeros [out, G]`` zero points (uint8; float32 for GGUF Q4_1, whose
  minimum is not a whole number of steps), one per group of ``in/G`` consecutive input
  channels; ``W = (q - zeros) * scales``. GPTQ with act-order (``desc_act``) has its input
  channels reordered at load so groups are contiguous, and keeps the order in ``perm [in]``
  (activations are gathered by it before the matmul).

The matmul dequantizes inside the jitted step (one XLA fusion feeding the dot). On Hopper
(H100/H200) fp8 layers instead run fp8 x fp8 with per-token dynamic activation scales.
"""
from __future__ import annotations

import functools
import re
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from jaxserve.config import QUANTIZATION_METHODS
from jaxserve.models.linear import (FP8, FP8_MAX, Fp8Linear, Int4Linear, Int8Linear, Int8Table,
                                    Linear)

# AWQ packs eight 4-bit values into an int32 in this column order (nibble i holds column
# AWQ_ORDER[i] of each group of eight); GPTQ packs them in plain order.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def validate_method(quantization: str | None) -> str | None:
    if quantization is None:
        return None
    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization {quantization!r} is not one of "
                         f"{', '.join(QUANTIZATION_METHODS)} (or None)")
    return quantization


def fp8_compute_supported(device=None) -> bool:
    """fp8 tensor-core matmuls: Hopper (H100/H200)."""
    kind = (device or jax.devices()[0]).device_kind
    return any(k in kind for k in ("H100", "H200"))



# ----------------------------------------------------------------------------- the plan

class QuantPlan:
    """What to quantize and how: the method, whether the checkpoint already holds the
    quantized tensors, and the format's parameters (group size, act order, ...)."""

    def __init__(self, method: str, *, prequantized: bool, group_size: int = 128,
                 act_order: bool = False, gptq_v1_zeros: bool = True, fp8_compute: bool = False,
                 layer_formats: Mapping[str, str] | None = None, lm_head: bool = False):
        self.method, self.prequantized = method, prequantized
        self.lm_head = lm_head  # fp8: the LM head (a tied embedding with it) quantized too
        # gguf: weight name -> its GGUF type, for the layers kept quantized
        self.layer_formats = dict(layer_formats or {})
        self.group_size, self.act_order = group_size, act_order
        self.gptq_v1_zeros, self.fp8_compute = gptq_v1_zeros, fp8_compute

    def __repr__(self):
        return f"QuantPlan({self.method}, prequantized={self.prequantized})"


def validate_lm_head_quantized(lm_head_quantized) -> bool:
    if not isinstance(lm_head_quantized, bool):
        raise ValueError(f"lm_head_quantized must be true or false, got {lm_head_quantized!r}")
    return lm_head_quantized


def plan_from_config(quantization: str | None, hf_config: Mapping,
                     lm_head_quantized: bool = False) -> QuantPlan | None:
    """The plan for ``--quantization`` (``--lm-head-quantized``) and the checkpoint's
    ``quantization_config``.

    No flag: the checkpoint's own method (as vLLM). fp8 on an unquantized checkpoint quantizes
    at load; awq/gptq need a checkpoint in that format. ``lm_head_quantized`` (fp8 only): the
    LM head too, made int8 per vocabulary row at load (:class:`Int8Table`)."""
    method = validate_method(quantization)
    lm_head = validate_lm_head_quantized(lm_head_quantized)
    qc = dict(hf_config.get("quantization_config") or {})
    ckpt = qc.get("quant_method")
    if ckpt == "compressed-tensors":
        ckpt = _compressed_tensors_method(qc)
    if ckpt is not None and ckpt not in QUANTIZATION_METHODS:
        raise ValueError(f"the checkpoint's quantization_config quant_method {ckpt!r} is not "
                         f"supported (supported: {', '.join(QUANTIZATION_METHODS)})")
    if method is None:
        method = ckpt
    if lm_head and method not in ("fp8", "int8"):
        raise ValueError(f"lm_head_quantized needs quantization 'fp8' or 'int8' (got {method!r})")
    if method is None:
        return None
    if method == "gguf":
        raise ValueError("quantization 'gguf' needs a .gguf model file")
    if ckpt is not None and ckpt != method:
        raise ValueError(f"quantization {method!r} does not match the checkpoint's "
                         f"quantization_config ({ckpt!r})")
    if method == "fp8":
        if qc.get("weight_block_size"):
            raise ValueError("quantization fp8 with weight_block_size (block-wise scales) is not "
                             "supported; per-tensor and per-channel scales are")
        return QuantPlan("fp8", prequantized=ckpt is not None,
                         fp8_compute=fp8_compute_supported(), lm_head=lm_head)
    if method == "int8":
        return QuantPlan("int8", prequantized=False, lm_head=lm_head)
    if ckpt is None:
        raise ValueError(f"quantization {method!r} needs a checkpoint in that format "
                         "(its quantization_config); only fp8 and int8 quantize at load")
    if qc.get("lm_head"):
        raise ValueError(f"quantization {method!r}: checkpoints with a quantized LM head "
                         "(quantization_config lm_head: true) are not supported")
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    if bits != 4:
        raise ValueError(f"quantization {method!r} with {bits} bits is not supported (only 4)")
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if method == "awq":
        if qc.get("version", "gemm").lower() != "gemm" or qc.get("zero_point") is False:
            raise ValueError("quantization awq: only the GEMM packing with zero points is "
                             "supported")
        return QuantPlan("awq", prequantized=True, group_size=group)
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"quantization gptq: checkpoint_format {fmt!r} is not supported")
    return QuantPlan("gptq", prequantized=True, group_size=group,
                     act_order=bool(qc.get("desc_act", False)), gptq_v1_zeros=fmt == "gptq")


def _compressed_tensors_method(qc: Mapping) -> str:
    """compressed-tensors ``float-quantized`` with 8-bit float weights is fp8."""
    fmt = qc.get("format")
    groups = list((qc.get("config_groups") or {}).values())
    weights = [g.get("weights") or {} for g in groups]
    if fmt == "float-quantized" and weights and all(
            w.get("num_bits") == 8 and w.get("type") == "float"
            and w.get("strategy") in ("tensor", "channel") for w in weights):
        return "fp8"
    raise ValueError(f"compressed-tensors checkpoint (format {fmt!r}) is not supported: only "
                     "float-quantized 8-bit weights with tensor or channel scales")


def _is_projection(name: str) -> bool:
    return name.endswith("_proj")


def quantize_linears(model, plan: QuantPlan | None, dtype):
    """Swap the projection ``Linear`` modules of an (abstract) model for quantized ones."""
    if plan is None:
        return model
    targets = [(path, m) for path, m in nnx.iter_modules(model)
               if isinstance(m, Linear) and path and _is_projection(str(path[-1]))]
    makers = []  # (path, constructor of the quantized module)
    for path, lin in targets:
        out_f, in_f = lin.weight.get_value().shape
        kw = dict(bias=lin.bias is not None, dtype=dtype)
        if plan.method == "int8":
            make = functools.partial(Int8Linear, in_f, out_f, **kw)
        elif plan.method == "fp8":
            make = functools.partial(Fp8Linear, in_f, out_f, fp8_compute=plan.fp8_compute,
                                     **kw)
        elif plan.method == "gguf":
            fmt = plan.layer_formats.get(".".join(map(str, path)) + ".weight")
            if fmt is None:
                continue  # a GGUF type kept dequantized (K-quants, floats)
            bits, zdt = GGUF_KEPT[fmt]
            make = functools.partial(Int4Linear, in_f, out_f, group_size=32, act_order=False,
                                     bits=bits, zero_dtype=zdt, **kw)
        else:
            group = in_f if plan.group_size == -1 else plan.group_size
            make = functools.partial(Int4Linear, in_f, out_f, group_size=group,
                                     act_order=plan.act_order, **kw)
        makers.append((path, make))
    # every abstract module in one trace (one eval_shape each took ~0.7 s for SmolLM2's 210)
    news = nnx.eval_shape(lambda: [make() for _, make in makers]) if makers else []
    for (path, _), new in zip(makers, news):
        _replace(model, path, new)
    if plan.lm_head:
        parent, name, head = lm_head_module(model)
        rows, cols = head.weight.get_value().shape
        setattr(parent, name, nnx.eval_shape(lambda: Int8Table(
            rows, cols, dtype=dtype, int8_compute=plan.method == "int8")))
    return model


def _replace(model, path, new) -> None:
    parent = model
    for p in path[:-1]:
        parent = parent[p] if isinstance(p, int) else getattr(parent, str(p))
    setattr(parent, str(path[-1]), new)


def lm_head_module(model):
    """(parent, attribute, module) of the table the logits use: ``lm_head``, or the embedding
    it is tied to."""
    if not hasattr(model, "lm_head") or not hasattr(getattr(model, "model", None),
                                                    "embed_tokens"):
        raise ValueError(f"lm_head_quantized is not supported for {type(model).__name__}")
    if model.lm_head is not None:
        return model, "lm_head", model.lm_head
    return model.model, "embed_tokens", model.model.embed_tokens


@jax.jit
def _fp8_rows(w):
    wf = w.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(wf), axis=1) / FP8_MAX, 1e-12)
    return jnp.clip(wf / scale[:, None], -FP8_MAX, FP8_MAX).astype(FP8), scale


@jax.jit
def _int8_rows(w):
    wf = w.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(wf), axis=1) / 127.0, 1e-12)
    return jnp.clip(jnp.round(wf / scale[:, None]), -127, 127).astype(jnp.int8), scale


def quantize_model_fp8(model, plan: QuantPlan):
    """fp8 on device for a model already holding float weights (random ``dummy`` weights):
    each projection ``Linear`` becomes an :class:`Fp8Linear` with the same sharding layout."""
    targets = [(path, m) for path, m in nnx.iter_modules(model)
               if isinstance(m, Linear) and path and _is_projection(str(path[-1]))]
    for path, lin in targets:
        w = lin.weight.get_value()
        new = nnx.eval_shape(lambda: Fp8Linear(w.shape[1], w.shape[0], bias=lin.bias is not None,
                                               dtype=w.dtype, fp8_compute=plan.fp8_compute))
        q, scale = _fp8_rows(w)
        new.weight.set_value(q)
        new.weight_scale.set_value(scale)
        if lin.bias is not None:
            new.bias.set_value(lin.bias.get_value())
        _replace(model, path, new)
    if plan.lm_head:
        parent, name, head = lm_head_module(model)
        w = head.weight.get_value()
        new = nnx.eval_shape(lambda: Int8Table(w.shape[0], w.shape[1], dtype=w.dtype))
        q, scale = _int8_rows(w)
        new.weight.set_value(q)
        new.weight_scale.set_value(scale)
        setattr(parent, name, new)
    return model


# ----------------------------------------------------------------------------- tensor sharding

_QUANT_LEAF = re.compile(r"^(.*)\.(weight_scale|qweight|scales|zeros|perm)$")


def partition_spec(name: str, spec_of: Callable[[str], PartitionSpec]) -> PartitionSpec | None:
    """The spec of a quantized tensor, derived from its layer's ``weight`` spec (None: not a
    quantized tensor). Per-output scales follow the weight's row split; ``[out, *]`` tensors
    follow the weight's spec (rows, or input columns/groups)."""
    m = _QUANT_LEAF.match(name)
    if m is None:
        return None
    prefix, leaf = m.groups()
    w = tuple(spec_of(prefix + ".weight")) + (None, None)
    if leaf == "weight_scale":
        return PartitionSpec(w[0])
    if leaf == "perm":
        return PartitionSpec()
    return PartitionSpec(w[0], w[1])


# ----------------------------------------------------------------------------- checkpoints

def quantize_fp8_per_channel(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``w [out, in]`` -> (float8_e4m3fn weight, float32 per-row scale), RTN with saturation."""
    w = np.asarray(w, np.float32)
    scale = np.maximum(np.abs(w).max(axis=1) / FP8_MAX, np.float32(1e-12)).astype(np.float32)
    q = np.clip(w / scale[:, None], -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def quantize_int8_per_row(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``w [rows, cols]`` -> (int8 table, float32 per-row scale), symmetric round to nearest."""
    w = np.asarray(w, np.float32)
    scale = np.maximum(np.abs(w).max(axis=1) / 127.0, np.float32(1e-12)).astype(np.float32)
    q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
    return q, scale


def unpack_int32(packed: np.ndarray, axis: int, order=None) -> np.ndarray:
    """Eight 4-bit values per int32 along ``axis`` (nibble ``i`` -> position ``order[i]`` of
    its group of eight; plain order when None) -> uint8 array 8x longer on that axis."""
    p = np.moveaxis(np.asarray(packed).view(np.uint32), axis, -1)
    nib = np.stack([(p >> (4 * i)) & 0xF for i in range(8)], axis=-1).astype(np.uint8)
    if order is not None:
        out = np.empty_like(nib)
        out[..., list(order)] = nib
        nib = out
    return np.moveaxis(nib.reshape(*p.shape[:-1], p.shape[-1] * 8), -1, axis)


def pack_int32(q: np.ndarray, axis: int, order=None) -> np.ndarray:
    """The inverse of :func:`unpack_int32`: 4-bit values -> int32 words along ``axis``."""
    q = np.moveaxis(np.asarray(q, np.uint32), axis, -1)
    q = q.reshape(*q.shape[:-1], q.shape[-1] // 8, 8)
    if order is not None:
        q = q[..., list(order)]
    word = np.zeros(q.shape[:-1], np.uint32)
    for i in range(8):
        word |= (q[..., i] & 0xF) << np.uint32(4 * i)
    return np.ascontiguousarray(np.moveaxis(word.view(np.int32), -1, axis))


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """``q [out, in]`` 4-bit values -> ``[out, in/2]`` uint8, low nibble first."""
    q = np.asarray(q, np.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)


def _int4_from_awq(t: dict, plan: QuantPlan) -> dict:
    q = unpack_int32(t["qweight"], 1, AWQ_ORDER).T  # [in, out] -> [out, in]
    z = unpack_int32(t["qzeros"], 1, AWQ_ORDER).T  # [G, out] -> [out, G]
    return {"qweight": pack_nibbles(q), "zeros": z, "scales": np.asarray(t["scales"]).T}


def _int4_from_gptq(t: dict, plan: QuantPlan) -> dict:
    q = unpack_int32(t["qweight"], 0).T  # [in, out] -> [out, in]
    z = unpack_int32(t["qzeros"], 1).T.astype(np.int32)  # [G, out] -> [out, G]
    if plan.gptq_v1_zeros:
        z = (z + 1) & 0xF  # GPTQ v1 stores zero - 1 in 4 bits
    scales = np.asarray(t["scales"]).T  # [out, G]
    n_in, groups = q.shape[1], scales.shape[1]
    size = plan.group_size if plan.group_size != -1 else n_in
    if -(-n_in // size) != groups:
        raise ValueError(f"gptq scales have {groups} groups for {n_in} input channels in groups "
                         f"of {size}")
    g_idx = np.asarray(t["g_idx"]).astype(np.int64) if "g_idx" in t else np.arange(n_in) // size
    out = {"zeros": z.astype(np.uint8), "scales": scales}
    if plan.act_order:
        perm = np.argsort(g_idx, kind="stable")
        if not np.array_equal(g_idx[perm], np.arange(n_in) // size):
            raise ValueError("gptq g_idx does not put group_size channels in each group")
        out["perm"] = perm.astype(np.int32)
        q = q[:, perm]
    elif not np.array_equal(g_idx, np.arange(n_in) // size):
        raise ValueError("gptq g_idx is not in order but desc_act is false")
    out["qweight"] = pack_nibbles(q)
    return out


# GGUF types kept quantized: (bits, zero-point dtype); blocks of 32 along the input dimension.
GGUF_KEPT = {"Q4_0": (4, jnp.uint8), "Q4_1": (4, jnp.float32), "Q8_0": (8, jnp.uint8)}
_GGUF_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def decode_gguf_blocks(raw: np.ndarray, fmt: str) -> dict:
    """ggml blocks ``raw [rows, bytes]`` -> ``qweight``/``scales``/``zeros`` (our layout).

    Q4_0: f16 d, 16 bytes of nibbles, x = (q - 8) d; Q4_1: f16 d, f16 m, x = q d + m;
    Q8_0: f16 d, 32 int8, x = q d (stored as q + 128 with zero point 128). In a 4-bit block
    byte j holds element j (low nibble) and element j + 16 (high nibble)."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, _GGUF_BLOCK_BYTES[fmt])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if fmt == "Q8_0":
        q = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return {"qweight": q.reshape(rows, -1), "scales": d,
                "zeros": np.full(d.shape, 128, np.uint8)}
    qs = blocks[..., 4:] if fmt == "Q4_1" else blocks[..., 2:]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(rows, -1)  # element order
    out = {"qweight": pack_nibbles(q), "scales": d}
    if fmt == "Q4_0":
        out["zeros"] = np.full(d.shape, 8, np.uint8)
    else:  # x = (q - z) d with z = -m / d; a flat block (d = 0) gets a tiny step instead
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        tiny = np.float32(2.0 ** -100)
        d = np.where(d == 0, tiny, d)
        out["scales"], out["zeros"] = d, (-m / d).astype(np.float32)
    return out


def _from_gguf(t: dict, plan: QuantPlan) -> dict:
    fmt, raw = t["weight"]
    return decode_gguf_blocks(raw, fmt)


def _fp8_from_checkpoint(t: dict, plan: QuantPlan) -> dict:
    w = np.asarray(t["weight"])
    if not plan.prequantized:
        q, s = quantize_fp8_per_channel(w)
        return {"weight": q, "weight_scale": s}
    if w.dtype != ml_dtypes.float8_e4m3fn:
        raise ValueError(f"fp8 checkpoint weight has dtype {w.dtype}, expected float8_e4m3fn")
    if "weight_scale" not in t:
        raise ValueError("fp8 checkpoint lacks weight_scale")
    s = np.asarray(t["weight_scale"], np.float32).reshape(-1)
    if s.size not in (1, w.shape[0]):
        raise ValueError(f"fp8 weight_scale has {s.size} values for {w.shape[0]} rows "
                         "(per-tensor or per-channel expected)")
    return {"weight": w, "weight_scale": np.broadcast_to(s, (w.shape[0],)).copy()}


def _int8_from_checkpoint(t: dict, plan: QuantPlan) -> dict:
    q, s = quantize_int8_per_row(np.asarray(t["weight"], np.float32))
    return {"weight": q, "weight_scale": s}


def _head_from_checkpoint(t: dict) -> dict:
    """The LM head table (or the embedding tied to it) -> int8 per row, from its float weight
    or from an fp8 one with its ``weight_scale`` (dequantized first)."""
    w = np.asarray(t["weight"])
    if w.dtype == ml_dtypes.float8_e4m3fn:
        if "weight_scale" not in t:
            raise ValueError("fp8 checkpoint LM head lacks weight_scale")
        s = np.asarray(t["weight_scale"], np.float32).reshape(-1)
        w = w.astype(np.float32) * (s[:, None] if s.size > 1 else s)
    q, s = quantize_int8_per_row(w)
    return {"weight": q, "weight_scale": s}


# Checkpoint tensors each layer format reads; `input_scale` (static activation scales) is read
# and ignored: activation scales are always computed per token.
_SOURCES = {
    "fp8": ("weight", "weight_scale", "input_scale"),
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "gguf": ("weight",),
    "int8": ("weight",),
}
# The vocabulary tables a quantized LM head may be: int8 per row, made at load.
_HEAD_PREFIXES = ("lm_head", "model.embed_tokens")
_CONVERT = {"fp8": _fp8_from_checkpoint, "awq": _int4_from_awq, "gptq": _int4_from_gptq,
            "gguf": _from_gguf, "int8": _int8_from_checkpoint}


def checkpoint_tensors(plan: QuantPlan | None, tensors: Mapping[str, Callable],
                       expected: Mapping[str, object]) -> Mapping[str, Callable]:
    """Checkpoint loaders (HF names) -> loaders of the quantized model's params.

    Each quantized layer is converted once (its tensors read together) and cached until the
    next layer's conversion, so the loader's sweep over a layer's params costs one read."""
    if plan is None:
        return tensors
    prefixes = sorted({m.group(1) for n in expected if (m := _QUANT_LEAF.match(n))})
    out = dict(tensors)
    convert = _CONVERT[plan.method]

    @functools.lru_cache(maxsize=1)
    def converted(prefix):
        srcs = {k: tensors[f"{prefix}.{k}"]() for k in _SOURCES[plan.method]
                if f"{prefix}.{k}" in tensors}
        if plan.method in ("fp8", "int8") and prefix in _HEAD_PREFIXES:
            if "weight" not in srcs:
                raise ValueError(f"checkpoint is missing tensor {prefix + '.weight'!r}")
            return _head_from_checkpoint(srcs)
        if plan.method != "fp8" or plan.prequantized:
            missing = [k for k in _SOURCES[plan.method][:2] if k not in srcs]
            if missing:
                raise ValueError(f"checkpoint is missing tensor {prefix + '.' + missing[0]!r} "
                                 f"({plan.method})")
        elif "weight" not in srcs:
            raise ValueError(f"checkpoint is missing tensor {prefix + '.weight'!r}")
        return convert(srcs, plan)

    for prefix in prefixes:
        for k in _SOURCES[plan.method]:
            out.pop(f"{prefix}.{k}", None)
        leaves = [n[len(prefix) + 1:] for n in expected if n.startswith(prefix + ".")
                  and n[len(prefix) + 1:] != "bias"]
        for leaf in leaves:
            out[f"{prefix}.{leaf}"] = functools.partial(lambda p, k: converted(p)[k], prefix, leaf)
    return out
