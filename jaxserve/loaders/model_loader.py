"""Checkpoints -> placed model parameters, and the tokenizer.

Sources: an HF directory (config.json + one or many ``*.safetensors``, read lazily with
``safe_open``), a GGUF file (through ``jaxserve.loaders.gguf``), ``dummy`` random weights from
config.json alone, and the name ``demo-random``. Every parameter is placed with a
``NamedSharding`` whose ``PartitionSpec`` comes from :func:`param_partition_spec`; tensor
parallelism only changes the mesh and that one function.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.config import ModelConfig
from jaxserve.models import kv_scales, linear
from jaxserve.models import quantization as quant_lib
from jaxserve.models.attention import AttentionBackend
from jaxserve.models.contract import megatron_partition_spec
from jaxserve.models.registry import get_model_class
from jaxserve.sharding import TP_AXIS, default_mesh

logger = logging.getLogger(__name__)
# Checkpoint tensors that carry no parameter (HF buffers saved by old exports).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_dtype(dtype) -> jnp.dtype:
    """"auto": bfloat16 on GPU/TPU, float32 on CPU; else a dtype name or object."""
    if dtype in (None, "auto"):
        return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
    names = {"float32": jnp.float32, "fp32": jnp.float32, "float": jnp.float32,
             "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
             "float16": jnp.float16, "fp16": jnp.float16, "half": jnp.float16}
    if isinstance(dtype, str):
        if dtype not in names:
            raise ValueError(f"dtype {dtype!r} not one of auto, {', '.join(sorted(names))}")
        return jnp.dtype(names[dtype])
    return jnp.dtype(dtype)


def param_partition_spec(name: str, mesh: Mesh | None = None) -> PartitionSpec:
    """The PartitionSpec of one parameter (HF name, HF ``[out, in]`` layout).

    Megatron-style: q/k/v/gate/up split their output rows, o/down their input columns, the
    embedding and LM head split the vocabulary; norms are replicated. A mesh without the
    ``tp`` axis gets everything replicated.
    """
    if mesh is not None and TP_AXIS not in mesh.axis_names:
        return PartitionSpec()
    return megatron_partition_spec(name)


def _param_sharding(name: str, shape, mesh: Mesh, model_config: ModelConfig | None = None
                    ) -> NamedSharding:
    from jaxserve import sharding

    def spec_of(name):
        if model_config is not None and TP_AXIS in mesh.axis_names:  # the family's own rules
            return get_model_class(model_config.architecture).param_partition_spec(
                name, model_config)
        return param_partition_spec(name, mesh)

    spec = quant_lib.partition_spec(name, spec_of) or spec_of(name)
    if (model_config is not None and re.search(r"(^|\.)[kv]_proj\.[a-z_]+$", name)
            and not sharding.shard_kv_projections(model_config.num_kv_heads,
                                                  sharding.tp_size(mesh))):
        spec = PartitionSpec()  # fewer KV heads than devices: replicated, repeated per device
    # A dimension the mesh axis does not divide stays replicated (e.g. a vocab of 50257).
    size = dict(zip(mesh.axis_names, mesh.devices.shape))
    spec = PartitionSpec(*[
        ax if ax is None or shape[i] % size[ax] == 0 else None for i, ax in enumerate(spec)
    ])
    return NamedSharding(mesh, spec)


def _attach_mesh(model, model_config: ModelConfig, mesh: Mesh | None):
    """A model given an explicit mesh runs attention per shard (``sharding.sharded_attention``);
    without one it takes the plain single-device path."""
    if mesh is not None:
        from jaxserve import sharding

        sharding.check_model(model_config, sharding.tp_size(mesh))
    model.mesh = mesh
    return model


class _ShapeOnlyRngs:
    """Stands in for ``nnx.Rngs`` while only shapes are built: every stream gives the same key.

    A real ``Rngs`` stores its incremented counter, a tracer under ``eval_shape``, and each such
    store asks the tracer for its sharding, whose error message walks the whole jaxpr traced so
    far: quadratic in the number of parameters (8-20 s for a 30-layer model on a small CPU)."""

    def __call__(self):
        return jax.random.key(0)

    def __getattr__(self, stream: str):
        if stream.startswith("__"):
            raise AttributeError(stream)
        return self


def _abstract_model(model_config: ModelConfig, dtype, attention_backend: str | AttentionBackend,
                    quant=None):
    cls = get_model_class(model_config.architecture)
    model = nnx.eval_shape(lambda: cls(model_config, dtype=dtype, rngs=_ShapeOnlyRngs(),
                                       attention_backend=attention_backend))
    return quant_lib.quantize_linears(model, quant, dtype)


def _param_names(model) -> dict[str, nnx.Variable]:
    _, state = nnx.split(model)
    out = {}
    for path, var in nnx.to_flat_state(state):
        out[".".join(str(p) for p in path)] = var
    return out


def _resolve(model, name: str) -> nnx.Variable:
    obj = model
    for part in name.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def build_model(model_config: ModelConfig, tensors: Mapping[str, Callable[[], np.ndarray]], *,
                dtype=jnp.float32, mesh: Mesh | None = None,
                attention_backend: str | AttentionBackend = "reference",
                quantization: str | None = None):
    """The model with every parameter loaded from ``tensors`` (HF name -> loader of a numpy
    array), cast to ``dtype`` (quantized tensors keep theirs) and placed on ``mesh``. Errors
    name the offending tensor. ``quantization``: see :mod:`jaxserve.models.quantization`."""
    dtype = resolve_dtype(dtype)
    quant = (quantization if isinstance(quantization, quant_lib.QuantPlan)
             else _quant_plan(quantization, model_config))
    model = _attach_mesh(_abstract_model(model_config, dtype, attention_backend, quant),
                         model_config, mesh)
    mesh = mesh or default_mesh()
    expected = _param_names(model)
    # float8 KV cache scales (k_scale / v_scale): attention settings, not parameters
    scales = kv_scales.checkpoint_kv_scales(tensors, model_config.num_layers,
                                            model_config.num_kv_heads)
    tensors = {n: f for n, f in tensors.items() if not kv_scales.is_scale_tensor(n)}
    tensors = get_model_class(model_config.architecture).checkpoint_tensors(model_config, tensors)
    tensors = quant_lib.checkpoint_tensors(quant, tensors, expected)
    _check_names(model_config, expected, tensors)
    from tqdm.auto import tqdm

    loaded = tqdm(_prefetched(expected, tensors), total=len(expected), desc="Loading weights",
                  unit="tensor", disable=None, leave=False)  # a bar on a terminal only
    for name, arr in loaded:
        var = expected[name]
        want = tuple(var.get_value().shape)
        if arr.shape != want:
            raise ValueError(f"tensor {name!r} has shape {tuple(arr.shape)}, expected {want}")
        # no host copy when the checkpoint has the dtype
        arr = arr.astype(var.get_value().dtype, copy=False)
        placed = jax.device_put(arr, _param_sharding(name, want, mesh, model_config))
        _resolve(model, name).set_value(placed)
    if scales is not None:
        kv_scales.set_kv_scales(model, scales)
    return model


def _quant_plan(quantization_method, model_config: ModelConfig, lm_head_quantized=False):
    return quant_lib.plan_from_config(quantization_method, model_config.hf, lm_head_quantized)


def _prefetched(names, tensors, workers: int = 2):
    """``(name, numpy array)`` in ``names`` order, read (dequantized) by a small thread pool a
    few tensors ahead of the caller: numpy's work releases the GIL, so reading the next tensors
    overlaps placing this one. At most ``2 * workers`` tensors are held on the host."""
    from concurrent.futures import ThreadPoolExecutor

    names = list(names)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="jaxserve-load") as pool:
        pending = [pool.submit(tensors[n]) for n in names[:2 * workers]]
        for i, name in enumerate(names):
            arr = np.asarray(pending[i].result())
            pending[i] = None
            if i + 2 * workers < len(names):
                pending.append(pool.submit(tensors[names[i + 2 * workers]]))
            yield name, arr


def _check_names(model_config: ModelConfig, expected, tensors) -> None:
    given = {n for n in tensors if not n.endswith(_IGNORED_SUFFIXES)}
    if model_config.tie_word_embeddings:
        given.discard("lm_head.weight")  # some exports save the tied head anyway
    missing = sorted(set(expected) - given)
    if missing:
        raise ValueError(f"checkpoint is missing tensor {missing[0]!r}"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    unexpected = sorted(given - set(expected))
    if unexpected:
        raise ValueError(f"checkpoint has unexpected tensor {unexpected[0]!r}"
                         + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
                         + f" for {model_config.architecture}")


def build_dummy_model(model_config: ModelConfig, *, dtype=jnp.float32, mesh: Mesh | None = None,
                      attention_backend: str | AttentionBackend = "reference", seed: int = 0):
    """Random weights (normal, std 0.02; norms 1), made on the device by the model's own
    initialisers.

    On one device the model is built op by op: each initialiser compiles once per distinct
    shape and every layer reuses it. One jit of the whole init compiles the whole model's
    initialisers as one program instead, which takes minutes for a 64-layer shape (124 s on a
    2-core CPU for Qwen3.6-27B; benchmarks/dummy_init.py). Over several devices that one jit
    stays, since it places every weight straight in its shards."""
    dtype = resolve_dtype(dtype)
    explicit_mesh = mesh
    mesh = mesh or default_mesh()
    abstract = _abstract_model(model_config, dtype, attention_backend)
    graphdef, abs_state = nnx.split(abstract)
    shardings = jax.tree_util.tree_map_with_path(
        lambda path, leaf: _param_sharding(_path_name(path), leaf.shape, mesh, model_config),
        abs_state)

    init = dummy_init_fn(model_config, dtype, attention_backend, seed)
    if mesh.devices.size == 1:
        with jax.default_device(mesh.devices.flat[0]):
            state = jax.device_put(init(), shardings)
    else:
        state = jax.jit(init, out_shardings=shardings)()
    return _attach_mesh(nnx.merge(graphdef, state), model_config, explicit_mesh)


def dummy_init_fn(model_config: ModelConfig, dtype,
                  attention_backend: str | AttentionBackend = "reference", seed: int = 0):
    """The model's own initialisers as a function returning its state (run op by op, or
    jitted whole)."""
    cls = get_model_class(model_config.architecture)
    dtype = resolve_dtype(dtype)

    def init():
        return nnx.split(cls(model_config, dtype=dtype, rngs=nnx.Rngs(seed),
                             attention_backend=attention_backend))[1]

    return init


def _path_name(path) -> str:
    """``model.layers.0.mlp.up_proj.weight`` from a pytree key path of an nnx State."""
    parts = []
    for p in path:
        if isinstance(p, jax.tree_util.DictKey):
            parts.append(str(p.key))
        elif isinstance(p, jax.tree_util.SequenceKey):
            parts.append(str(p.idx))
    return ".".join(parts)


def _read_config(model_dir: Path, hf_overrides: dict | None = None) -> dict:
    path = model_dir / "config.json"
    if not path.exists():
        raise ValueError(f"{model_dir} has no config.json")
    return apply_hf_overrides(json.loads(path.read_text()), hf_overrides)


def apply_hf_overrides(hf_config: dict, hf_overrides: dict | None) -> dict:
    """``--hf-overrides``: keys laid over config.json (nested dicts merged, as vLLM)."""
    if not hf_overrides:
        return hf_config
    out = dict(hf_config)
    for k, v in hf_overrides.items():
        out[k] = apply_hf_overrides(out[k], v) if isinstance(v, dict) and \
            isinstance(out.get(k), dict) else v
    return out


def check_no_remote_code(hf_config: dict, model: str) -> None:
    """A config whose architecture only exists as code in its repository (``auto_map``) cannot
    be served: jaxserve runs its own model implementations and never the checkpoint's code."""
    from jaxserve.models.registry import MODEL_REGISTRY

    archs = hf_config.get("architectures") or []
    if hf_config.get("auto_map") and not any(a in MODEL_REGISTRY for a in archs):
        raise ValueError(
            f"model {model!r} needs remote code (config.json auto_map "
            f"{sorted(hf_config['auto_map'])}, architectures {archs}); jaxserve runs only its own "
            f"model implementations, so --trust-remote-code cannot load it (supported: "
            f"{', '.join(sorted(MODEL_REGISTRY))})")


def safetensors_tensors(model_dir: Path) -> dict[str, Callable[[], np.ndarray]]:
    """HF name -> lazy loader over one or many ``*.safetensors`` files (index file honoured)."""
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:  # prefer HF's model*.safetensors over e.g. Mistral's consolidated.safetensors
        files = (sorted(p.name for p in model_dir.glob("model*.safetensors"))
                 or sorted(p.name for p in model_dir.glob("*.safetensors")))
    if not files:
        raise ValueError(f"{model_dir} has no *.safetensors files")
    out: dict[str, Callable[[], np.ndarray]] = {}
    for fname in files:
        path = model_dir / fname
        if not path.exists():
            raise ValueError(f"{model_dir}: the index names {fname!r}, which is missing")
        with safe_open(str(path), framework="numpy") as f:
            names = list(f.keys())
        for n in names:
            if n in out:
                raise ValueError(f"tensor {n!r} appears in more than one safetensors file")
            out[n] = _lazy_tensor(path, n)
    return out


def _lazy_tensor(path: Path, name: str) -> Callable[[], np.ndarray]:
    def load():
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="numpy") as f:
                return f.get_tensor(name)
        except TypeError:  # older safetensors: no bfloat16 in numpy mode
            with safe_open(str(path), framework="flax") as f:
                return np.asarray(f.get_tensor(name))
        except AttributeError:  # float8 (numpy has none): read the raw bytes
            return _read_float8(path, name)
    return load


_FLOAT8 = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def _read_float8(path: Path, name: str) -> np.ndarray:
    """One float8 tensor of a safetensors file (8-byte header size, JSON header, data)."""
    import ml_dtypes

    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        info = json.loads(f.read(n))[name]
        if info["dtype"] not in _FLOAT8:
            raise ValueError(f"tensor {name!r} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        f.seek(8 + n + start)
        raw = np.frombuffer(f.read(end - start), np.uint8)
    return raw.view(getattr(ml_dtypes, _FLOAT8[info["dtype"]])).reshape(info["shape"])


def _resolve_model_path(model: str, revision: str | None = None,
                        download_dir: str | None = None) -> Path:
    from jaxserve.loaders.demo_model import DEMO_NAME, ensure_demo_random

    if model == DEMO_NAME:
        return ensure_demo_random()
    path = Path(model).expanduser()
    if path.exists():
        return path
    if model.count("/") == 1 and not model.startswith((".", "/", "~")):
        return _download_from_hub(model, revision, download_dir)
    raise ValueError(f"model {model!r} is neither a local path, a Hugging Face repo id nor "
                     f"a known model name ({DEMO_NAME!r})")


def _download_from_hub(repo_id: str, revision: str | None = None,
                       download_dir: str | None = None) -> Path:
    """An ``org/name`` from the Hugging Face Hub (or its local cache), weights as safetensors;
    ``revision`` (branch, tag or commit) and ``download_dir`` (the cache) as vLLM's flags."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(
            repo_id, revision=revision, cache_dir=download_dir,
            allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.jinja",
                            "*.model", "*.txt"]))
    except Exception as e:  # offline, unknown repo, gated, ...
        raise ValueError(f"model {repo_id!r} is not a local path and could not be fetched "
                         f"from the Hugging Face Hub: {type(e).__name__}: {e}") from None


ORBAX_PARAMS = "params"  # sub-directory of an orbax checkpoint dir (beside config.json)


def _is_orbax_dir(path: Path) -> bool:
    return (path / ORBAX_PARAMS / "_CHECKPOINT_METADATA").exists()


def _load_orbax(path: Path, model_config: ModelConfig, *, dtype, mesh, attention_backend):
    """Restore a :func:`convert_to_orbax` checkpoint straight into its shardings and dtype."""
    import orbax.checkpoint as ocp

    dtype = resolve_dtype(dtype)
    model = _attach_mesh(_abstract_model(model_config, dtype, attention_backend), model_config,
                         mesh)
    mesh = mesh or default_mesh()
    expected = _param_names(model)
    ckpt = ocp.StandardCheckpointer()
    saved = ckpt.metadata(path.resolve() / ORBAX_PARAMS)
    saved = getattr(saved, "item_metadata", saved)
    _check_names(model_config, expected, dict(saved))
    target = {}
    for name, var in expected.items():
        shape = tuple(var.get_value().shape)
        if tuple(saved[name].shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(saved[name].shape)}, "
                             f"expected {shape}")
        target[name] = jax.ShapeDtypeStruct(shape, dtype,
                                            sharding=_param_sharding(name, shape, mesh,
                                                                     model_config))
    restored = ckpt.restore(path.resolve() / ORBAX_PARAMS, target)
    for name, arr in restored.items():
        _resolve(model, name).set_value(arr)
    return model


def convert_to_orbax(model: str, out_dir, *, dtype="auto", load_format: str = "auto") -> Path:
    """Write ``model`` (HF dir, GGUF, demo-random) as config.json + tokenizer + an orbax
    checkpoint of HF-named params, which :func:`load_model` restores already sharded."""
    import orbax.checkpoint as ocp

    out = Path(out_dir).resolve()
    m, _, src = load_model(model, dtype=dtype, load_format=load_format)
    gen = None
    if src.suffix == ".gguf":
        from jaxserve.loaders import gguf as gguf_loader

        hf_config = gguf_loader.load_gguf(src)[0]
    else:
        hf_config = _read_config(src)
        gen = src / "generation_config.json"
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    if gen is not None and gen.exists():
        (out / "generation_config.json").write_text(gen.read_text())
    load_tokenizer(src).save_pretrained(str(out))
    params = {name: var.get_value() for name, var in _param_names(m).items()}
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(out / ORBAX_PARAMS, params, force=True)
    ckpt.wait_until_finished()
    return out


def _gguf_serves_int8(path, quantization, lm_head_quantized, dtype, mesh) -> bool:
    """A quantized GGUF served on one CPU device with no --quantization and no --dtype runs as
    int8 (W8A8, the LM head too) through the C++ kernels: the closest to the bytes the file
    stores, at llama.cpp's speed (benchmarks/cpu_peers.py) and within the quality rule
    (held-out perplexity within 1 % of float32). ``--dtype float32`` keeps float32 weights."""
    from jaxserve.loaders import gguf as gguf_loader

    if (quantization is not None or lm_head_quantized or dtype != "auto" or mesh is not None
            or not linear.int8_kernel_enabled()  # one CPU device, the kernels built
            or not gguf_loader.has_quantized_weights(path)):
        return False
    logger.info("%s: quantized GGUF on CPU, serving int8 weights and LM head (W8A8); "
                "--dtype float32 serves float32", path.name)
    return True


def load_model(model: str, *, dtype="auto", load_format: str = "auto", mesh: Mesh | None = None,
               attention_backend: str | AttentionBackend = "reference",
               enable_expert_parallel: bool = False,
               quantization: str | None = None, lm_head_quantized: bool = False,
               revision: str | None = None, download_dir: str | None = None,
               hf_overrides: dict | None = None, trust_remote_code: bool = False,
               load_mtp: bool = False):
    """Load ``model`` (HF dir, ``.gguf`` file, orbax dir from :func:`convert_to_orbax`, an HF
    hub id or ``demo-random``) -> (model, ModelConfig, dir). ``enable_expert_parallel``: MoE
    experts split whole over the mesh instead of each expert split by tensor parallelism.
    ``quantization``: fp8 | int8 | awq | gptq | gguf (None: the checkpoint's own
    ``quantization_config``; gguf keeps a GGUF's Q4_0/Q4_1/Q8_0 projections quantized).
    ``lm_head_quantized``: with fp8 or int8, the LM head (or the tied embedding) in int8 (per
    row) too. ``revision``, ``download_dir``: for a Hub id; ``hf_overrides``: laid over
    config.json; ``trust_remote_code`` is accepted, but remote code is never run
    (:func:`check_no_remote_code`). ``load_mtp``: also the checkpoint's multi-token-prediction
    head (speculative decoding method ``mtp``; families without one ignore it)."""
    quant_lib.validate_method(quantization)
    quant_lib.validate_lm_head_quantized(lm_head_quantized)
    serving = dict(enable_expert_parallel=enable_expert_parallel, load_mtp=bool(load_mtp))
    formats = ("auto", "safetensors", "gguf", "orbax", "dummy")
    if load_format not in formats:
        raise ValueError(f"load_format {load_format!r} not one of {formats}")
    path = _resolve_model_path(model, revision, download_dir)
    if load_format == "gguf" or (load_format == "auto" and path.suffix == ".gguf"):
        from jaxserve.loaders import gguf as gguf_loader

        hf_config, tensors = gguf_loader.load_gguf(path)
        hf_config = apply_hf_overrides(hf_config, hf_overrides)
        cfg = dataclasses.replace(ModelConfig.from_hf_config(hf_config), **serving)
        if _gguf_serves_int8(path, quantization, lm_head_quantized, dtype, mesh):
            quantization, lm_head_quantized = "int8", True
        if quantization == "gguf":  # Q4_0/Q4_1/Q8_0 projections stay in their blocks
            if lm_head_quantized:
                raise ValueError("lm_head_quantized needs quantization 'fp8' (got 'gguf')")
            kept = gguf_loader.raw_blocks(path, tuple(quant_lib.GGUF_KEPT))
            tensors = {**tensors, **{n: (lambda f=fmt, ld=ld: (f, ld()))
                                     for n, (fmt, ld) in kept.items()}}
            quantization = quant_lib.QuantPlan(
                "gguf", prequantized=True, layer_formats={n: f for n, (f, _) in kept.items()})
        else:
            quantization = _quant_plan(quantization, cfg, lm_head_quantized)
        m = build_model(cfg, tensors, dtype=dtype, mesh=mesh, attention_backend=attention_backend,
                        quantization=quantization)
        return m, cfg, path
    hf_config = _read_config(path, hf_overrides)
    check_no_remote_code(hf_config, model)
    cfg = dataclasses.replace(ModelConfig.from_hf_config(hf_config), **serving)
    quant = _quant_plan(quantization, cfg, lm_head_quantized)
    if quant is not None and (load_format == "orbax" or (load_format == "auto" and
                                                         _is_orbax_dir(path))):
        raise ValueError("quantization is not supported with orbax checkpoints")
    if load_format == "dummy":
        if quant is not None and quant.method != "fp8":
            raise ValueError(f"quantization {quant.method!r} needs its checkpoint; "
                             "load_format 'dummy' supports quantization fp8 only")
        m = build_dummy_model(cfg, dtype=dtype, mesh=mesh, attention_backend=attention_backend)
        if quant is not None:
            m = quant_lib.quantize_model_fp8(m, quant)
    elif load_format == "orbax" or (load_format == "auto" and _is_orbax_dir(path)):
        if not _is_orbax_dir(path):
            raise ValueError(f"{path} has no orbax checkpoint in {ORBAX_PARAMS}/")
        m = _load_orbax(path, cfg, dtype=dtype, mesh=mesh, attention_backend=attention_backend)
    else:
        m = build_model(cfg, safetensors_tensors(path), dtype=dtype, mesh=mesh,
                        attention_backend=attention_backend, quantization=quant)
    return m, cfg, path


def load_tokenizer(model_dir_or_name, tokenizer=None):
    """The HF tokenizer of a model (or of ``tokenizer``, a dir or hub name, when given)."""
    from transformers import AutoTokenizer

    src = tokenizer if tokenizer is not None else model_dir_or_name
    if str(src) == "demo-random":
        src = _resolve_model_path("demo-random")
    if str(src).endswith(".gguf"):
        from jaxserve.loaders.gguf import gguf_tokenizer

        return gguf_tokenizer(src)
    return AutoTokenizer.from_pretrained(str(src))
