"""PEFT LoRA adapters (``adapter_config.json`` + ``adapter_model.safetensors``) -> host arrays.

An adapter is read once on the host and checked against the base model before anything reaches
the device: its rank against ``max_lora_rank``, each target against the model's projections,
each tensor's shape against the projection it adapts. A fused target (``qkv_proj``,
``gate_up_proj``) is split into the model's own projections: the same A for each part, B's
rows cut at the parts' output sizes. Every failure is a ``LoRAAdapterError`` that names the
adapter and the reason (400 from the server, a start-up error for ``--lora-modules``).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxserve.errors import InvalidRequestError

# the projections an adapter may target, by their name in the model (HF's)
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# fused checkpoint names -> the model's projections, in row order
FUSED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                 "gate_up_proj": ("gate_proj", "up_proj")}
_PREFIX = "base_model.model."


class LoRAAdapterError(InvalidRequestError):
    """An adapter that cannot be served over this model."""

    def __init__(self, name: str, reason: str, status_code: int = 400):
        super().__init__(f"LoRA adapter {name!r}: {reason}", param="lora_request",
                         status_code=status_code)
        self.adapter = name
        self.reason = reason

    def __reduce__(self):  # crosses the core process' pipe whole
        return type(self), (self.adapter, self.reason, self.status_code)


@dataclass
class LoRATargets:
    """The projections of a model that adapters may adapt: state path (``model.layers.0
    .self_attn.q_proj``) -> (in, out) features. Laid out for the device once from this."""

    shapes: dict[str, tuple[int, int]]
    specs: dict = None  # path -> the weight's PartitionSpec under tensor parallelism

    def modules(self) -> set[str]:
        return {p.rsplit(".", 1)[1] for p in self.shapes}


@dataclass
class LoRAAdapter:
    """One adapter on the host: ``weights[path] = (A [in, r], B [r, out])`` float32, and the
    scale ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA) applied to ``x @ A @ B``."""

    name: str
    rank: int
    scale: float
    weights: dict[str, tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def lora_targets(model) -> LoRATargets:
    """The adaptable projections of an NNX model, found by state path (``...<module>.weight``
    of an ``[out, in]`` linear)."""
    from flax import nnx

    shapes, specs = {}, {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        names = [str(getattr(p, "key", p)) for p in path]
        if len(names) >= 2 and names[-1] == "weight" and names[-2] in LORA_MODULES:
            value = var[...]
            if value.ndim == 2:
                key = ".".join(names[:-1])
                shapes[key] = (int(value.shape[1]), int(value.shape[0]))
                specs[key] = getattr(getattr(value, "sharding", None), "spec", None)
    return LoRATargets(shapes, specs)


def _read_config(name: str, path: Path) -> dict:
    cfg_file = path / "adapter_config.json"
    if not path.is_dir():
        raise LoRAAdapterError(name, f"{str(path)!r} is not a directory")
    if not cfg_file.exists():
        raise LoRAAdapterError(name, f"{str(path)!r} has no adapter_config.json")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise LoRAAdapterError(name, f"adapter_config.json is not JSON: {e}") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(name, f"peft_type {cfg.get('peft_type')!r} is not LORA")
    unsupported = [("use_dora", bool(cfg.get("use_dora"))),
                   ("bias", cfg.get("bias", "none") not in (None, "none")),
                   ("modules_to_save", bool(cfg.get("modules_to_save"))),
                   ("rank_pattern", bool(cfg.get("rank_pattern"))),
                   ("alpha_pattern", bool(cfg.get("alpha_pattern"))),
                   ("fan_in_fan_out", bool(cfg.get("fan_in_fan_out")))]
    for key, bad in unsupported:
        if bad:
            raise LoRAAdapterError(name, f"{key}={cfg.get(key)!r} is not supported")
    return cfg


def _check_target_names(name: str, cfg: dict, targets: LoRATargets) -> None:
    """Every module the config names must be one the model has (a regex is matched against
    the model's projections only through the tensors)."""
    tm = cfg.get("target_modules")
    if isinstance(tm, (list, tuple)):
        have = targets.modules() | {f for f, parts in FUSED_MODULES.items()
                                    if set(parts) <= targets.modules()}
        for m in tm:
            if m.rsplit(".", 1)[-1] not in have:
                raise LoRAAdapterError(
                    name, f"target module {m!r} is not a projection of this model "
                          f"(supported: {', '.join(sorted(have))})")


def load_peft_adapter(name: str, path: str, targets: LoRATargets, max_rank: int
                      ) -> LoRAAdapter:
    """Read and check an adapter directory against the model's ``targets``."""
    from jaxserve.loaders.model_loader import _lazy_tensor

    path = Path(str(path)).expanduser()
    cfg = _read_config(name, path)
    r = cfg.get("r")
    if not isinstance(r, int) or r < 1:
        raise LoRAAdapterError(name, f"r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise LoRAAdapterError(name, f"rank {r} exceeds max_lora_rank {max_rank} "
                                     "(raise --max-lora-rank)")
    _check_target_names(name, cfg, targets)
    alpha = float(cfg.get("lora_alpha", 8))
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    files = [p for p in (path / "adapter_model.safetensors",) if p.exists()]
    if not files:
        raise LoRAAdapterError(name, f"{str(path)!r} has no adapter_model.safetensors")
    from safetensors import safe_open

    with safe_open(str(files[0]), framework="numpy") as f:
        keys = list(f.keys())
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key in keys:
        m = re.fullmatch(r"(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key)
        if m is None:
            raise LoRAAdapterError(name, f"tensor {key!r} is not a LoRA A/B weight")
        module = m.group(1)
        module = module[len(_PREFIX):] if module.startswith(_PREFIX) else module
        pairs.setdefault(module, {})[m.group(2)] = np.asarray(
            _lazy_tensor(files[0], key)(), np.float32)
    weights: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(name, f"{module}: needs both lora_A and lora_B")
        a, b = ab["A"].T, ab["B"].T  # PEFT: A [r, in], B [out, r] -> A [in, r], B [r, out]
        parent, leaf = module.rsplit(".", 1) if "." in module else ("", module)
        parts = FUSED_MODULES.get(leaf, (leaf,))
        paths = [f"{parent}.{p}" if parent else p for p in parts]
        missing = [p for p in paths if p not in targets.shapes]
        if missing:
            raise LoRAAdapterError(name, f"target module {module!r} is not a projection of this "
                                         f"model (supported: {', '.join(LORA_MODULES)})")
        d_in = targets.shapes[paths[0]][0]
        outs = [targets.shapes[p][1] for p in paths]
        if a.shape[1] != r or b.shape[0] != r:
            raise LoRAAdapterError(name, f"{module}: rank {a.shape[1]}/{b.shape[0]} differs "
                                         f"from r={r}")
        if a.shape[0] != d_in or b.shape[1] != sum(outs):
            raise LoRAAdapterError(
                name, f"{module}: shape mismatch with the base model (adapter in={a.shape[0]}, "
                      f"out={b.shape[1]}; model in={d_in}, out={sum(outs)}): an adapter of "
                      "another base model?")
        start = 0
        for p, n in zip(paths, outs):
            weights[p] = (np.ascontiguousarray(a), np.ascontiguousarray(b[:, start:start + n]))
            start += n
    if not weights:
        raise LoRAAdapterError(name, "adapter_model.safetensors holds no LoRA weights")
    return LoRAAdapter(name, r, scale, weights)
