"""jaxserve: LLM inference and serving in JAX and Pallas."""
__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "AsyncLLM", "LLMEngine", "LoRARequest", "EngineArgs"]


def __getattr__(name):  # lazy, so host-side modules never pull in jax
    if name == "LLM":
        from jaxserve.entrypoints.llm import LLM
        return LLM
    if name in ("SamplingParams", "StructuredOutputsParams"):
        from jaxserve.core import sampling_params
        return getattr(sampling_params, name)
    if name in ("RequestOutput", "CompletionOutput"):
        from jaxserve.core import outputs
        return getattr(outputs, name)
    if name == "AsyncLLM":
        from jaxserve.engine.async_llm import AsyncLLM
        return AsyncLLM
    if name == "LoRARequest":
        from jaxserve.lora.request import LoRARequest
        return LoRARequest
    if name == "EngineArgs":
        from jaxserve.args import EngineArgs
        return EngineArgs
    if name == "LLMEngine":
        from jaxserve.engine.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)
