"""New weights for a running engine: any source -> the runner's param leaves, checked in full.

A source is a pytree of arrays (an ``nnx.State`` or module, a flat dict keyed by HF names, a
nested dict) or a path (an HF safetensors directory or one ``.safetensors`` file, an orbax
directory from ``convert_to_orbax``). Names are the model's state paths, which are the HF names.
An array with the leaf's shape, dtype and sharding is used as it is (no copy: a JAX trainer's own
params); anything else is cast and placed once. Quantized leaves (fp8 / int8 ``weight`` with a
``weight_scale``) are re-quantized on the device from a float ``weight``; int4 formats take
their packed tensors only. Every leaf is prepared before the first is swapped, so a bad source
(missing or unexpected name, wrong shape or dtype) raises ``ValueError`` naming the tensor and
the engine keeps its weights.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models import kv_scales
from jaxserve.models import quantization as quant_lib

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_SCALED = re.compile(r"^(.*)\.weight$")


def state_names(state) -> list[str]:
    """Dotted state paths of an ``nnx.State`` in leaf order (``jax.tree_util`` flatten order)."""
    return [_path_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]]


def _path_name(path) -> str:
    parts = []
    for p in path:
        if isinstance(p, jax.tree_util.DictKey):
            parts.append(str(p.key))
        elif isinstance(p, jax.tree_util.SequenceKey):
            parts.append(str(p.idx))
        elif isinstance(p, jax.tree_util.GetAttrKey):
            parts.append(str(p.name))
    return ".".join(x for x in parts if x != "value")


def flat_source(weights) -> Mapping[str, object]:
    """name -> array (jax or numpy) or a zero-argument loader of one."""
    if isinstance(weights, (str, Path)):
        return path_source(Path(weights).expanduser())
    if isinstance(weights, nnx.Module):
        weights = nnx.state(weights)
    if isinstance(weights, nnx.State):
        return {".".join(map(str, p)): v.get_value() if isinstance(v, nnx.Variable) else v
                for p, v in nnx.to_flat_state(weights)}
    if isinstance(weights, Mapping):
        out: dict[str, object] = {}
        _flatten(weights, "", out)
        return out
    raise ValueError(f"weights: expected a dict of arrays, an nnx State or Module, or a path, "
                     f"got {type(weights).__name__}")


def _flatten(d: Mapping, prefix: str, out: dict) -> None:
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping) or isinstance(v, nnx.State):
            _flatten(dict(v), name + ".", out)
        elif isinstance(v, nnx.Variable):
            out[name] = v.get_value()
        else:
            out[name] = v


def path_source(path: Path) -> Mapping[str, object]:
    """Loaders of a safetensors directory or file, or the arrays of an orbax directory."""
    from jaxserve.loaders import model_loader

    if not path.exists():
        raise ValueError(f"weights: {str(path)!r} does not exist")
    if path.is_file():
        if path.suffix != ".safetensors":
            raise ValueError(f"weights: {str(path)!r} is not a .safetensors file")
        from safetensors import safe_open

        with safe_open(str(path), framework="numpy") as f:
            names = list(f.keys())
        return {n: model_loader._lazy_tensor(path, n) for n in names}
    if model_loader._is_orbax_dir(path):
        return _orbax_source(path / model_loader.ORBAX_PARAMS)
    return model_loader.safetensors_tensors(path)


def _orbax_source(path: Path) -> dict:
    import orbax.checkpoint as ocp

    ckpt = ocp.StandardCheckpointer()
    meta = ckpt.metadata(path.resolve())
    meta = dict(getattr(meta, "item_metadata", meta))
    restored = ckpt.restore(path.resolve(), {
        n: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype) for n, m in meta.items()})
    return dict(restored)


def _shape_dtype(x) -> tuple[tuple, np.dtype]:
    return tuple(x.shape), np.dtype(x.dtype)


def _value(x):
    return x() if callable(x) and not hasattr(x, "shape") else x


def prepare_leaves(names: list[str], current: list, source: Mapping[str, object], *,
                   model_cls=None, model_config=None) -> list:
    """The new leaf for every name, in order, each with its current leaf's shape, dtype and
    sharding (``current``: arrays, or ``jax.ShapeDtypeStruct`` with a sharding while asleep).
    Raises ValueError naming the tensor before anything is placed when names or shapes are
    wrong."""
    target = dict(zip(names, current))
    src = {n: v for n, v in source.items()
           if not n.endswith(_IGNORED_SUFFIXES) and not kv_scales.is_scale_tensor(n)}
    tied = model_config is not None and model_config.tie_word_embeddings
    if tied and "lm_head.weight" not in target:
        src.pop("lm_head.weight", None)  # an HF state of a tied model may carry the head
    if set(src) != set(target) and model_cls is not None and model_config is not None:
        # checkpoint names (fused or per-expert tensors) -> the family's state paths
        loaders = {n: (v if callable(v) and not hasattr(v, "shape") else (lambda v=v: v))
                   for n, v in src.items()}
        mapped = model_cls.checkpoint_tensors(model_config, loaders)
        if set(mapped) != set(src):
            src = dict(mapped)
    quantized = _quantized_prefixes(target)
    for prefix in quantized:  # a float weight for a quantized layer: re-quantized below
        if f"{prefix}.weight" in src and f"{prefix}.weight_scale" not in src:
            src[f"{prefix}.weight_scale"] = None
    missing = sorted(set(target) - set(src))
    if missing:
        raise ValueError(f"weights: missing tensor {missing[0]!r}"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    unexpected = sorted(set(src) - set(target))
    if unexpected:
        raise ValueError(f"weights: unexpected tensor {unexpected[0]!r}"
                         + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
    for name in names:  # shapes and dtypes of what is known without reading
        v = src[name]
        if v is not None and hasattr(v, "shape"):
            prefix = name[:-len(".weight")]
            _check(name, v, target[name],
                   prefix in quantized and src[f"{prefix}.weight_scale"] is None)
    out = {}
    for name in names:
        if name in out:
            continue
        prefix = name[:-len(".weight")] if name.endswith(".weight") else None
        if prefix in quantized and src[f"{prefix}.weight_scale"] is None:
            out[name], out[f"{prefix}.weight_scale"] = _requantize(
                name, _value(src[name]), target[name], target[f"{prefix}.weight_scale"])
            continue
        v = _value(src[name])
        _check(name, v, target[name], False)
        out[name] = place(v, target[name])
    return [out[n] for n in names]


def _quantized_prefixes(target: Mapping) -> set[str]:
    """Layers whose ``weight`` is fp8 or int8 with a per-row ``weight_scale``."""
    out = set()
    for name, t in target.items():
        m = _SCALED.match(name)
        if m and f"{m.group(1)}.weight_scale" in target and np.dtype(t.dtype) in (
                np.dtype(quant_lib.FP8), np.dtype(np.int8)):
            out.add(m.group(1))
    return out


def _check(name: str, v, t, float_for_quantized: bool) -> None:
    shape, dtype = _shape_dtype(v)
    want_shape, want = _shape_dtype(t)
    if shape != want_shape:
        raise ValueError(f"weights: tensor {name!r} has shape {shape}, expected {want_shape}")
    if dtype == want:
        return
    if float_for_quantized and jnp.issubdtype(dtype, jnp.floating):
        return  # a float weight for an fp8 / int8 layer: quantized on update
    if jnp.issubdtype(dtype, jnp.floating) and jnp.issubdtype(want, jnp.floating) and \
            want not in (np.dtype(quant_lib.FP8),):
        return  # float -> float: cast once
    raise ValueError(f"weights: tensor {name!r} has dtype {dtype}, expected {want}")


def place(v, t):
    """``v`` with ``t``'s dtype and sharding; ``v`` itself when it already has them, its own
    buffers under ``t``'s sharding object when its sharding is equivalent (a 1-device mesh
    names its axes in any order), else one cast and one placement."""
    sharding = t.sharding
    if isinstance(v, jax.Array):
        if v.dtype == t.dtype and v.sharding == sharding:
            return v
        if v.dtype == t.dtype and v.sharding.is_equivalent_to(sharding, v.ndim):
            return jax.device_put(v, sharding)  # the same buffers: no copy
        if v.dtype != t.dtype:
            v = v.astype(t.dtype)
        return jax.device_put(v, sharding)
    return jax.device_put(np.asarray(v).astype(t.dtype, copy=False), sharding)


def _requantize(name: str, w, t_weight, t_scale):
    """fp8 / int8 per-row quantization of a float weight, on the device, placed like the
    engine's quantized leaves (the same rule as at load)."""
    shape, dtype = _shape_dtype(w)
    if shape != tuple(t_weight.shape):
        raise ValueError(f"weights: tensor {name!r} has shape {shape}, "
                         f"expected {tuple(t_weight.shape)}")
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"weights: tensor {name!r} has dtype {dtype}; a quantized layer takes "
                         f"a float weight (quantized on update) or {t_weight.dtype} with its "
                         "weight_scale")
    w = w if isinstance(w, jax.Array) else jnp.asarray(np.asarray(w, np.float32))
    fn = quant_lib._fp8_rows if np.dtype(t_weight.dtype) == np.dtype(quant_lib.FP8) \
        else quant_lib._int8_rows
    q, s = fn(w)
    return place(q, t_weight), place(s, t_scale)


def abstract_leaves(leaves: list) -> list:
    """Shape, dtype and sharding of each leaf (what a sleeping engine keeps of its weights)."""
    return [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in leaves]


def describe_source(weights) -> str | None:
    """The path a source was read from (what a level-2 wake reloads), or None for arrays."""
    if isinstance(weights, (str, Path)):
        return str(Path(weights).expanduser())
    return None

