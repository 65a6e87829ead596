"""PEFT LoRA adapters (``adapter_config.json`` + ``adapter_model.safetensors``) -> host arrays.

An adapter is read once on the host and checked against the base model before anything reaches
the device: its rank against ``max_lora_rank``, each target against the model's projections,
each tensor's shape against the projection it adapts. A fused target (``qkv_proj``,
``gate_up_proj``) is split into the model's own projections: the same A for each part, B's
rows cut at the parts' output sizes. Every failure is a ``LoRAAdapterError`` that names the
adapter and the reason (400 from the server, a start-up error for ``--lora-modules``), written
for the user: no Python exception text, and nothing about a path outside ``allowed_paths``.

Inputs are bounded before they are read: the directory resolves (symlinks followed) under one
of ``allowed_paths`` when the list is set; each file must be a regular file (a FIFO, device or
socket, or a symlink to one, is refused before it is opened, and it is opened non-blocking and
checked again on the open descriptor); ``adapter_config.json`` is at most ``MAX_CONFIG_BYTES``;
the weights file at most what the declared rank needs over the model's projections in float32
plus ``MAX_HEADER_BYTES``. Every weight must be finite (a NaN or inf one is refused, naming the
tensor).
"""
from __future__ import annotations

import json
import math
import os
import re
import stat
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
MAX_CONFIG_BYTES = 2**20  # adapter_config.json
MAX_HEADER_BYTES = 2**20  # the safetensors header and slack beside the weights' bytes


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


def resolve_adapter_dir(name: str, path: str, allowed_paths=None) -> Path:
    """The adapter directory, resolved; under one of ``allowed_paths`` when given (checked
    before anything about the path is looked at, so a refusal says nothing of what exists)."""
    try:
        resolved = Path(os.path.realpath(Path(str(path)).expanduser()))
    except (OSError, ValueError):
        raise LoRAAdapterError(name, "lora_path is not a valid path") from None
    if allowed_paths:
        roots = [Path(os.path.realpath(Path(str(r)).expanduser())) for r in allowed_paths]
        if not any(resolved == r or r in resolved.parents for r in roots):
            raise LoRAAdapterError(name, "lora_path is not under an allowed path "
                                         "(--lora-allowed-paths)", status_code=400)
    try:
        is_dir = resolved.is_dir()
    except OSError:
        is_dir = False
    if not is_dir:
        raise LoRAAdapterError(name, f"lora_path {str(path)!r} is not a directory")
    return resolved


def _regular_size(name: str, file: Path, what: str) -> int:
    """The size of ``file`` if it is a regular file (symlinks followed), else an error."""
    try:
        st = os.stat(file)
    except FileNotFoundError:
        raise LoRAAdapterError(name, f"the adapter directory has no {what}") from None
    except OSError:
        raise LoRAAdapterError(name, f"{what} cannot be read") from None
    if not stat.S_ISREG(st.st_mode):
        raise LoRAAdapterError(name, f"{what} is not a regular file")
    return st.st_size


def read_bounded(name: str, file: Path, what: str, limit: int) -> bytes:
    """A regular file's bytes, at most ``limit`` of them (more is an error naming the limit).
    Opened non-blocking, so a file swapped for a FIFO after the check cannot block the read,
    and checked again on the open descriptor."""
    size = _regular_size(name, file, what)
    if size > limit:
        raise LoRAAdapterError(name, f"{what} is {size} bytes, more than the limit of {limit}")
    try:
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        raise LoRAAdapterError(name, f"{what} cannot be read") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise LoRAAdapterError(name, f"{what} is not a regular file")
        chunks, n = [], 0
        while n <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - n))
            if not chunk:
                break
            chunks.append(chunk)
            n += len(chunk)
    except OSError:
        raise LoRAAdapterError(name, f"{what} cannot be read") from None
    finally:
        os.close(fd)
    if n > limit:
        raise LoRAAdapterError(name, f"{what} is more than the limit of {limit} bytes")
    return b"".join(chunks)


def _read_config(name: str, path: Path) -> dict:
    raw = read_bounded(name, path / "adapter_config.json", "adapter_config.json",
                       MAX_CONFIG_BYTES)
    try:
        cfg = json.loads(raw)
    except (ValueError, RecursionError):
        raise LoRAAdapterError(name, "adapter_config.json is not valid JSON") from None
    if not isinstance(cfg, dict):
        raise LoRAAdapterError(name, "adapter_config.json must hold a JSON object")
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
            if not isinstance(m, str):
                raise LoRAAdapterError(name, "target_modules must be a list of module names")
            if m.rsplit(".", 1)[-1] not in have:
                raise LoRAAdapterError(
                    name, f"target module {m!r} is not a projection of this model "
                          f"(supported: {', '.join(sorted(have))})")


def max_weights_bytes(targets: LoRATargets, rank: int) -> int:
    """The largest ``adapter_model.safetensors`` an adapter of ``rank`` can need over these
    projections: A and B of every one in float32 (a fused target needs no more than its parts),
    plus the header."""
    return sum((d_in + d_out) * rank * 4 for d_in, d_out in targets.shapes.values()) \
        + MAX_HEADER_BYTES


def _safetensors_header(name: str, raw: bytes) -> dict:
    what = "adapter_model.safetensors"
    if len(raw) < 8:
        raise LoRAAdapterError(name, f"{what} is not a safetensors file")
    n = int.from_bytes(raw[:8], "little")
    if n > min(MAX_HEADER_BYTES, len(raw) - 8):
        raise LoRAAdapterError(name, f"{what} is not a safetensors file (bad header size)")
    try:
        header = json.loads(raw[8:8 + n])
    except (ValueError, RecursionError):
        raise LoRAAdapterError(name, f"{what} is not a safetensors file (bad header)") from None
    if not isinstance(header, dict):
        raise LoRAAdapterError(name, f"{what} is not a safetensors file (bad header)")
    header.pop("__metadata__", None)
    return header


_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": "bfloat16", "F64": np.float64}


def _header_len(raw: bytes) -> int:
    return int.from_bytes(raw[:8], "little")


def _tensor(name: str, key: str, info, raw: bytes, base: int) -> np.ndarray:
    """One tensor of a safetensors file read whole into ``raw`` (its entry checked: a float
    dtype, a shape, offsets inside the data that match the shape)."""
    bad = LoRAAdapterError(name, f"adapter_model.safetensors: tensor {key!r} is malformed or "
                                 "not float32, float16 or bfloat16")
    if not isinstance(info, dict) or info.get("dtype") not in _DTYPES:
        raise bad
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if (not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape)
            or not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)):
        raise bad
    dtype = _DTYPES[info["dtype"]]
    if dtype == "bfloat16":
        import ml_dtypes
        dtype = ml_dtypes.bfloat16
    dtype = np.dtype(dtype)
    start, stop = base + offsets[0], base + offsets[1]
    if not base <= start <= stop <= len(raw) or stop - start != math.prod(shape) * dtype.itemsize:
        raise bad
    return np.frombuffer(raw, dtype, math.prod(shape), start).reshape(shape)


def load_peft_adapter(name: str, path: str, targets: LoRATargets, max_rank: int,
                      allowed_paths=None) -> LoRAAdapter:
    """Read and check an adapter directory against the model's ``targets`` (``allowed_paths``:
    the roots it must lie under, None or empty for any)."""
    path = resolve_adapter_dir(name, path, allowed_paths)
    cfg = _read_config(name, path)
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoRAAdapterError(name, f"r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise LoRAAdapterError(name, f"rank {r} exceeds max_lora_rank {max_rank} "
                                     "(raise --max-lora-rank)")
    _check_target_names(name, cfg, targets)
    alpha = cfg.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) \
            or not math.isfinite(alpha):
        raise LoRAAdapterError(name, f"lora_alpha must be a finite number, got {alpha!r}")
    alpha = float(alpha)
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    what = "adapter_model.safetensors"
    raw = read_bounded(name, path / what, what, max_weights_bytes(targets, r))
    header = _safetensors_header(name, raw)
    tensors = {key: _tensor(name, key, info, raw, 8 + _header_len(raw))
               for key, info in header.items()}
    del raw
    keys = list(header)
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key in keys:
        m = re.fullmatch(r"(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key)
        if m is None:
            raise LoRAAdapterError(name, f"tensor {key!r} is not a LoRA A/B weight")
        module = m.group(1)
        module = module[len(_PREFIX):] if module.startswith(_PREFIX) else module
        t = tensors[key]
        if t.ndim != 2:
            raise LoRAAdapterError(name, f"tensor {key!r} is not a matrix (shape {t.shape})")
        t = np.asarray(t, np.float32)
        if not np.isfinite(t).all():
            raise LoRAAdapterError(name, f"tensor {key!r} holds NaN or infinite values")
        pairs.setdefault(module, {})[m.group(2)] = t
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
