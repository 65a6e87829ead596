"""HF ``architectures`` name -> the pooling model class (``--runner pooling``)."""
from __future__ import annotations

from jaxserve.models.bert import BertForSequenceClassification, BertModel
from jaxserve.models.llama_pooling import LlamaEmbeddingModel, LlamaForSequenceClassification

POOLING_REGISTRY = {
    "BertModel": BertModel,
    "BertForSequenceClassification": BertForSequenceClassification,
    # decoder embedders (Qwen3-Embedding is a Qwen3ForCausalLM checkpoint): last-token pooling
    **{a: LlamaEmbeddingModel for a in (
        "LlamaForCausalLM", "LlamaModel", "Qwen2ForCausalLM", "Qwen2Model",
        "Qwen3ForCausalLM", "Qwen3Model", "MistralForCausalLM", "MistralModel")},
    **{a: LlamaForSequenceClassification for a in (
        "LlamaForSequenceClassification", "Qwen2ForSequenceClassification",
        "Qwen3ForSequenceClassification", "MistralForSequenceClassification")},
}


def get_pooling_class(architecture: str):
    try:
        return POOLING_REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"--runner pooling does not serve {architecture!r}; supported: "
                         + ", ".join(sorted(POOLING_REGISTRY))) from None
