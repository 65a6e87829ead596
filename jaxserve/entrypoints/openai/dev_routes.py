"""vLLM's development endpoints, on only with ``JAXSERVE_SERVER_DEV_MODE=1`` (or vLLM's
``VLLM_SERVER_DEV_MODE=1``): ``POST /sleep?level=``, ``POST /wake_up?tags=``,
``GET /is_sleeping``, and ``POST /update_weights`` (new weights from a path on the server's
disk, ``{"path": ..., "in_flight": "wait" | "abort"}``). Without the flag the paths do not
exist (404); with ``--api-key`` they need the key like ``/v1``. They let anyone with access
change or stop the model, hence the flag.
"""
from __future__ import annotations

import json
import os

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jaxserve.errors import InvalidRequestError

DEV_MODE_ENVS = ("JAXSERVE_SERVER_DEV_MODE", "VLLM_SERVER_DEV_MODE")
DEV_PATHS = ("/sleep", "/wake_up", "/is_sleeping", "/update_weights")
UPDATE_FIELDS = ("path", "in_flight")


def dev_mode_enabled() -> bool:
    return any(os.environ.get(k, "0").lower() in ("1", "true", "yes") for k in DEV_MODE_ENVS)


def dev_routes(engine) -> list[Route]:
    """The routes over ``engine`` (an ``EngineClient`` with ``call_utility``)."""

    async def call(method: str, **kwargs):
        fn = getattr(engine, "call_utility", None)
        if fn is None:
            raise InvalidRequestError(f"/{method} is not supported by this engine "
                                      f"({type(engine).__name__}: data parallel)", status_code=501)
        return await fn(method, **kwargs)

    async def sleep(request: Request) -> Response:
        raw = request.query_params.get("level", "1")
        try:
            level = int(raw)
        except ValueError:
            raise InvalidRequestError(f"level: expected 1 or 2, got {raw!r}",
                                      param="level") from None
        await call("sleep", level=level)
        return Response(status_code=200)

    async def wake_up(request: Request) -> Response:
        tags = request.query_params.getlist("tags") or None
        await call("wake_up", tags=tags)
        return Response(status_code=200)

    async def is_sleeping(request: Request) -> Response:
        return JSONResponse({"is_sleeping": bool(await call("is_sleeping"))})

    async def update_weights(request: Request) -> Response:
        try:
            body = json.loads(await request.body() or b"{}")
        except ValueError:
            raise InvalidRequestError("the body is not valid JSON") from None
        if not isinstance(body, dict):
            raise InvalidRequestError("the body must be a JSON object")
        extra = sorted(set(body) - set(UPDATE_FIELDS))
        if extra:
            raise InvalidRequestError(f"unknown field {extra[0]!r} (expected "
                                      f"{', '.join(UPDATE_FIELDS)})", param=extra[0])
        path = body.get("path")
        if not isinstance(path, str) or not path:
            raise InvalidRequestError("path: a safetensors or orbax checkpoint path on the "
                                      "server is required", param="path")
        in_flight = body.get("in_flight", "wait")
        done = await call("update_weights", weights=path, in_flight=in_flight)
        return JSONResponse({"updated": bool(done), "pending": not done})

    return [Route("/sleep", sleep, methods=["POST"]),
            Route("/wake_up", wake_up, methods=["POST"]),
            Route("/is_sleeping", is_sleeping, methods=["GET"]),
            Route("/update_weights", update_weights, methods=["POST"])]
