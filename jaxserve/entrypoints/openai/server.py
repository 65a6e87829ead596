"""The OpenAI-compatible HTTP server: a Starlette app around one ``AsyncLLM``, served by uvicorn.

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
import concurrent.futures
import json
import logging
import os
import math
import secrets
import signal
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import h11
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

import jaxserve
from jaxserve.entrypoints.openai import protocol as P
from jaxserve.errors import EngineDeadError, InvalidRequestError
from jaxserve.entrypoints.openai.metrics import RequestObserver, ServerMetrics
from jaxserve.core.outputs import CompletionOutput, RequestOutput
from jaxserve.engine.tokenizer import stop_buffer_length
from jaxserve.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from jaxserve.entrypoints.openai.serving_models import ServingModels, runtime_lora_updating
from jaxserve.entrypoints.openai.tool_call_stream import ToolCallStreamer
from jaxserve.entrypoints.openai.tool_parsers import (get_tool_parser, parse_required,
                                                      partial_required_calls)

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 * 2**20  # default --max-request-body-bytes: a larger body is answered 413
# The byte bound of a prompt is max_model_len x (longest token string + a joining space) x this:
# normalizers may shrink text before it is tokenized (NFKC maps a 3-byte fullwidth letter to
# one byte; some drop control characters), so the bound stays above any text that fits.
PROMPT_BYTES_SLACK = 4
TOKENIZER_THREADS = 2
SHUTDOWN_TIMEOUT_S = 20.0  # default --shutdown-timeout: inside Kubernetes' default 30 s grace
HEADER_TIMEOUT_S = 10  # a connection must send a whole request head within this
KEEP_ALIVE_S = 5  # uvicorn's default idle keep-alive  # concurrent tokenizations / chat template renders, off the event loop
MAX_REQUEST_ID_CHARS = 256  # a longer X-Request-Id is replaced, not echoed
LOGPROB_FLOOR = -9999.0  # -inf (masked tokens) is not JSON; vLLM clamps the same way


# ---- errors ----------------------------------------------------------------------------------
_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                405: "MethodNotAllowedError", 413: "RequestTooLargeError",
                422: "UnprocessableEntityError", 500: "InternalServerError",
                503: "ServiceUnavailableError"}


def error_body(message: str, status: int, param: str | None = None,
               type: str | None = None) -> dict:
    info = P.ErrorInfo(message=message, type=type or _ERROR_TYPES.get(status, "error"),
                       param=param, code=status)
    return P.ErrorResponse(error=info).model_dump()


def error_response(message: str, status: int, param: str | None = None,
                   type: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param, type), status_code=status)


def _error_from_exception(exc: BaseException, engine) -> tuple[dict, int]:
    if isinstance(exc, InvalidRequestError):
        status = exc.status_code
        typ = exc.type if exc.type != "invalid_request_error" else None
        return error_body(exc.message, status, exc.param, typ), status
    if isinstance(exc, EngineDeadError):
        return error_body(f"the engine is not running: {exc}", 503), 503
    if isinstance(exc, ServerShuttingDown):
        return error_body(str(exc), 503), 503
    if isinstance(exc, ValueError):  # the project's contract: bad input raises ValueError
        return error_body(str(exc), 400), 400
    try:
        engine.check_health()
    except EngineDeadError as dead:
        return error_body(f"the engine is not running: {dead}", 503), 503
    logger.exception("internal error", exc_info=exc)
    return error_body(f"internal server error: {type(exc).__name__}", 500), 500


class ServerShuttingDown(Exception):
    """The server is draining: new requests get 503, and requests still running when the grace
    period ends get this error (in-band on a stream, then ``[DONE]``)."""


class _JSON(Response):
    """JSON via pydantic (NaN/inf become null instead of failing)."""

    media_type = "application/json"

    def __init__(self, model: P.OpenAIBaseModel, status_code: int = 200):
        super().__init__(model.model_dump_json(), status_code=status_code)


# ---- auth ------------------------------------------------------------------------------------
# routes that need the API key: the OpenAI API, and what changes the server's state
PROTECTED = ("/v1", "/reset_prefix_cache")


def _route_path(scope) -> str:
    """The path the routes see: without ``--root-path``, which uvicorn keeps in ``path``."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class _BearerAuth:
    """Pure ASGI middleware: every protected route needs ``Authorization: Bearer <api_key>``."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and _route_path(scope).startswith(PROTECTED):
            got = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not secrets.compare_digest(got, self.expected):
                resp = error_response("missing or invalid API key (Authorization: Bearer ...)",
                                      401)
                resp.headers["WWW-Authenticate"] = "Bearer"
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _RequestIdHeader:
    """Pure ASGI middleware: every response carries ``X-Request-Id``, the client's own when it
    sent a usable one (printable ASCII, at most ``MAX_REQUEST_ID_CHARS``), else a fresh one.
    The id is only echoed and logged; the engine never keys anything by it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = client_request_id(scope) or uuid.uuid4().hex

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", [])
                           if k.lower() != b"x-request-id"]
                message = {**message, "headers": headers + [(b"x-request-id", rid.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def client_request_id(scope) -> str | None:
    """The client's ``X-Request-Id`` header, when it is one we can echo safely."""
    raw = dict(scope.get("headers") or []).get(b"x-request-id")
    if not raw or len(raw) > MAX_REQUEST_ID_CHARS:
        return None
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        return None
    return text if text.isprintable() else None


# ---- engine streams --------------------------------------------------------------------------
@dataclass
class _Event:
    prompt_index: int
    output: RequestOutput | None = None  # None: this prompt's stream ended
    error: BaseException | None = None


@dataclass(eq=False)  # identity: fan-ins are kept in a set while in flight
class _FanIn:
    """Runs one engine stream per prompt as tasks and merges their outputs into one queue.

    ``prime`` waits until every stream has produced its first event, so validation errors the
    engine raises before its first output still become a 4xx response. ``close`` cancels the
    tasks; cancelling an engine stream aborts its request and frees its pages.
    """

    engine: Any
    prompts: list
    params: Any
    request_id: str  # the response's id (the client's request_id when it sent one)
    priority: int
    observers: list[RequestObserver]
    # The engine's key: generated here, never taken from the client, so no client id can reach
    # (or collide with) another request's state.
    internal_id: str = field(default_factory=lambda: P.random_id("req"))
    lora_request: Any = None  # the adapter the request's model names (None: the base)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    tasks: list[asyncio.Task] = field(default_factory=list)
    buffered: list[_Event] = field(default_factory=list)
    last: dict[int, RequestOutput] = field(default_factory=dict)
    pending: int = 0
    on_close: Any = None  # called once when the fan-in is closed

    def engine_id(self, i: int) -> str:
        return f"{self.internal_id}-{i}"

    async def _produce(self, i: int, prompt) -> None:
        try:
            kw = {} if self.lora_request is None else {"lora_request": self.lora_request}
            gen = self.engine.generate(prompt, self.params, self.engine_id(i),
                                       priority=self.priority, **kw)
            async for out in gen:
                self.queue.put_nowait(_Event(i, out))
            self.queue.put_nowait(_Event(i))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self.queue.put_nowait(_Event(i, error=e))

    async def prime(self) -> None:
        self.tasks = [asyncio.create_task(self._produce(i, p)) for i, p in enumerate(self.prompts)]
        self.pending = len(self.prompts)
        seen: set[int] = set()
        while len(seen) < len(self.prompts):
            ev = await self.queue.get()
            if ev.error is not None:
                self.close()
                raise ev.error
            seen.add(ev.prompt_index)
            self.buffered.append(ev)

    async def events(self) -> AsyncIterator[_Event]:
        """Outputs in arrival order; raises the first error; ends when all streams ended."""
        while self.pending:
            ev = self.buffered.pop(0) if self.buffered else await self.queue.get()
            if ev.error is not None:
                raise ev.error
            if ev.output is None:
                self.pending -= 1
                out = self.last.get(ev.prompt_index)
                self.observers[ev.prompt_index].on_finish(
                    out, [c.finish_reason or "abort" for c in out.outputs] if out else ["abort"])
            else:
                self.last[ev.prompt_index] = ev.output
                self.observers[ev.prompt_index].on_output(ev.output)
            yield ev

    def stop(self, error: BaseException) -> None:
        """End this request from outside: its consumer gets ``error`` next."""
        self.queue.put_nowait(_Event(0, error=error))

    def close(self) -> None:
        for t in self.tasks:
            if not t.done():
                t.cancel()
        if self.on_close is not None:
            self.on_close(self)
            self.on_close = None


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(fanin: _FanIn, request: Request) -> dict[int, RequestOutput]:
    """Drain a non-streaming request; a client that hangs up aborts it."""

    async def drain():
        async for _ in fanin.events():
            pass
        return fanin.last

    work = asyncio.create_task(drain())
    watch = asyncio.create_task(_until_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        raise _ClientGone()
    finally:
        for t in (work, watch):
            t.cancel()
        fanin.close()


class _ClientGone(Exception):
    pass


class _SSEResponse(StreamingResponse):
    """An event stream whose body generator is always closed, however the response ends."""

    def __init__(self, body: AsyncIterator[str]):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def _shown_text(c: CompletionOutput, hold: int) -> str:
    """The part of a choice's text a stream may show: until the choice finishes, the last
    ``hold`` characters wait, since a later token may complete a stop string that starts there
    (and the stop string is never shown)."""
    if c.finish_reason is not None or not hold:
        return c.text
    return c.text[:max(0, len(c.text) - hold)]


def _sse(model: P.OpenAIBaseModel | dict) -> str:
    data = model if isinstance(model, dict) else None
    text = json.dumps(data) if data is not None else model.model_dump_json()
    return f"data: {text}\n\n"


# ---- logprob formats -------------------------------------------------------------------------
def _clamp(x: float | None) -> float | None:
    if x is None:
        return None
    return x if math.isfinite(x) else LOGPROB_FLOOR


class _Tokens:
    """Token-string helpers over the HF tokenizer."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def text(self, tid: int) -> str:
        return self.tok.decode([tid])

    def entry_text(self, tid: int, lp) -> str:
        return lp.decoded_token if getattr(lp, "decoded_token", None) is not None else self.text(tid)


def _prompt_logprobs(tokens: _Tokens, out: RequestOutput | None) -> P.PromptLogprobs | None:
    """vLLM's ``prompt_logprobs`` field: per prompt position None (the first token has no
    logprob) or ``{token id: {logprob, rank, decoded_token}}``, the prompt's own token included."""
    if out is None or out.prompt_logprobs is None:
        return None
    result: P.PromptLogprobs = []
    for pos in out.prompt_logprobs:
        if pos is None:
            result.append(None)
            continue
        result.append({str(tid): {"logprob": lp.logprob, "rank": lp.rank,
                                  "decoded_token": tokens.entry_text(tid, lp)}
                       for tid, lp in pos.items()})
    return result


def _legacy_logprobs(tokens: _Tokens, token_ids: list[int], positions: list, start_offset: int
                     ) -> P.CompletionLogProbs:
    """The completions format: parallel lists of tokens, their logprobs, top-k dicts, offsets."""
    out = P.CompletionLogProbs()
    offset = start_offset
    for tid, pos in zip(token_ids, positions):
        lp = pos.get(tid) if pos else None
        s = tokens.entry_text(tid, lp) if lp is not None else tokens.text(tid)
        out.tokens.append(s)
        out.text_offset.append(offset)
        offset += len(s)
        if lp is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_clamp(lp.logprob))
        ranked = sorted(pos.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0))
        out.top_logprobs.append({tokens.entry_text(t, e): _clamp(e.logprob) for t, e in ranked})
    return out


def _chat_logprobs(tokens: _Tokens, token_ids: list[int], positions: list, k: int
                   ) -> list[P.ChatCompletionLogProbsContent]:
    """The chat format: one entry per generated token with its top-k alternatives."""
    content = []
    for tid, pos in zip(token_ids, positions):
        lp = (pos or {}).get(tid)
        s = tokens.entry_text(tid, lp) if lp is not None else tokens.text(tid)
        ranked = sorted((pos or {}).items(),
                        key=lambda kv: (kv[1].rank is None, kv[1].rank or 0, -kv[1].logprob))
        top = [P.ChatCompletionLogProb(token=tokens.entry_text(t, e),
                                       logprob=_clamp(e.logprob),
                                       bytes=list(tokens.entry_text(t, e).encode()))
               for t, e in ranked[:k]]
        content.append(P.ChatCompletionLogProbsContent(
            token=s, logprob=_clamp(lp.logprob) if lp is not None else LOGPROB_FLOOR,
            bytes=list(s.encode()), top_logprobs=top))
    return content


# ---- streamed tool calls ---------------------------------------------------------------------
class _StreamedToolCalls:
    """Tool calls in a chat stream. A named function streams its arguments as they come (they
    concatenate to the answer, valid JSON by the grammar). "required" and "auto" (with a tool
    call parser) stream like vLLM: plain content as far as the parser says it is content, then
    per call a delta with its id, type and name once the name is written, then its arguments
    in fragments that concatenate to the arguments JSON; finish_reason "tool_calls" when the
    finished answer parses as calls."""

    def __init__(self, serving: OpenAIServing, req: P.ChatCompletionRequest, echo: str):
        self.serving, self.req, self.echo = serving, req, echo
        mode = req.tool_mode
        self.parser = serving.tool_parser if mode == "auto" and req.tools else None
        self.active = (mode in ("named", "required") or self.parser is not None
                       or serving.reasoning_parser is not None)
        self.sent = [0] * req.n
        self.sent_reasoning = [0] * req.n
        self.named_started = [False] * req.n
        self.call_id = [P.random_id("chatcmpl-tool") for _ in range(req.n)]
        one = self.parser is not None and req.parallel_tool_calls is False
        self.streamers = [ToolCallStreamer(max_calls=1 if one else None,
                                           new_id=lambda: P.random_id("chatcmpl-tool"))
                          for _ in range(req.n)]

    def _partial_calls(self, text: str):
        if self.req.tool_mode == "required":
            return partial_required_calls(text)
        if self.parser is not None:
            return self.parser.partial_calls(text)
        return []

    def _content_end(self, text: str) -> int:
        if self.req.tool_mode == "required":
            return 0
        return self.parser.content_end(text) if self.parser is not None else len(text)

    def delta(self, i: int, shown: str, done: bool, finish_reason: str | None
              ) -> tuple[P.DeltaMessage | None, str | None]:
        req = self.req
        if req.tool_mode == "named":
            new = shown[self.sent[i]:]
            self.sent[i] = len(shown)
            if not new and not done:
                return None, None
            fn = P.DeltaFunctionCall(arguments=new)
            call = P.DeltaToolCall(index=0, function=fn)
            if not self.named_started[i]:
                self.named_started[i] = True
                call.id, call.type, fn.name = self.call_id[i], "function", req.named_tool.function.name
            return P.DeltaMessage(tool_calls=[call]), finish_reason
        reasoning, text = self.serving._split_reasoning(req, self.echo + shown, done)
        new_reasoning = reasoning[self.sent_reasoning[i]:]
        self.sent_reasoning[i] = len(reasoning)
        streamer = self.streamers[i]
        calls = [P.DeltaToolCall(index=k, id=cid, type="function" if cid else None,
                                 function=P.DeltaFunctionCall(name=name, arguments=args))
                 for k, cid, name, args in streamer.update(self._partial_calls(text))]
        if not done:
            end = self._content_end(text)
            new = text[self.sent[i]:end] if end > self.sent[i] else ""
            self.sent[i] = max(self.sent[i], end)
            if not (new or new_reasoning or calls):
                return None, None
            return P.DeltaMessage(content=new or None, reasoning_content=new_reasoning or None,
                                  tool_calls=calls), None
        content, parsed, finish = self.serving._tool_calls(req, text, finish_reason or "abort")
        if streamer.started:  # what is left before the calls; the calls went as deltas
            rest = text[self.sent[i]:self._content_end(text)]
        else:
            rest = (content or "")[self.sent[i]:] if parsed else text[self.sent[i]:]
        return P.DeltaMessage(content=rest or None, reasoning_content=new_reasoning or None,
                              tool_calls=calls), finish


# ---- the app ---------------------------------------------------------------------------------
class OpenAIServing:
    """Route handlers over one engine. Plain methods; ``build_app`` wires them to paths."""

    def __init__(self, engine, served_model_names: list[str], chat_template: str | None,
                 metrics: ServerMetrics, max_body_bytes: int = MAX_BODY_BYTES,
                 enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None, trust_request_chat_template: bool = False,
                 log_requests: bool = False, max_log_len: int | None = None,
                 response_role: str = "assistant", lora_modules: list[dict] | None = None):
        self.engine = engine
        self.models_registry = ServingModels(engine, served_model_names, lora_modules)
        self.response_role = response_role
        self.log_requests = log_requests
        self.max_log_len = max_log_len
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tool_parser = get_tool_parser(tool_call_parser) if tool_call_parser else None
        self.reasoning_parser = get_reasoning_parser(reasoning_parser) if reasoning_parser \
            else None
        self.trust_request_chat_template = trust_request_chat_template
        self.names = served_model_names
        self.chat_template = chat_template
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.draining = False
        self._live: set[_FanIn] = set()
        self.tokens = _Tokens(engine.tokenizer)
        # the model's generation-config defaults for sampling fields a request leaves unset
        self.defaults = dict(getattr(engine, "default_sampling", None) or {})
        # Tokenizing a long text or rendering a chat template takes seconds of CPU: it runs
        # here, off the event loop, so other requests and /health keep being answered.
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=TOKENIZER_THREADS, thread_name_prefix="jaxserve-tokenize")
        # A text longer than this cannot fit max_model_len tokens: rejected before tokenizing.
        width = max_token_bytes(engine.tokenizer)
        self.max_prompt_bytes = (engine.max_model_len * (width + 1) * PROMPT_BYTES_SLACK
                                 if width else None)

    # -- shutdown ------------------------------------------------------------------------------
    def _admit(self) -> None:
        if self.draining:
            raise ServerShuttingDown("the server is shutting down; retry on another replica")

    @property
    def num_inflight(self) -> int:
        """Generation requests admitted to the engine and not yet answered."""
        return len(self._live)

    def start_draining(self) -> None:
        """Admit nothing new (503, /health too); requests in flight go on."""
        self.draining = True

    def end_inflight(self) -> None:
        """End every request still in flight with a 503 error (a stream gets it in-band,
        then ``[DONE]``); their engine requests are aborted."""
        for fanin in list(self._live):
            fanin.stop(ServerShuttingDown(
                "the server shut down before this request finished (--shutdown-timeout)"))

    async def _off_loop(self, fn, *args):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_pool, fn, *args)

    def _check_prompt_bytes(self, n_bytes: int, param: str) -> None:
        if self.max_prompt_bytes is not None and n_bytes > self.max_prompt_bytes:
            limit = self.engine.max_model_len
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, your "
                f"{'messages hold' if param == 'messages' else 'prompt holds'} {n_bytes} bytes "
                f"of text, more than {limit} tokens can hold. Please reduce the length of the "
                "input.", param=param)

    # -- shared steps --------------------------------------------------------------------------
    async def _body(self, request: Request) -> Any:
        self._admit()
        ctype = request.headers.get("content-type")
        if ctype is not None and not _is_json_media_type(ctype):
            raise InvalidRequestError(
                f"the request body must be JSON (Content-Type: application/json), got {ctype!r}")
        declared = request.headers.get("content-length")
        limit = self.max_body_bytes
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise InvalidRequestError(f"request body larger than {limit} bytes", status_code=413)
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                chunks.append(chunk)
                size += len(chunk)
                if size > limit:
                    raise InvalidRequestError(f"request body larger than {limit} bytes",
                                              status_code=413)
        except ClientDisconnect:  # the client hung up mid-upload: its doing, nothing to answer
            raise _ClientGone() from None
        raw = b"".join(chunks)
        if not raw.strip():
            raise InvalidRequestError("the request body is empty; expected a JSON object")
        try:
            body = json.loads(raw, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as e:
            raise InvalidRequestError(f"malformed JSON body: {e}") from None
        _check_strings(body, "")
        return body

    def _model_name(self, requested: str | None) -> str:
        return self.models_registry.resolve(requested)[0]

    def _lora_of(self, model: str):
        return self.models_registry.resolve(model)[1]

    async def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return await self._off_loop(self._encode_sync, text, add_special_tokens)

    def _encode_sync(self, text: str, add_special_tokens: bool) -> list[int]:
        try:
            return list(self.engine.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except (TypeError, ValueError) as e:  # text the tokenizer cannot take is bad input
            raise InvalidRequestError(f"could not tokenize the prompt: {e}",
                                      param="prompt") from None

    async def _chat_ids(self, req) -> list[int]:
        return await self._off_loop(self._chat_ids_sync, req)

    def _chat_ids_sync(self, req) -> list[int]:
        from jaxserve.engine.tokenizer import apply_chat_template

        messages = req.message_dicts()
        template = self.chat_template or getattr(self.engine, "chat_template", None)
        extra = dict(getattr(req, "chat_template_kwargs", None) or {})
        if getattr(req, "chat_template", None) is not None:
            if not self.trust_request_chat_template:
                raise InvalidRequestError(
                    "chat_template in a request needs --trust-request-chat-template",
                    param="chat_template")
            template = req.chat_template
        if req.continue_final_message:
            extra["continue_final_message"] = True
        tools = req.template_tools() if hasattr(req, "template_tools") else None
        if tools:
            extra["tools"] = tools
        try:
            ids = apply_chat_template(self.engine.tokenizer, messages,
                                      add_generation_prompt=req.add_generation_prompt,
                                      chat_template=template, **extra)
        except InvalidRequestError:
            raise
        except Exception as e:  # noqa: BLE001 - template errors are caused by the messages
            raise InvalidRequestError(f"could not apply the chat template: {e}",
                                      param="messages") from None
        return list(ids)

    def _vocab_size(self) -> int:
        mc = getattr(self.engine, "model_config", None)
        return int(getattr(mc, "vocab_size", 0) or len(self.engine.tokenizer))

    def _check_logprobs(self, req) -> None:
        req.check_logprobs(self.engine.config.max_logprobs, self._vocab_size())

    def _check_vocab(self, sp) -> None:
        sp.verify_vocab(self._vocab_size())

    def _check_prompt_ids(self, ids: list[int], param: str) -> None:
        vocab = self._vocab_size()
        for t in ids:
            if not 0 <= t < vocab:
                raise InvalidRequestError(f"token id {t} is out of range [0, {vocab})",
                                          param=param)
        self._check_prompt_len(ids, param)

    def _check_prompt_len(self, ids: list[int], param: str) -> None:
        limit = self.engine.max_model_len
        if len(ids) >= limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, your "
                f"{'messages result' if param == 'messages' else 'prompt results'} in "
                f"{len(ids)} tokens, which leaves no room for a completion. Please reduce "
                "the length of the input.", param=param)

    def _fanin(self, prompts: list[list[int]], params, request_id: str, priority: int,
               lora_request=None) -> _FanIn:
        self._admit()
        self.engine.check_health()
        observers = [self.metrics.observer() for _ in prompts]
        fanin = _FanIn(self.engine, prompts, params, request_id, priority, observers,
                       on_close=self._live.discard, lora_request=lora_request)
        self._live.add(fanin)
        logger.debug("request %s: response id %r", fanin.internal_id, request_id)
        if self.log_requests:
            for i, (ids, sp) in enumerate(zip(prompts, params if isinstance(params, list)
                                               else [params] * len(prompts))):
                shown = ids if self.max_log_len is None else ids[:self.max_log_len]
                logger.info("received request %s-%d (response id %r): %d prompt tokens %s, "
                            "params %r", fanin.internal_id, i, request_id, len(ids), shown, sp)
        return fanin

    # -- /v1/completions -----------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        req: P.CompletionRequest = P.parse_request(P.CompletionRequest, await self._body(request))
        model = self._model_name(req.model)
        prompts, echo_texts = [], []
        for p in req.prompt_list():
            if isinstance(p, str):
                self._check_prompt_bytes(len(p.encode()), "prompt")
                ids = await self._encode(p, req.add_special_tokens)
            else:
                ids = list(p)
            ids = P.truncate_prompt(ids, req.truncate_prompt_tokens)
            self._check_prompt_ids(ids, "prompt")
            prompts.append(ids)
            if req.echo:
                echo_texts.append(p if isinstance(p, str) else self.engine.tokenizer.decode(ids))
            else:
                echo_texts.append("")
        self._check_logprobs(req)
        params = [req.to_sampling_params(self.engine.max_model_len, len(ids), self.defaults)
                  for ids in prompts]
        # One SamplingParams serves all prompts; the tightest max_tokens default applies.
        sp = min(params, key=lambda s: s.max_tokens if s.max_tokens is not None else 1 << 62)
        self._check_vocab(sp)
        request_id = req.request_id or _header_id(request) or P.random_id("cmpl")
        fanin = self._fanin(prompts, sp, request_id, req.priority, self._lora_of(model))
        await fanin.prime()
        if req.stream:
            return _SSEResponse(self._completion_stream(req, fanin, model, echo_texts))
        try:
            finals = await _collect(fanin, request)
        except _ClientGone:
            return Response(status_code=499)
        choices = []
        usage = P.UsageInfo()
        for i, ids in enumerate(prompts):
            out = finals[i]
            usage.prompt_tokens += len(ids)
            usage.completion_tokens += sum(len(c.token_ids) for c in out.outputs)
            for c in out.outputs:
                logprobs = None
                if req.logprobs is not None:
                    logprobs = self._completion_choice_logprobs(req, out, c, echo_texts[i])
                choices.append(P.CompletionResponseChoice(
                    index=i * req.n + c.index, text=echo_texts[i] + c.text, logprobs=logprobs,
                    finish_reason=c.finish_reason or "abort", stop_reason=c.stop_reason,
                    prompt_logprobs=_prompt_logprobs(self.tokens, out)))
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        choices.sort(key=lambda ch: ch.index)
        return _JSON(P.CompletionResponse(id=request_id, model=model, choices=choices,
                                          usage=usage))

    def _completion_choice_logprobs(self, req, out: RequestOutput, c: CompletionOutput,
                                    echo_text: str) -> P.CompletionLogProbs:
        positions = c.logprobs or [{}] * len(c.token_ids)
        if not req.echo:
            return _legacy_logprobs(self.tokens, c.token_ids, positions, 0)
        # Echo: the prompt's tokens first (the first has no logprob), offsets run on through
        # both, counted over the token strings as vLLM does.
        prompt_lps = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        head = _legacy_logprobs(self.tokens, out.prompt_token_ids, prompt_lps, 0)
        end = head.text_offset[-1] + len(head.tokens[-1]) if head.tokens else 0
        gen = _legacy_logprobs(self.tokens, c.token_ids, positions, end)
        return P.CompletionLogProbs(
            text_offset=head.text_offset + gen.text_offset,
            token_logprobs=head.token_logprobs + gen.token_logprobs,
            tokens=head.tokens + gen.tokens, top_logprobs=head.top_logprobs + gen.top_logprobs)

    def _completion_stream(self, req: P.CompletionRequest, fanin: _FanIn, model: str,
                           echo_texts: list[str]) -> AsyncIterator[str]:
        created = int(time.time())
        chunks = self._completion_chunks(req, fanin, model, created, echo_texts)
        return self._stream_tail(chunks, fanin, req.include_usage, P.CompletionStreamResponse,
                                 created, model)

    async def _completion_chunks(self, req: P.CompletionRequest, fanin: _FanIn, model: str,
                                 created: int, echo_texts: list[str]) -> AsyncIterator[str]:
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        finished: set[int] = set()
        hold = stop_buffer_length(fanin.params.stop, fanin.params.include_stop_str_in_output)
        async for ev in fanin.events():
            if ev.output is None:
                continue
            for c in ev.output.outputs:
                idx = ev.prompt_index * req.n + c.index
                prefix, prompt_lps = "", None
                if idx not in sent_text:
                    sent_text[idx] = 0
                    sent_tokens[idx] = 0
                    prefix = echo_texts[ev.prompt_index]
                    prompt_lps = _prompt_logprobs(self.tokens, ev.output)
                done = c.finish_reason is not None and idx not in finished
                shown = _shown_text(c, hold)
                delta = shown[sent_text[idx]:]
                new_ids = c.token_ids[sent_tokens[idx]:]
                if not (prefix or prompt_lps or delta or done
                        or (new_ids and req.logprobs is not None)):
                    continue
                logprobs = None
                if req.logprobs is not None:
                    start = sent_tokens[idx]
                    logprobs = _legacy_logprobs(
                        self.tokens, new_ids, (c.logprobs or [])[start:] or [{}] * len(new_ids),
                        len(prefix) + sent_text[idx])
                sent_text[idx] = len(shown)
                sent_tokens[idx] = len(c.token_ids)
                if done:
                    finished.add(idx)
                yield _sse(P.CompletionStreamResponse(
                    id=fanin.request_id, created=created, model=model,
                    choices=[P.CompletionResponseChoice(
                        index=idx, text=prefix + delta, logprobs=logprobs,
                        finish_reason=c.finish_reason if done else None,
                        stop_reason=c.stop_reason if done else None,
                        prompt_logprobs=prompt_lps)]))

    async def _stream_tail(self, chunks: AsyncIterator[str], fanin: _FanIn, include_usage: bool,
                           response: type, created: int, model: str) -> AsyncIterator[str]:
        """What every stream ends with: the usage chunk (``stream_options.include_usage``), an
        error in-band (the headers are already sent), then ``[DONE]``; the fan-in is closed
        whether the stream ends, fails or the client goes away."""
        try:
            async for text in chunks:
                yield text
            if include_usage:
                outs = fanin.last.values()
                prompt = sum(len(o.prompt_token_ids) for o in outs)
                completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
                yield _sse(response(
                    id=fanin.request_id, created=created, model=model, choices=[],
                    usage=P.UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                                      total_tokens=prompt + completion)))
        except Exception as e:  # noqa: BLE001 - headers are sent; report in-band
            body, _ = _error_from_exception(e, self.engine)
            yield _sse(body)
        finally:
            fanin.close()
            await chunks.aclose()
        yield "data: [DONE]\n\n"

    # -- /v1/chat/completions ------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        req: P.ChatCompletionRequest = P.parse_request(P.ChatCompletionRequest,
                                                       await self._body(request))
        model = self._model_name(req.model)
        if req.tool_mode == "auto" and req.tools and not (self.enable_auto_tool_choice
                                                          and self.tool_parser):
            raise InvalidRequestError('"auto" tool choice requires --enable-auto-tool-choice '
                                      "and --tool-call-parser to be set", param="tool_choice")
        self._check_prompt_bytes(req.content_bytes(), "messages")
        ids = P.truncate_prompt(await self._chat_ids(req), req.truncate_prompt_tokens)
        self._check_prompt_len(ids, "messages")
        self._check_logprobs(req)
        sp = req.to_sampling_params(self.engine.max_model_len, len(ids), self.defaults)
        self._check_vocab(sp)
        echo = ""
        if req.echo and req.messages[-1].role == "assistant":
            echo = req.messages[-1].text(f"messages.{len(req.messages) - 1}")
        request_id = req.request_id or _header_id(request) or P.random_id("chatcmpl")
        fanin = self._fanin([ids], sp, request_id, req.priority, self._lora_of(model))
        await fanin.prime()
        top_k = (req.top_logprobs or 0) if req.logprobs else None
        if top_k == -1:
            top_k = self._vocab_size()
        if req.stream:
            return _SSEResponse(self._chat_stream(req, fanin, model, echo, top_k))
        try:
            out = (await _collect(fanin, request))[0]
        except _ClientGone:
            return Response(status_code=499)
        choices = []
        for c in out.outputs:
            logprobs = None
            if top_k is not None:
                logprobs = P.ChatCompletionLogProbs(content=_chat_logprobs(
                    self.tokens, c.token_ids, c.logprobs or [{}] * len(c.token_ids), top_k))
            reasoning, text = self._split_reasoning(req, echo + c.text, True)
            content, calls, finish = self._tool_calls(req, text, c.finish_reason or "abort")
            choices.append(P.ChatCompletionResponseChoice(
                index=c.index, message=P.ChatMessage(role=self._role(req), content=content,
                                                     reasoning_content=reasoning or None,
                                                     tool_calls=calls),
                logprobs=logprobs, finish_reason=finish, stop_reason=c.stop_reason))
        completion = sum(len(c.token_ids) for c in out.outputs)
        usage = P.UsageInfo(prompt_tokens=len(ids), completion_tokens=completion,
                            total_tokens=len(ids) + completion,
                            prompt_tokens_details=P.PromptTokensDetails(
                                cached_tokens=out.num_cached_tokens))
        return _JSON(P.ChatCompletionResponse(id=request_id, model=model, choices=choices,
                                              usage=usage,
                                              prompt_logprobs=_prompt_logprobs(self.tokens, out)))

    def _role(self, req: P.ChatCompletionRequest) -> str:
        """The answer's role: --response-role after a generation prompt, else the role of the
        message being continued (vLLM's rule)."""
        return self.response_role if req.add_generation_prompt else req.messages[-1].role

    def _split_reasoning(self, req: P.ChatCompletionRequest, text: str, done: bool
                         ) -> tuple[str, str]:
        """(reasoning, the rest) with ``--reasoning-parser``; a tool call forced by the
        grammar has no reasoning."""
        if self.reasoning_parser is None or req.tool_mode in ("named", "required"):
            return "", text
        return self.reasoning_parser.split_streaming(text, done)

    def _tool_calls(self, req: P.ChatCompletionRequest, text: str, finish: str
                    ) -> tuple[str | None, list[P.ToolCall], str]:
        """(content, tool calls, finish_reason) of a finished answer. A named function's answer
        is its arguments (finish_reason as generated, as OpenAI); "required" answers a JSON
        array of calls; "auto" is split by the tool call parser. Unparsable (cut by max_tokens)
        answers stay content."""
        mode = req.tool_mode
        calls: list[tuple[str, str]] = []
        content: str | None = text
        if mode == "named" and finish == "stop":
            calls, content = [(req.named_tool.function.name, text)], None
        elif mode == "required" and finish == "stop":
            parsed = parse_required(text)
            if parsed:
                calls, content = parsed, None
        elif mode == "auto" and req.tools and self.tool_parser is not None:
            content, calls = self.tool_parser.extract(text)
            if calls and req.parallel_tool_calls is False:
                calls = calls[:1]
        tool_calls = [P.ToolCall(function=P.FunctionCall(name=n, arguments=a)) for n, a in calls]
        if tool_calls and mode != "named":
            finish = "tool_calls"
        return content, tool_calls, finish

    def _chat_stream(self, req: P.ChatCompletionRequest, fanin: _FanIn, model: str,
                     echo: str, top_k: int | None) -> AsyncIterator[str]:
        created = int(time.time())
        chunks = self._chat_chunks(req, fanin, model, created, echo, top_k)
        return self._stream_tail(chunks, fanin, req.include_usage,
                                 P.ChatCompletionStreamResponse, created, model)

    async def _chat_chunks(self, req: P.ChatCompletionRequest, fanin: _FanIn, model: str,
                           created: int, echo: str, top_k: int | None) -> AsyncIterator[str]:
        def chunk(index, delta, logprobs=None, finish_reason=None, stop_reason=None,
                  prompt_logprobs=None):
            return _sse(P.ChatCompletionStreamResponse(
                id=fanin.request_id, created=created, model=model,
                choices=[P.ChatCompletionStreamChoice(
                    index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason,
                    stop_reason=stop_reason)], prompt_logprobs=prompt_logprobs))

        sent_text = [0] * req.n
        sent_tokens = [0] * req.n
        finished: set[int] = set()
        hold = stop_buffer_length(fanin.params.stop, fanin.params.include_stop_str_in_output)
        tools = _StreamedToolCalls(self, req, echo)
        for i in range(req.n):
            yield chunk(i, P.DeltaMessage(role=self._role(req), content=echo))
        prompt_lps_due = fanin.params.prompt_logprobs is not None  # with the first output
        async for ev in fanin.events():
            if ev.output is None:
                continue
            for c in ev.output.outputs:
                i = c.index
                done = c.finish_reason is not None and i not in finished
                shown = _shown_text(c, hold)
                new_ids = c.token_ids[sent_tokens[i]:]
                prompt_lps = _prompt_logprobs(self.tokens, ev.output) if prompt_lps_due else None
                logprobs = None
                if top_k is not None and new_ids:
                    positions = (c.logprobs or [])[sent_tokens[i]:] or [{}] * len(new_ids)
                    logprobs = P.ChatCompletionLogProbs(
                        content=_chat_logprobs(self.tokens, new_ids, positions, top_k))
                if tools.active:  # tool calls and/or reasoning: the message is split
                    if not done and not new_ids and not prompt_lps:
                        continue
                    delta_msg, finish = tools.delta(i, shown, done, c.finish_reason)
                    sent_tokens[i] = len(c.token_ids)
                    if done:
                        finished.add(i)
                    elif delta_msg is None and logprobs is None and not prompt_lps:
                        continue
                    prompt_lps_due = prompt_lps_due and prompt_lps is None
                    yield chunk(i, delta_msg or P.DeltaMessage(), logprobs,
                                finish if done else None, c.stop_reason if done else None,
                                prompt_lps)
                    continue
                delta = shown[sent_text[i]:]
                if not (delta or done or prompt_lps or (new_ids and top_k is not None)):
                    continue
                prompt_lps_due = prompt_lps_due and prompt_lps is None
                sent_text[i] = len(shown)
                sent_tokens[i] = len(c.token_ids)
                if done:
                    finished.add(i)
                yield chunk(i, P.DeltaMessage(content=delta), logprobs,
                            c.finish_reason if done else None,
                            c.stop_reason if done else None, prompt_lps)
        for i in range(req.n):  # streams that ended without a finish (aborted elsewhere)
            if i not in finished:
                yield chunk(i, P.DeltaMessage(), finish_reason="abort")

    # -- small routes --------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        root = getattr(self.engine.config, "model", None)
        cards = self.models_registry.cards(P.ModelCard, root, self.engine.max_model_len)
        return _JSON(P.ModelList(data=cards))

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
            req = P.parse_request(P.TokenizeChatRequest, body)
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
        return _JSON(P.TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len,
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
        return _JSON(P.DetokenizeResponse(prompt=text))

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


def max_token_bytes(tokenizer) -> int | None:
    """The most UTF-8 bytes one vocabulary entry spells (its token string, which is never
    shorter than the text it decodes to); None when the vocabulary cannot be listed."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 - no bound; prompts are then checked after tokenizing
        return None
    return max((len(t.encode("utf-8", "replace")) for t in vocab), default=0) or None


def _is_json_media_type(value: str) -> bool:
    """application/json or a ``+json`` type (parameters such as charset allowed)."""
    media = value.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/")
                                            and media.endswith("+json"))


def _header_id(request: Request) -> str | None:
    return client_request_id(request.scope)


def _check_strings(value, path: str) -> None:
    """JSON may carry lone UTF-16 surrogates ("\\ud800"), which no tokenizer can encode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequestError("a string holds an unpaired UTF-16 surrogate",
                                      param=path or None) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_strings(k, path)
            _check_strings(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_strings(v, f"{path}.{i}" if path else str(i))


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a path to a Jinja file, or the template itself (like vLLM)."""
    if value is None:
        return None
    from pathlib import Path

    path = Path(value).expanduser()
    try:
        if path.is_file():
            return path.read_text()
    except OSError:
        pass
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"--chat-template {value!r} is neither a readable file nor a template")


def build_app(engine, *, api_key: str | None = None,
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
    serving = OpenAIServing(engine, names, load_chat_template(chat_template), metrics,
                            max_body_bytes=max_body_bytes,
                            enable_auto_tool_choice=enable_auto_tool_choice,
                            tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser,
                            trust_request_chat_template=trust_request_chat_template,
                            log_requests=log_requests, max_log_len=max_log_len,
                            response_role=response_role, lora_modules=lora_modules)

    async def on_error(request: Request, exc: Exception) -> Response:
        if isinstance(exc, HTTPException):
            return error_response(exc.detail or "error", exc.status_code)
        body, status = _error_from_exception(exc, engine)
        return JSONResponse(body, status_code=status)

    routes = [
        Route("/v1/completions", serving.completions, methods=["POST"]),
        Route("/v1/chat/completions", serving.chat_completions, methods=["POST"]),
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
    if runtime_lora_updating():
        routes += [Route("/v1/load_lora_adapter", serving.load_lora_adapter, methods=["POST"]),
                   Route("/v1/unload_lora_adapter", serving.unload_lora_adapter,
                         methods=["POST"])]
    async def client_gone(request: Request, exc: Exception) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    handlers = {HTTPException: on_error, InvalidRequestError: on_error,
                EngineDeadError: on_error, ServerShuttingDown: on_error, ValueError: on_error,
                _ClientGone: client_gone, ClientDisconnect: client_gone, Exception: on_error}
    app = Starlette(routes=routes, exception_handlers=handlers)
    if api_key:
        app.add_middleware(_BearerAuth, api_key=api_key)
    app.add_middleware(_RequestIdHeader)  # 401s carry the id too
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
def startup_message(engine, host: str, port: int, names: list[str]) -> str:
    s = engine.stats()
    dtype = (getattr(engine, "dtype", None) or getattr(getattr(engine, "engine", None), "dtype", None)
             or engine.config.dtype)
    dtype = getattr(dtype, "__name__", None) or getattr(dtype, "name", None) or str(dtype)
    shown = "localhost" if host in ("127.0.0.1", "::1") else host
    return (f"jaxserve ready: model {engine.config.model or names[0]!s} served as "
            f"{', '.join(names)} | dtype {dtype} | {s.get('num_pages', '?')} KV pages of "
            f"{engine.config.cache.block_size} tokens | max_model_len {engine.max_model_len} | "
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

    def __init__(self, config, serving: OpenAIServing, shutdown_timeout: float):
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
