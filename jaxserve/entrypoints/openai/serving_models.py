"""``/v1/models``, ``/tokenize`` and ``/detokenize``: what is served and how it tokenizes;
the runtime LoRA routes (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``)."""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from jaxserve.entrypoints.openai import protocol as P
from jaxserve.entrypoints.openai import protocol_chat as PC
from jaxserve.errors import InvalidRequestError
from jaxserve.entrypoints.openai.responses import JSONModel
from jaxserve.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingModels(OpenAIServing):
    """The model list and the tokenizer routes."""

    async def models(self, request: Request) -> Response:
        root = getattr(self.engine.config, "model", None)
        cards = self.models_registry.cards(P.ModelCard, root, self.engine.max_model_len)
        return JSONModel(P.ModelList(data=cards))

    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}``."""
        body = await self._body(request)
        if not isinstance(body, dict):
            raise InvalidRequestError("the body must be a JSON object")
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            raise InvalidRequestError("Both 'lora_name' and 'lora_path' must be provided.",
                                      param="lora_name")
        await self.models_registry.load(name, path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: Request) -> Response:
        """vLLM's ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``."""
        body = await self._body(request)
        name = body.get("lora_name") if isinstance(body, dict) else None
        if not name:
            raise InvalidRequestError("'lora_name' needs to be provided to unload a LoRA "
                                      "adapter.", param="lora_name")
        await self.models_registry.unload(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def tokenize(self, request: Request) -> Response:
        body = await self._body(request)
        if isinstance(body, dict) and "messages" in body:
            req = P.parse_request(PC.TokenizeChatRequest, body)
            self._model_name(req.model)
            ids = await self._chat_ids(req)
        else:
            req = P.parse_request(P.TokenizeCompletionRequest, body)
            self._model_name(req.model)
            ids = await self._encode(req.prompt, req.add_special_tokens)
        strs = None
        if req.return_token_strs:
            strs = await self._off_loop(
                lambda: list(self.engine.tokenizer.convert_ids_to_tokens(ids)))
        return JSONModel(P.TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len,
                                        tokens=ids, token_strs=strs))

    async def detokenize(self, request: Request) -> Response:
        req = P.parse_request(P.DetokenizeRequest, await self._body(request))
        self._model_name(req.model)
        vocab = len(self.engine.tokenizer)
        for j, t in enumerate(req.tokens):
            if not 0 <= t < vocab:
                raise InvalidRequestError(f"token id {t} is out of range [0, {vocab})",
                                          param=f"tokens.{j}")
        text = await self._off_loop(self.engine.tokenizer.decode, req.tokens)
        return JSONModel(P.DetokenizeResponse(prompt=text))

