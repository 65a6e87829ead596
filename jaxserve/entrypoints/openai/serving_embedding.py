"""``POST /v1/embeddings`` (OpenAI), ``/pooling`` and ``/classify`` (vLLM) over a pooling
engine (``--runner pooling``).

Each input is tokenized here (off the event loop) and sent to the core as its own request, so
inputs of one call batch with every other client's in the core's packed steps. A generative
server answers these routes with a 400 naming its runner (and the reverse, serving_chat /
serving_completion through ``require_generate``).
"""
from __future__ import annotations

import asyncio
import base64
import time

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.core.pooling_params import PoolingOutput, PoolingParams
from jaxserve.engine.pooling_inputs import pooling_prompt_ids
from jaxserve.entrypoints.openai import protocol as P
from jaxserve.entrypoints.openai import protocol_pooling as PP
from jaxserve.entrypoints.openai.serving_engine import OpenAIServing, header_id
from jaxserve.errors import InvalidRequestError


def runner_of(engine) -> str:
    return getattr(engine, "runner_type", "generate")


class OpenAIServingPooling(OpenAIServing):
    """The embedding, pooling and classification routes."""

    def require_runner(self, want: str, route: str) -> None:
        have = runner_of(self.engine)
        if have != want:
            hint = ("serve an embedding / reranking / classification model with --runner "
                    "pooling" if want == "pooling" else
                    "this model embeds, scores and classifies: use /v1/embeddings, /pooling, "
                    "/score, /rerank or /classify")
            raise InvalidRequestError(f"{route} needs a model served with --runner {want}; "
                                      f"this server runs {self.names[0]} with --runner {have} "
                                      f"({hint})", param="model")

    async def _pool_inputs(self, inputs: list, params: PoolingParams, request_id: str,
                           pairs: list | None = None, param: str = "input"
                           ) -> list[PoolingOutput]:
        """Tokenize every input, send each to the core, await them all (the first error
        aborts the rest)."""
        self._admit()
        self.engine.check_health()
        if not inputs:
            raise InvalidRequestError(f"{param} is empty", param=param)
        if len(inputs) > PP.MAX_POOLING_INPUTS:
            raise InvalidRequestError(f"{param} has {len(inputs)} items; at most "
                                      f"{PP.MAX_POOLING_INPUTS} per request", param=param)
        max_len = self.engine.max_model_len
        tokenized = []
        for i, x in enumerate(inputs):
            pair = pairs[i] if pairs is not None else None
            if isinstance(x, str):
                self._check_prompt_bytes(len(x.encode()) if params.truncate_prompt_tokens is None
                                         else 0, param)
            tokenized.append(await self._off_loop(
                pooling_prompt_ids, self.engine.tokenizer, x, params, max_len, pair,
                f"{param}.{i}" if len(inputs) > 1 else param))
        tasks = [asyncio.ensure_future(self.engine.encode(ids, params, f"{request_id}-{i}",
                                                          token_type_ids=types))
                 for i, (ids, types) in enumerate(tokenized)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()

    def _pooling_params(self, req, task: str, **kw) -> PoolingParams:
        return PoolingParams(task=task, truncate_prompt_tokens=req.truncate_prompt_tokens, **kw)

    # -- /v1/embeddings ------------------------------------------------------------------------
    async def embeddings(self, request: Request) -> Response:
        if getattr(self.engine, "pooling_info", None) is None:  # a generative decoder embeds too
            self.require_runner("pooling", "/v1/embeddings")
        req: PP.EmbeddingRequest = P.parse_request(PP.EmbeddingRequest, await self._body(request))
        model = self._model_name(req.model)
        params = self._pooling_params(req, "embed", dimensions=req.dimensions,
                                      normalize=req.normalize)
        rid = req.request_id or header_id(request) or P.random_id("embd")
        outs = await self._pool_inputs(PP.input_list(req.input), params, rid)
        data = [{"index": i, "object": "embedding",
                 "embedding": _encode_vector(o.data, req.encoding_format)}
                for i, o in enumerate(outs)]
        return JSONResponse(_list_body(rid, model, data, outs))

    # -- /pooling --------------------------------------------------------------------------------
    async def pooling(self, request: Request) -> Response:
        self.require_runner("pooling", "/pooling")
        req: PP.PoolingRequest = P.parse_request(PP.PoolingRequest, await self._body(request))
        model = self._model_name(req.model)
        info = self.engine.pooling_info
        task = req.task or ("token_embed" if info.pooling_type in ("ALL", "STEP") else
                            "classify" if info.num_labels else "embed")
        params = self._pooling_params(req, task, dimensions=req.dimensions,
                                      normalize=req.normalize)
        rid = req.request_id or header_id(request) or P.random_id("pool")
        outs = await self._pool_inputs(PP.input_list(req.input), params, rid)
        data = [{"index": i, "object": "pooling",
                 "data": _encode_vector(o.data, req.encoding_format)}
                for i, o in enumerate(outs)]
        return JSONResponse(_list_body(rid, model, data, outs))

    # -- /classify -------------------------------------------------------------------------------
    async def classify(self, request: Request) -> Response:
        self.require_runner("pooling", "/classify")
        req: PP.ClassificationRequest = P.parse_request(PP.ClassificationRequest,
                                                        await self._body(request))
        model = self._model_name(req.model)
        params = self._pooling_params(req, "classify", use_activation=req.use_activation)
        rid = req.request_id or header_id(request) or P.random_id("classify")
        outs = await self._pool_inputs(PP.input_list(req.input), params, rid)
        labels = self.engine.pooling_info.id2label
        data = []
        for i, o in enumerate(outs):
            probs = o.data.reshape(-1)
            best = int(np.argmax(probs))
            data.append({"index": i, "label": labels.get(best, str(best)),
                         "probs": probs.tolist(), "num_classes": int(probs.size)})
        return JSONResponse(_list_body(rid, model, data, outs))


def _encode_vector(x: np.ndarray, fmt: str):
    """float: nested lists; base64: the little-endian float32 bytes (OpenAI's encoding)."""
    if fmt == "base64":
        return base64.b64encode(np.ascontiguousarray(x, "<f4").tobytes()).decode()
    return x.tolist()


def _list_body(rid: str, model: str, data: list, outs: list[PoolingOutput]) -> dict:
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    return {"id": rid, "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens,
                                    "completion_tokens": 0}}
