"""``EngineClient``: what a front end (the OpenAI server) may ask of an engine.

Three classes implement it: ``AsyncLLM`` (the engine loop on a thread of this process),
``EngineCoreClient`` (the engine core in its own process, over ZeroMQ) and
``DataParallelAsyncLLM`` (one ``AsyncLLM`` per replica). A new front end or engine kind talks
through this and nothing else.
"""
from __future__ import annotations

from typing import Any, AsyncIterator, Protocol, runtime_checkable

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.sampling_params import SamplingParams


@runtime_checkable
class EngineClient(Protocol):
    config: EngineConfig  # resolved: the model actually served, the platform's limits
    tokenizer: Any  # the HF tokenizer (chat templates, detokenization in the front end)
    model_config: ModelConfig
    max_model_len: int
    default_sampling: dict  # the model's generation-config defaults for unset sampling fields
    served_model_name: str
    chat_template: str | None  # the server's --chat-template, when it sets one
    takes_images: bool  # prompts may carry multi_modal_data images (a VLM's encoder is on)

    def generate(self, prompt: str | list[int], sampling_params: SamplingParams | None,
                 request_id: str, *, priority: int = 0, lora_request=None
                 ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as it runs (the last one has ``finished``); leaving the
        iteration early aborts the request. Bad input raises ``InvalidRequestError``.
        ``lora_request``: the ``LoRARequest`` it runs with (None: the base model)."""

    async def add_lora(self, lora_request) -> bool:
        """Load and check an adapter before its requests; raises naming it."""

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; False if it was not loaded."""

    async def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends. Unknown ids are ignored."""

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix page; False (nothing dropped) while pages are in use."""

    def check_health(self) -> None:
        """Raise ``EngineDeadError`` when the engine loop is gone."""

    @property
    def is_running(self) -> bool:
        """The engine loop is alive."""

    def startup_progress(self) -> tuple[bool, int, int]:
        """(ready to serve without waiting for a compile, buckets compiled, buckets)."""

    def stats(self) -> dict:
        """Scheduler and engine gauges and counters (vLLM's metric names, unprefixed)."""

    async def shutdown(self) -> None:
        """Stop the engine; no thread or process outlives it."""
