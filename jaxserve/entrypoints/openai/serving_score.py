"""``POST /score`` and ``/rerank`` (also ``/v1/score``, ``/v1/rerank``, ``/v2/rerank``: Jina and
Cohere's shape) over a pooling engine.

A cross-encoder (a model with a classification head) reads each (query, document) pair as one
input with BERT's token types; an embedder embeds every text once and scores by cosine
similarity, as vLLM does.
"""
from __future__ import annotations

import time

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.core.pooling_params import PoolingParams
from jaxserve.core.scoring import cosine, score_pairs
from jaxserve.entrypoints.openai import protocol as P
from jaxserve.entrypoints.openai import protocol_pooling as PP
from jaxserve.entrypoints.openai.serving_embedding import OpenAIServingPooling
from jaxserve.entrypoints.openai.serving_engine import header_id
from jaxserve.errors import InvalidRequestError


class OpenAIServingScore(OpenAIServingPooling):
    """The scoring routes."""

    async def _scores(self, req, pairs: list[tuple[str, str]], rid: str, names
                      ) -> tuple[list[float], int]:
        """One score per pair and the prompt tokens read."""
        if self.engine.pooling_info.num_labels:
            if self.engine.pooling_info.num_labels != 1:
                raise InvalidRequestError(
                    f"scoring needs a model with one output; {self.names[0]} has "
                    f"{self.engine.pooling_info.num_labels} (use /classify)", param="model")
            params = PoolingParams(task="score", truncate_prompt_tokens=req.truncate_prompt_tokens,
                                   use_activation=req.use_activation)
            outs = await self._pool_inputs([a for a, _ in pairs], params, rid,
                                           pairs=[b for _, b in pairs], param=names[1])
            return ([float(o.data.reshape(-1)[0]) for o in outs],
                    sum(len(o.prompt_token_ids) for o in outs))
        if req.use_activation is not None:
            raise InvalidRequestError("use_activation applies to a cross-encoder; this model "
                                      "scores by cosine similarity", param="use_activation")
        params = PoolingParams(task="embed", truncate_prompt_tokens=req.truncate_prompt_tokens)
        texts = list(dict.fromkeys(t for p in pairs for t in p))
        outs = await self._pool_inputs(texts, params, rid, param=names[1])
        vec = {t: o.data for t, o in zip(texts, outs)}
        return ([cosine(vec[a], vec[b]) for a, b in pairs],
                sum(len(o.prompt_token_ids) for o in outs))

    # -- /score ----------------------------------------------------------------------------------
    async def score(self, request: Request) -> Response:
        self.require_runner("pooling", "/score")
        req: PP.ScoreRequest = P.parse_request(PP.ScoreRequest, await self._body(request))
        model = self._model_name(req.model)
        pairs = score_pairs(req.text_1, req.text_2)
        if len(pairs) > PP.MAX_RERANK_DOCUMENTS:
            raise InvalidRequestError(f"text_2 has {len(pairs)} items; at most "
                                      f"{PP.MAX_RERANK_DOCUMENTS} per request", param="text_2")
        rid = req.request_id or header_id(request) or P.random_id("score")
        scores, tokens = await self._scores(req, pairs, rid, ("text_1", "text_2"))
        return JSONResponse({
            "id": rid, "object": "list", "created": int(time.time()), "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}})

    # -- /rerank ---------------------------------------------------------------------------------
    async def rerank(self, request: Request) -> Response:
        self.require_runner("pooling", request.url.path)
        req: PP.RerankRequest = P.parse_request(PP.RerankRequest, await self._body(request))
        model = self._model_name(req.model)
        if not req.documents:
            raise InvalidRequestError("documents is empty", param="documents")
        if len(req.documents) > PP.MAX_RERANK_DOCUMENTS:
            raise InvalidRequestError(f"documents has {len(req.documents)} items; at most "
                                      f"{PP.MAX_RERANK_DOCUMENTS} per request (split the "
                                      "request)", param="documents")
        rid = req.request_id or header_id(request) or P.random_id("rerank")
        pairs = [(req.query, d) for d in req.documents]
        scores, tokens = await self._scores(req, pairs, rid, ("query", "documents"))
        order = np.argsort(-np.asarray(scores), kind="stable")
        if req.top_n:
            order = order[:req.top_n]
        results = []
        for i in order:
            r = {"index": int(i), "relevance_score": scores[i]}
            if req.return_documents:
                r["document"] = {"text": req.documents[i]}
            results.append(r)
        return JSONResponse({"id": rid, "model": model, "usage": {"total_tokens": tokens},
                             "results": results})
