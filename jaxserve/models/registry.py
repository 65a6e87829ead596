"""HF ``architectures`` name -> model class."""
from __future__ import annotations

from jaxserve.models.gemma import GemmaForCausalLM
from jaxserve.models.gemma4 import Gemma4ForCausalLM
from jaxserve.models.gemma4_vision import Gemma4ForConditionalGeneration
from jaxserve.models.llama import LlamaForCausalLM
from jaxserve.models.moe import MoeForCausalLM
from jaxserve.models.phi3 import Phi3ForCausalLM
from jaxserve.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "Gemma4ForConditionalGeneration": Gemma4ForConditionalGeneration,  # + vision tower
    "MixtralForCausalLM": MoeForCausalLM,
    "Qwen2MoeForCausalLM": MoeForCausalLM,
    "Qwen3MoeForCausalLM": MoeForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForCausalLM,
}


def _gguf_tables() -> list:
    return [spec for cls in dict.fromkeys(MODEL_REGISTRY.values()) for spec in cls.gguf]


# llama.cpp's ``general.architecture`` -> its family's table (jaxserve.models.gguf_table)
GGUF_ARCHITECTURES = {spec.gguf_name: spec for spec in _gguf_tables() if spec.gguf_name}


def gguf_arch(name: str, experts: bool = False):
    """The ``GGUFArch`` of a GGUF architecture (``experts``: the file has experts, which the
    llama architecture stores for Mixtral); unknown names list what is supported."""
    if name not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {name!r} is not supported; supported "
                         f"architectures: {', '.join(GGUF_ARCHITECTURES)}")
    spec = GGUF_ARCHITECTURES[name]
    if experts and spec.with_experts:
        return next(s for s in _gguf_tables() if s.architecture == spec.with_experts)
    return spec


def register_model(architecture: str, cls: type) -> None:
    """Serve checkpoints whose ``architectures`` name ``architecture`` with ``cls``, a family
    class outside this package (vLLM's ``ModelRegistry.register_model``: out-of-tree models,
    and the test families of ``jaxserve.testing``). ``cls`` lists ``ModelBase`` first; a name
    taken by another class is an error."""
    from jaxserve.models.contract import ModelBase

    if not (isinstance(cls, type) and issubclass(cls, ModelBase)):
        raise ValueError(f"register_model: {cls!r} is not a model class (a subclass of "
                         "jaxserve.models.contract.ModelBase)")
    if MODEL_REGISTRY.get(architecture, cls) is not cls:
        raise ValueError(f"register_model: architecture {architecture!r} is already served by "
                         f"{MODEL_REGISTRY[architecture].__name__}")
    MODEL_REGISTRY[architecture] = cls


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def get_model_class(architecture: str):
    """The class for an HF architecture name; unknown names list what is supported."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: "
            + ", ".join(supported_architectures())
        ) from None
