"""K/V scales of a float8 KV cache: where they live on a model and how checkpoints name them.

A float8 page holds ``k / k_scale`` (``v / v_scale``); attention multiplies the scores by
``k_scale`` and its output by ``v_scale`` (``pallas_kernels/reference.py``). The scales are
per layer and per KV head, float32, and they are *static* on each attention module
(``attn.kv_scale``, a tuple ``((k_scale, v_scale),) * Hkv``): they are fixed before the step
is compiled (checkpoint or ``--calculate-kv-scales``, both before warm-up), so they enter the
step as constants, and a model without scales (or with serving-dtype pages) has no scale op.

Checkpoint names (vLLM's, remapped to the layer's attention):

* ``model.layers.N.self_attn.k_scale`` / ``v_scale`` (also under ``...self_attn.attn.``),
* ModelOpt's ``...self_attn.k_proj.k_scale`` / ``...self_attn.v_proj.v_scale``,
* compressed-tensors' ``...self_attn.k_proj.output_scale`` / ``...v_proj.output_scale``,
* the deprecated ``...self_attn.kv_scale`` (one scale for K and V).

A scale is a scalar (per layer) or has one value per KV head.
"""
from __future__ import annotations

import logging
import re
from typing import Callable, Mapping

import numpy as np

logger = logging.getLogger(__name__)

# name suffix after "model.layers.N.self_attn." -> which scales it sets
_SUFFIXES = {
    "k_scale": "k", "v_scale": "v", "attn.k_scale": "k", "attn.v_scale": "v",
    "k_proj.k_scale": "k", "v_proj.v_scale": "v",
    "k_proj.output_scale": "k", "v_proj.output_scale": "v",
    "kv_scale": "kv",
}
_NAME = re.compile(r"^(?:model\.)?layers\.(\d+)\.self_attn\.(.+)$")


def attention_modules(model) -> list:
    """Each cache layer's attention module, in layer order (an MTP head's layer last)."""
    # a layer without attention (Gated DeltaNet) holds an unused scale of its own, so the
    # scales stay indexed by layer
    layers = list(model.model.layers)
    if getattr(model, "mtp", None) is not None:
        layers += list(model.mtp.layers)
    return [layer.self_attn if getattr(layer, "self_attn", None) is not None
            else layer.linear_attn for layer in layers]


def set_kv_scales(model, scales: np.ndarray | None) -> None:
    """Put ``scales`` (``[L, Hkv, 2]`` float32: K then V) on every layer; None: no scales."""
    mods = attention_modules(model)
    if scales is None:
        for m in mods:
            m.kv_scale = None
        return
    scales = np.asarray(scales, np.float32)
    if getattr(model, "mtp", None) is not None and scales.ndim == 3 and \
            scales.shape[0] == len(mods) - 1:  # the model's layers only: the head's 1.0
        scales = np.concatenate([scales, np.ones((1,) + scales.shape[1:], np.float32)])
    if scales.ndim != 3 or scales.shape[0] != len(mods) or scales.shape[2] != 2:
        raise ValueError(f"kv scales must be [num_layers={len(mods)}, num_kv_heads, 2], "
                         f"got {scales.shape}")
    if not np.all(np.isfinite(scales)) or np.any(scales <= 0):
        raise ValueError("kv scales must be finite and > 0")
    for m, s in zip(mods, scales):
        m.kv_scale = tuple((float(k), float(v)) for k, v in s)


def get_kv_scales(model) -> np.ndarray | None:
    """``[L, Hkv, 2]`` scales on the model, or None when no layer has any."""
    mods = attention_modules(model)
    if all(m.kv_scale is None for m in mods):
        return None
    return np.stack([np.asarray(m.kv_scale if m.kv_scale is not None else
                                ((1.0, 1.0),) * m.num_kv_heads, np.float32) for m in mods])


def is_scale_tensor(name: str) -> bool:
    m = _NAME.match(name)
    return m is not None and m.group(2) in _SUFFIXES


def checkpoint_kv_scales(tensors: Mapping[str, Callable[[], np.ndarray]], num_layers: int,
                         num_kv_heads: int) -> np.ndarray | None:
    """``[L, Hkv, 2]`` scales from a checkpoint's scale tensors (1.0 where a layer has none),
    or None when it has none at all."""
    scales = np.ones((num_layers, num_kv_heads, 2), np.float32)
    found = False
    for name, load in tensors.items():
        m = _NAME.match(name)
        if m is None or m.group(2) not in _SUFFIXES:
            continue
        layer, which = int(m.group(1)), _SUFFIXES[m.group(2)]
        if layer >= num_layers:
            raise ValueError(f"checkpoint tensor {name!r}: the model has {num_layers} layers")
        value = np.asarray(load(), np.float32).reshape(-1)
        if value.size not in (1, num_kv_heads):
            raise ValueError(f"checkpoint tensor {name!r} has {value.size} values; a KV scale "
                             f"is one per layer or one per KV head ({num_kv_heads})")
        cols = {"k": [0], "v": [1], "kv": [0, 1]}[which]
        for c in cols:
            scales[layer, :, c] = value
        found = True
    return scales if found else None


def describe(scales: np.ndarray) -> str:
    """One log line's worth: the range of the K and V scales."""
    k, v = scales[..., 0], scales[..., 1]
    return (f"k_scale {k.min():.4g}..{k.max():.4g}, v_scale {v.min():.4g}..{v.max():.4g} "
            f"({scales.shape[0]} layers x {scales.shape[1]} KV heads)")
