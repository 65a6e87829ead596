"""The OpenAI-compatible HTTP server: routes, middleware and lifecycle of a Starlette app around
one ``AsyncLLM``, served by uvicorn.

Every request is validated (JSON, schema, model name, lengths) before it reaches the engine, and
every failure leaves as an OpenAI-style JSON error with a 4xx code; only real bugs are 500s.
Streams are Server-Sent Events ending in ``data: [DONE]``. A client that goes away cancels its
engine stream, which aborts the request and frees its KV pages.

No request can hurt another: the engine keys requests by ids generated here (a client's
``request_id`` / ``X-Request-Id`` is only echoed), tokenization runs off the event loop, and a
prompt too long by its byte count alone is rejected before it is tokenized. On SIGTERM the
server drains: 503 for anything new, ``--shutdown-timeout`` seconds for requests in flight, then
an error (in-band on a stream, followed by ``[DONE]``) for the rest.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import h11
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

import jaxserve
from jaxserve.engine.protocol import EngineClient
from jaxserve.errors import EngineDeadError, InvalidRequestError
from jaxserve.entrypoints.openai.metrics import ServerMetrics
from jaxserve.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from jaxserve.entrypoints.openai.tool_parsers import get_tool_parser
from jaxserve.entrypoints.openai.middleware import BearerAuth, BodyLimit, RequestIdHeader
from jaxserve.entrypoints.openai.responses import (ClientGone, ServerShuttingDown,
                                                   error_from_exception, error_response)
from jaxserve.entrypoints.openai.serving_chat import OpenAIServingChat
from jaxserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from jaxserve.entrypoints.openai.serving_engine import MAX_BODY_BYTES, load_chat_template
from jaxserve.entrypoints.openai.serving_models import OpenAIServingModels
from jaxserve.entrypoints.openai.serving_score import OpenAIServingScore
from jaxserve.entrypoints.openai.lora_models import runtime_lora_updating
from jaxserve.entrypoints.openai.dev_routes import dev_mode_enabled, dev_routes

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 20.0  # default --shutdown-timeout: inside Kubernetes' default 30 s grace
HEADER_TIMEOUT_S = 10  # a connection must send a whole request head within this
KEEP_ALIVE_S = 5  # uvicorn's default idle keep-alive


class OpenAIServer(OpenAIServingChat, OpenAIServingCompletion, OpenAIServingScore,
                   OpenAIServingModels):
    """Every route handler over one engine, plus the operational endpoints; ``build_app``
    wires them to paths."""

    async def health(self, request: Request) -> Response:
        self._admit()
        self.engine.check_health()
        progress = getattr(self.engine, "startup_progress", None)
        if progress is not None:
            ready, k, n = progress()
            if not ready:  # buckets still compiling: up, not yet ready for traffic
                return JSONResponse({"status": "starting", "buckets_ready": k, "of": n},
                                    status_code=503)
        return Response(status_code=200)

    async def load(self, request: Request) -> Response:
        """vLLM's ``/load``: requests in flight on this server (a router's balancing signal)."""
        return JSONResponse({"server_load": self.num_inflight})

    async def reset_prefix_cache(self, request: Request) -> Response:
        """vLLM's ``POST /reset_prefix_cache``: forget the cached prefix pages (e.g. between
        benchmark runs). Only possible while no request holds pages: else 409, nothing dropped."""
        if not await self.engine.reset_prefix_cache():
            return error_response("the prefix cache cannot be reset while requests hold KV "
                                  "pages; retry when the server is idle", 409)
        return JSONResponse({"reset": True})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": jaxserve.__version__})

    async def render_metrics(self, request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def build_app(engine: EngineClient, *, api_key: str | None = None,
              served_model_names: list[str] | str | None = None,
              chat_template: str | None = None,
              max_body_bytes: int = MAX_BODY_BYTES, enable_auto_tool_choice: bool = False,
              tool_call_parser: str | None = None, reasoning_parser: str | None = None,
              trust_request_chat_template: bool = False, cors: dict | None = None,
              log_requests: bool = False, max_log_len: int | None = None,
              response_role: str = "assistant", metrics_prefix: str = "jaxserve",
              lora_modules: list[dict] | None = None) -> Starlette:
    """The Starlette app over ``engine`` (an ``AsyncLLM``). ``app.state`` holds the engine,
    the route handlers (``serving``: draining on shutdown) and the metrics registry
    (``metrics_prefix``: ``jaxserve`` or ``vllm``)."""
    if isinstance(served_model_names, str):
        served_model_names = [served_model_names]
    names = list(served_model_names or [engine.served_model_name])
    metrics = ServerMetrics(engine.stats, names[0], metrics_prefix)
    serving = OpenAIServer(engine, names, load_chat_template(chat_template), metrics,
                            max_body_bytes=max_body_bytes,
                            enable_auto_tool_choice=enable_auto_tool_choice,
                            tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser,
                            trust_request_chat_template=trust_request_chat_template,
                            log_requests=log_requests, max_log_len=max_log_len,
                            response_role=response_role, lora_modules=lora_modules)

    async def on_error(request: Request, exc: Exception) -> Response:
        if isinstance(exc, HTTPException):
            return error_response(exc.detail or "error", exc.status_code)
        body, status = error_from_exception(exc, engine)
        return JSONResponse(body, status_code=status)

    def generative(handler, route: str):
        """A generation route: a 400 naming the runner on a pooling server."""
        async def run(request: Request) -> Response:
            serving.require_runner("generate", route)
            return await handler(request)
        return run

    routes = [
        Route("/v1/completions", generative(serving.completions, "/v1/completions"),
              methods=["POST"]),
        Route("/v1/chat/completions", generative(serving.chat_completions,
                                                 "/v1/chat/completions"), methods=["POST"]),
        Route("/v1/embeddings", serving.embeddings, methods=["POST"]),
        Route("/pooling", serving.pooling, methods=["POST"]),
        Route("/classify", serving.classify, methods=["POST"]),
        Route("/score", serving.score, methods=["POST"]),
        Route("/v1/score", serving.score, methods=["POST"]),
        Route("/rerank", serving.rerank, methods=["POST"]),
        Route("/v1/rerank", serving.rerank, methods=["POST"]),
        Route("/v2/rerank", serving.rerank, methods=["POST"]),
        Route("/v1/models", serving.models, methods=["GET"]),
        Route("/tokenize", serving.tokenize, methods=["POST"]),
        Route("/detokenize", serving.detokenize, methods=["POST"]),
        Route("/health", serving.health, methods=["GET"]),
        Route("/ping", serving.health, methods=["GET", "POST"]),  # SageMaker's health check
        Route("/load", serving.load, methods=["GET"]),
        Route("/version", serving.version, methods=["GET"]),
        Route("/reset_prefix_cache", serving.reset_prefix_cache, methods=["POST"]),
        Route("/metrics", serving.render_metrics, methods=["GET"]),
    ]
    if dev_mode_enabled():  # vLLM's /sleep, /wake_up, /is_sleeping, plus /update_weights
        routes += dev_routes(engine)
    if runtime_lora_updating():
        routes += [Route("/v1/load_lora_adapter", serving.load_lora_adapter, methods=["POST"]),
                   Route("/v1/unload_lora_adapter", serving.unload_lora_adapter,
                         methods=["POST"])]
    async def client_gone(request: Request, exc: Exception) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    handlers = {HTTPException: on_error, InvalidRequestError: on_error,
                EngineDeadError: on_error, ServerShuttingDown: on_error, ValueError: on_error,
                ClientGone: client_gone, ClientDisconnect: client_gone, Exception: on_error}
    app = Starlette(routes=routes, exception_handlers=handlers)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)  # before auth: nothing is read
    app.add_middleware(RequestIdHeader)  # 401s carry the id too
    if cors is not None:  # outermost: preflight requests are answered without a key, like vLLM
        app.add_middleware(CORSMiddleware, allow_origins=cors["allowed_origins"],
                           allow_methods=cors["allowed_methods"],
                           allow_headers=cors["allowed_headers"],
                           allow_credentials=cors["allow_credentials"],
                           expose_headers=["X-Request-Id"])
    app.state.engine = engine
    app.state.serving = serving
    app.state.metrics = metrics
    app.state.served_model_names = names
    return app


# ---- running it ------------------------------------------------------------------------------
def startup_message(engine: EngineClient, host: str, port: int, names: list[str]) -> str:
    s = engine.stats()
    dtype = (getattr(engine, "dtype", None) or getattr(getattr(engine, "engine", None), "dtype", None)
             or engine.config.dtype)
    dtype = getattr(dtype, "__name__", None) or getattr(dtype, "name", None) or str(dtype)
    shown = "localhost" if host in ("127.0.0.1", "::1") else host
    info = (getattr(engine, "pooling_info", None)
            if getattr(engine, "runner_type", "generate") == "pooling" else None)
    cache = (f"pooling runner ({info.pooling_type} pooling, {info.hidden_size} dims"
             f"{', normalized' if info.normalize and not info.num_labels else ''}"
             f"{f', {info.num_labels} labels' if info.num_labels else ''})" if info is not None
             else f"{s.get('num_pages', '?')} KV pages of {engine.config.cache.block_size} tokens")
    return (f"jaxserve ready: model {engine.config.model or names[0]!s} served as "
            f"{', '.join(names)} | dtype {dtype} | {cache} | max_model_len {engine.max_model_len} | "
            f"{s.get('num_compiles', '?')} compiles in warm-up | "
            f"OpenAI API at http://{shown}:{port}/v1")


class _HeaderTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol, plus a deadline for a request's headers: a connection that has
    not sent a whole request head within ``header_timeout`` seconds of connecting (or of the
    first byte of a later request) is closed, so half-open connections cannot pile up.
    Trickling bytes does not extend the deadline."""

    header_timeout: float = HEADER_TIMEOUT_S

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_timeout)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            if self._head_timer is not None:  # the request head is in
                self._head_timer.cancel()
                self._head_timer = None
        elif self._head_timer is None and not self.transport.is_closing():
            # part of a later request's head: idle keep-alive time is uvicorn's to limit
            self._head_timer = self.loop.call_later(self.header_timeout, self._head_timeout)

    def connection_lost(self, exc) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


class _DrainingServer(uvicorn.Server):
    """uvicorn that drains on the first SIGTERM/SIGINT: admit nothing new (503), give requests
    in flight ``shutdown_timeout`` seconds, end the rest with an error (a stream's last chunks
    are the error and ``[DONE]``), then stop. A second signal stops at once, like uvicorn."""

    def __init__(self, config, serving: OpenAIServer, shutdown_timeout: float):
        super().__init__(config)
        self.serving = serving
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        if self._draining or self._loop is None or self.should_exit:
            return super().handle_exit(sig, frame)
        self._draining = True
        self._captured_signals.append(sig)
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self.drain()))

    async def drain(self) -> None:
        serving = self.serving
        serving.start_draining()
        logger.info("shutting down: new requests get 503; waiting up to %.0f s for %d in flight",
                    self.shutdown_timeout, serving.num_inflight)
        deadline = time.monotonic() + self.shutdown_timeout
        while serving.num_inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if serving.num_inflight:
            logger.warning("ending %d requests still running after --shutdown-timeout %.0f s",
                           serving.num_inflight, self.shutdown_timeout)
            serving.end_inflight()
            deadline = time.monotonic() + 5.0
            while serving.num_inflight and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        self.should_exit = True


def check_ssl_files(ssl_keyfile: str | None, ssl_certfile: str | None) -> None:
    if (ssl_keyfile is None) != (ssl_certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together: give both or neither")
    for name, f in (("--ssl-keyfile", ssl_keyfile), ("--ssl-certfile", ssl_certfile)):
        if f is not None and not os.path.isfile(f):
            raise ValueError(f"{name} {f!r} is not a file")


def uvicorn_config(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                   timeout_graceful_shutdown: int = 5,
                   header_timeout: float = HEADER_TIMEOUT_S, root_path: str = "",
                   ssl_keyfile: str | None = None,
                   ssl_certfile: str | None = None) -> uvicorn.Config:
    """The uvicorn settings of ``jaxserve serve`` (the header deadline, keep-alive; behind a
    path-prefixing proxy ``root_path``; HTTPS with ``ssl_keyfile`` + ``ssl_certfile``)."""
    check_ssl_files(ssl_keyfile, ssl_certfile)
    protocol = type("H11Protocol", (_HeaderTimeoutH11,), {"header_timeout": header_timeout})
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol,
                          timeout_keep_alive=KEEP_ALIVE_S,
                          timeout_graceful_shutdown=timeout_graceful_shutdown,
                          root_path=root_path, ssl_keyfile=ssl_keyfile,
                          ssl_certfile=ssl_certfile)


def run_server(engine_config, host: str = "127.0.0.1", port: int = 8000,
               api_key: str | None = None, uvicorn_log_level: str = "info",
               served_model_names: list[str] | None = None, chat_template: str | None = None,
               timeout_graceful_shutdown: int = 5, shutdown_timeout: float = SHUTDOWN_TIMEOUT_S,
               max_body_bytes: int = MAX_BODY_BYTES, enable_auto_tool_choice: bool = False,
               tool_call_parser: str | None = None, reasoning_parser: str | None = None,
               trust_request_chat_template: bool = False, cors: dict | None = None,
               log_requests: bool = False, max_log_len: int | None = None,
               response_role: str = "assistant", log_stats: bool = True, root_path: str = "",
               ssl_keyfile: str | None = None, ssl_certfile: str | None = None,
               metrics_prefix: str = "jaxserve", lora_modules: list[dict] | None = None
               ) -> None:
    """Load the engine, serve until SIGINT/SIGTERM, drain (``shutdown_timeout``), then stop
    uvicorn and the engine cleanly. ``log_stats``: the periodic stats log lines."""
    from jaxserve.engine.core_client import EngineCoreClient, use_core_process

    template = load_chat_template(chat_template)  # fail before the slow model load
    if tool_call_parser is not None:
        get_tool_parser(tool_call_parser)
    if reasoning_parser is not None:
        get_reasoning_parser(reasoning_parser)
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    check_ssl_files(ssl_keyfile, ssl_certfile)
    from jaxserve.loaders.sentence_transformers import uses_pooling_runner

    if uses_pooling_runner(engine_config) and not use_core_process(engine_config):
        raise ValueError("--runner pooling serves from the engine core process: it needs "
                         "--data-parallel-size 1, one host and JAXSERVE_ENABLE_MULTIPROCESSING "
                         "unset or 1")
    t0 = time.perf_counter()
    if use_core_process(engine_config):
        # the device loop in its own process; it serves while its buckets compile (/health
        # says "starting" until it is ready, and early requests wait)
        engine = EngineCoreClient(engine_config)
    else:
        from jaxserve.engine.data_parallel import make_async_llm

        # DP replicas and multi-host: in this process. One replica serves while its buckets
        # compile, like the core process.
        engine = make_async_llm(engine_config, background_warmup=True)
    logger.info("engine loaded in %.1f s; compiling in the background", time.perf_counter() - t0)
    app = build_app(engine, api_key=api_key, served_model_names=served_model_names,
                    chat_template=template, max_body_bytes=max_body_bytes,
                    enable_auto_tool_choice=enable_auto_tool_choice,
                    tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser,
                    trust_request_chat_template=trust_request_chat_template, cors=cors,
                    log_requests=log_requests, max_log_len=max_log_len,
                    response_role=response_role, metrics_prefix=metrics_prefix,
                    lora_modules=lora_modules)
    names = app.state.served_model_names
    config = uvicorn_config(app, host, port, uvicorn_log_level, timeout_graceful_shutdown,
                            root_path=root_path, ssl_keyfile=ssl_keyfile,
                            ssl_certfile=ssl_certfile)
    server = _DrainingServer(config, app.state.serving, shutdown_timeout)
    # uvicorn re-raises the signal that stopped it; with these handlers in place that re-raise
    # is a no-op, so the engine is shut down below and the process exits with status 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    logger.info(startup_message(engine, host, port, names))

    async def serve():
        stats_task = None
        if log_stats:
            from jaxserve.entrypoints.openai.stats_log import log_interval_s, log_stats_forever

            stats_task = asyncio.create_task(log_stats_forever(engine.stats, log_interval_s()))
        try:
            # --lora-modules: each adapter checked and loaded before the first request
            await app.state.serving.models_registry.load_startup_adapters()
            await server.serve()
        finally:
            if stats_task is not None:
                stats_task.cancel()
            logger.info("shutting down the engine")
            await engine.shutdown()

    asyncio.run(serve())
    logger.info("jaxserve stopped")
