"""``jaxserve proxy``: two-step routing for disaggregated prefill and decode, for users without
llm-d (vLLM's toy proxy, as a command).

Each completions or chat request goes first to a prefill instance (round robin) with
``kv_transfer_params {"do_remote_decode": true}``, ``max_tokens`` 1, ``n`` 1 and no stream: it
computes the prompt's KV and answers with the params that locate it. The original request then
goes to a decode instance (round robin) with those params; the decode instance pulls the KV and
generates, and its answer (streamed or not) is passed back unchanged. Other routes
(``/v1/models``, ``/tokenize`` ...) go to a decode instance. No jax here: HTTP only.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import logging
import uuid

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

logger = logging.getLogger(__name__)

GENERATE_ROUTES = ("/v1/completions", "/v1/chat/completions")
# request headers passed on (authorization, ids); the rest are the proxy's own hop
FORWARDED_HEADERS = ("authorization", "x-request-id", "content-type")


def _error(status: int, message: str, type_: str = "BadGateway") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": None,
                                   "code": status}}, status_code=status)


class DisaggProxy:
    """Round robin over prefill and decode instances (base URLs such as
    ``http://10.0.0.1:8000``)."""

    def __init__(self, prefill: list[str], decode: list[str], timeout: float = 600.0):
        if not prefill or not decode:
            raise ValueError("the proxy needs at least one --prefill and one --decode URL")
        for url in (*prefill, *decode):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"instance URL {url!r} must start with http:// or https://")
        self.prefill = [u.rstrip("/") for u in prefill]
        self.decode = [u.rstrip("/") for u in decode]
        self._next_prefill = itertools.cycle(self.prefill)
        self._next_decode = itertools.cycle(self.decode)
        self.timeout = timeout
        self.client: httpx.AsyncClient | None = None

    def app(self) -> Starlette:
        routes = [Route(path, self.generate, methods=["POST"]) for path in GENERATE_ROUTES]
        routes += [Route("/health", self.health, methods=["GET"]),
                   Route("/{path:path}", self.forward, methods=["GET", "POST"])]
        return Starlette(routes=routes, lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout, connect=10.0))
        try:
            yield
        finally:
            await self.client.aclose()

    @staticmethod
    def _headers(request: Request, request_id: str) -> dict:
        h = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        h["x-request-id"] = request_id
        return h

    async def generate(self, request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except json.JSONDecodeError as e:
            return _error(400, f"the request body is not JSON: {e}", "BadRequestError")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "BadRequestError")
        if body.get("kv_transfer_params") is not None:
            return _error(400, "kv_transfer_params is set by the proxy; send the request "
                               "without it", "BadRequestError")
        path = request.url.path
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        headers = self._headers(request, request_id)
        prefill = dict(body, kv_transfer_params={"do_remote_decode": True}, stream=False,
                       max_tokens=1, n=1)
        prefill.pop("stream_options", None)
        if "max_completion_tokens" in prefill:
            prefill["max_completion_tokens"] = 1
        pre_url = next(self._next_prefill)
        try:
            pre = await self.client.post(pre_url + path, json=prefill, headers=headers)
        except httpx.HTTPError as e:
            return _error(502, f"prefill instance {pre_url} failed: {type(e).__name__}: {e}")
        if pre.status_code != 200:  # a bad request, said by the instance that read it
            return Response(pre.content, status_code=pre.status_code,
                            media_type=pre.headers.get("content-type"))
        params = pre.json().get("kv_transfer_params")
        decode = dict(body, kv_transfer_params=params) if params else dict(body)
        dec_url = next(self._next_decode)
        req = self.client.build_request("POST", dec_url + path, json=decode, headers=headers)
        try:
            resp = await self.client.send(req, stream=True)
        except httpx.HTTPError as e:
            return _error(502, f"decode instance {dec_url} failed: {type(e).__name__}: {e}")
        if not body.get("stream") or resp.status_code != 200:
            content = await resp.aread()
            await resp.aclose()
            return Response(content, status_code=resp.status_code,
                            media_type=resp.headers.get("content-type"))
        return StreamingResponse(self._relay(resp), status_code=resp.status_code,
                                 media_type=resp.headers.get("content-type"))

    @staticmethod
    async def _relay(resp: httpx.Response):
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        finally:
            await resp.aclose()

    async def health(self, request: Request) -> Response:
        """200 when every instance answers its /health; else 503 naming those that do not."""
        down = []
        for url in (*self.prefill, *self.decode):
            try:
                ok = (await self.client.get(url + "/health", timeout=5)).status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                down.append(url)
        if down:
            return _error(503, f"instances not healthy: {down}", "ServiceUnavailable")
        return Response(status_code=200)

    async def forward(self, request: Request) -> Response:
        url = next(self._next_decode) + "/" + request.path_params["path"]
        try:
            resp = await self.client.request(
                request.method, url, content=await request.body(),
                params=request.query_params,
                headers={k: v for k, v in request.headers.items()
                         if k.lower() in FORWARDED_HEADERS})
        except httpx.HTTPError as e:
            return _error(502, f"decode instance failed: {type(e).__name__}: {e}")
        return Response(resp.content, status_code=resp.status_code,
                        media_type=resp.headers.get("content-type"))


def run_proxy(prefill: list[str], decode: list[str], host: str, port: int,
              log_level: str = "info") -> None:
    import uvicorn

    uvicorn.run(DisaggProxy(prefill, decode).app(), host=host, port=port, log_level=log_level)
