"""Request bodies of the pooling routes: OpenAI's ``/v1/embeddings``, and vLLM's ``/pooling``,
``/classify``, ``/score`` and ``/rerank`` (Jina / Cohere shape). Strict like every request
(an unknown or unsupported field is a 400 naming it); responses are plain dicts."""
from __future__ import annotations

from typing import Literal, Union

from pydantic import Field, StrictInt, StrictStr

from jaxserve.entrypoints.openai.protocol import RequestModel

# Cohere's limit: a rerank request scores at most this many documents (a larger one is a 400,
# so one client cannot hold the engine for minutes)
MAX_RERANK_DOCUMENTS = 1000
# inputs of one embeddings / classify / score request
MAX_POOLING_INPUTS = 2048

Input = Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]


class _PoolingFields(RequestModel):
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    priority: int = 0
    request_id: str | None = None


class EmbeddingRequest(_PoolingFields):
    input: Input
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    normalize: bool | None = None


class PoolingRequest(EmbeddingRequest):
    """vLLM's ``/pooling``: the model's raw pooled output (ALL/STEP: one row per token)."""

    task: Literal["embed", "token_embed", "encode", "classify"] | None = None


class ClassificationRequest(_PoolingFields):
    input: Input
    use_activation: bool | None = None


class ScoreRequest(_PoolingFields):
    text_1: Union[StrictStr, list[StrictStr]]
    text_2: Union[StrictStr, list[StrictStr]]
    use_activation: bool | None = None


class RerankRequest(_PoolingFields):
    query: StrictStr
    documents: list[StrictStr]
    top_n: int | None = Field(default=None, ge=0)
    return_documents: bool = True
    use_activation: bool | None = None


def input_list(value) -> list:
    """One input or many: a string, token ids, or a list of either."""
    if isinstance(value, str):
        return [value]
    if value and isinstance(value[0], int):
        return [list(value)]
    return list(value)
