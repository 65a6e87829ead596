"""What a pooling request asks for and what it gets back (vLLM's ``PoolingParams`` and
``PoolingRequestOutput``), plus the model-level ``PoolerConfig`` (``--pooler-config``).

Host side only (no jax). The device returns one pooled vector per sequence (or every token's
hidden state for ALL / STEP); what is per request (normalisation, Matryoshka ``dimensions``,
the classifier's activation, STEP's token filter) is applied here, in numpy, so one compiled
step serves every mix of requests.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from jaxserve.core.json_object import json_object
from jaxserve.errors import InvalidRequestError

POOLING_TYPES = ("CLS", "MEAN", "LAST", "ALL", "STEP")
POOLING_TASKS = ("embed", "classify", "score", "token_embed", "encode")
RUNNERS = ("auto", "generate", "pooling")
# vLLM's --task spellings that select the pooling runner (and its default task)
TASK_ALIASES = {"embed": "embed", "embedding": "embed", "score": "score",
                "classify": "classify", "reward": "encode"}


@dataclass(frozen=True)
class PoolerConfig:
    """``--pooler-config`` (vLLM's field names). ``None`` fields come from the checkpoint:
    sentence-transformers' ``1_Pooling/config.json`` and ``Normalize`` module, else the
    architecture's default (CLS for BERT, LAST for a decoder)."""

    pooling_type: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None  # a default Matryoshka truncation
    step_tag_id: int | None = None  # STEP: only tokens equal to this id
    returned_token_ids: tuple[int, ...] | None = None  # STEP: only these columns
    use_activation: bool | None = None  # classify: sigmoid / softmax on the logits

    FIELDS = ("pooling_type", "normalize", "dimensions", "step_tag_id", "returned_token_ids",
              "use_activation", "activation", "softmax")

    @classmethod
    def parse(cls, value) -> "PoolerConfig | None":
        """A dict, its JSON text (the CLI's form), a PoolerConfig or None; unknown keys are an
        error naming the key."""
        if value is None or isinstance(value, PoolerConfig):
            return value
        d = json_object(value, "pooler_config")
        unknown = sorted(set(d) - set(cls.FIELDS))
        if unknown:
            raise ValueError(f"pooler_config.{unknown[0]} is not a supported field "
                             f"(supported: {', '.join(cls.FIELDS[:6])})")
        for old in ("activation", "softmax"):  # vLLM's older spellings
            if old in d:
                d.setdefault("use_activation", d.pop(old))
        pt = d.get("pooling_type")
        if pt is not None:
            if not isinstance(pt, str) or pt.upper() not in POOLING_TYPES:
                raise ValueError(f"pooler_config.pooling_type must be one of {POOLING_TYPES},"
                                 f" got {pt!r}")
            d["pooling_type"] = pt.upper()
        dims = d.get("dimensions")
        if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int)
                                 or dims < 1):
            raise ValueError(f"pooler_config.dimensions must be an integer >= 1, got {dims!r}")
        if d.get("returned_token_ids") is not None:
            d["returned_token_ids"] = tuple(int(t) for t in d["returned_token_ids"])
        return cls(**d)


@dataclass
class PoolingParams:
    """One pooling request's options. ``task``: embed | classify | score | token_embed |
    encode. ``dimensions``: keep the first n embedding dimensions (renormalised when
    normalising), only for a model that declares Matryoshka support or n = its size.
    ``normalize`` / ``use_activation``: None = the model's default. ``truncate_prompt_tokens``:
    keep the prompt's last k tokens (-1: max_model_len); None: a longer prompt is an error."""

    task: str = "embed"
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self):
        if self.task not in POOLING_TASKS:
            raise InvalidRequestError(f"task must be one of {POOLING_TASKS}, got {self.task!r}",
                                      param="task")
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise InvalidRequestError(f"dimensions must be an integer >= 1, got {d!r}",
                                      param="dimensions")
        for name in ("normalize", "use_activation"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise InvalidRequestError(f"{name} must be true or false, got {v!r}",
                                          param=name)
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int)
                              or (t < 1 and t != -1)):
            raise InvalidRequestError(f"truncate_prompt_tokens must be -1 or an integer >= 1, "
                                      f"got {t!r}", param="truncate_prompt_tokens")


@dataclass
class PoolingOutput:
    """vLLM's ``PoolingRequestOutput``: ``outputs.data`` is the pooled vector (embed), the
    class probabilities or logits (classify / score) or a ``[tokens, H]`` array (ALL/STEP)."""

    request_id: str
    data: np.ndarray
    prompt_token_ids: list[int]
    finished: bool = True
    error: str | None = None

    @property
    def outputs(self) -> "PoolingOutput":  # vLLM spells ``out.outputs.data`` / ``.embedding``
        return self

    @property
    def embedding(self) -> list[float]:
        return self.data.tolist()

    @property
    def probs(self) -> list[float]:
        return self.data.tolist()

    @property
    def score(self) -> float:
        return float(self.data.reshape(-1)[0])


@dataclass(frozen=True)
class PoolingModelInfo:
    """What the host needs to post-process and validate: the model's output size, the
    pooling type, defaults, labels and the Matryoshka sizes it was trained for."""

    hidden_size: int  # the embedding size after the sentence-transformers Dense modules
    pooling_type: str
    normalize: bool  # embed's default
    num_labels: int = 0  # a classification head's outputs (0: none)
    id2label: dict = field(default_factory=dict)
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    default_dimensions: int | None = None
    step_tag_id: int | None = None
    returned_token_ids: tuple[int, ...] | None = None
    use_activation: bool = True


def check_params(params: PoolingParams, info: PoolingModelInfo) -> None:
    """Errors naming the field for what this model cannot do."""
    if params.task in ("classify", "score") and info.num_labels == 0:
        raise InvalidRequestError(f"task {params.task!r} needs a classification head; this "
                                  "model only embeds", param="task")
    if params.task in ("embed", "token_embed") and info.num_labels:
        raise InvalidRequestError(f"task {params.task!r}: this model is a classifier (a "
                                  f"head of {info.num_labels} outputs); it classifies and "
                                  "scores, it does not embed", param="task")
    if params.task == "embed" and info.pooling_type in ("ALL", "STEP"):
        raise InvalidRequestError(f"pooling_type {info.pooling_type} pools every token: use "
                                  "task 'token_embed' (the /pooling route)", param="task")
    if params.dimensions is not None:
        if params.task != "embed":
            raise InvalidRequestError("dimensions applies to embeddings only",
                                      param="dimensions")
        if params.dimensions != info.hidden_size:
            if not info.is_matryoshka:
                raise InvalidRequestError(
                    f"Model does not support matryoshka representation: dimensions "
                    f"{params.dimensions} differs from its embedding size {info.hidden_size}",
                    param="dimensions")
            allowed = info.matryoshka_dimensions
            if params.dimensions > info.hidden_size or (allowed and params.dimensions
                                                          not in allowed):
                raise InvalidRequestError(
                    f"dimensions {params.dimensions} is not supported; the model supports "
                    f"{list(allowed) if allowed else f'1..{info.hidden_size}'}",
                    param="dimensions")


def postprocess(pooled: np.ndarray, token_ids: list[int], params: PoolingParams,
                info: PoolingModelInfo) -> np.ndarray:
    """The device's pooled row (or a ``[tokens, H]`` block) -> what the request asked for."""
    x = np.asarray(pooled, np.float32)
    if params.task in ("classify", "score"):
        act = info.use_activation if params.use_activation is None else params.use_activation
        if not act:
            return x
        if x.shape[-1] == 1:  # one label: a score in (0, 1)
            return 1.0 / (1.0 + np.exp(-x))
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)
    if info.pooling_type == "STEP" and params.task != "embed":
        if info.returned_token_ids:
            x = x[:, list(info.returned_token_ids)]
        if info.step_tag_id is not None:
            x = x[np.asarray(token_ids) == info.step_tag_id]
    dims = params.dimensions or info.default_dimensions
    if dims is not None and params.task == "embed":
        x = x[..., :dims]
    norm = info.normalize if params.normalize is None else params.normalize
    if norm and params.task in ("embed", "token_embed"):
        x = x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
    return x
