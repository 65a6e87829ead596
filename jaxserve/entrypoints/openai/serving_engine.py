"""The shared steps of every route: admission while draining, the JSON body, the model name,
tokenization off the event loop, prompt checks, the fan-in and the end of every stream."""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
from typing import Any, AsyncIterator

from starlette.requests import ClientDisconnect, Request

from jaxserve.entrypoints.openai import protocol as P
from jaxserve.engine.protocol import EngineClient
from jaxserve.errors import InvalidRequestError
from jaxserve.entrypoints.openai.metrics import ServerMetrics
from jaxserve.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from jaxserve.entrypoints.openai.tool_parsers import get_tool_parser
from jaxserve.entrypoints.openai.logprobs import Tokens
from jaxserve.entrypoints.openai.middleware import client_request_id
from jaxserve.entrypoints.openai.responses import (ClientGone, ServerShuttingDown,
                                                   error_from_exception)
from jaxserve.entrypoints.openai.streaming import FanIn, sse
from jaxserve.entrypoints.openai.lora_models import ServingModels

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 * 2**20  # default --max-request-body-bytes: a larger body is answered 413
# The byte bound of a prompt is max_model_len x (longest token string + a joining space) x this:
# normalizers may shrink text before it is tokenized (NFKC maps a 3-byte fullwidth letter to
# one byte; some drop control characters), so the bound stays above any text that fits.
PROMPT_BYTES_SLACK = 4
TOKENIZER_THREADS = 2


class OpenAIServing:
    """Route handlers over one engine. Plain methods; ``build_app`` wires them to paths."""

    def __init__(self, engine: EngineClient, served_model_names: list[str], chat_template: str | None,
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
        self._live: set[FanIn] = set()
        self.tokens = Tokens(engine.tokenizer)
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
        if ctype is not None and not is_json_media_type(ctype):
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
            raise ClientGone() from None
        raw = b"".join(chunks)
        if not raw.strip():
            raise InvalidRequestError("the request body is empty; expected a JSON object")
        try:
            body = json.loads(raw, parse_constant=reject_constant)
        except (ValueError, RecursionError) as e:
            raise InvalidRequestError(f"malformed JSON body: {e}") from None
        check_strings(body, "")
        return body

    def _model_name(self, requested: str | None) -> str:
        """The served name a request's ``model`` is answered with (a base name or an
        adapter's); unknown names are 404."""
        return self.models_registry.resolve(requested)[0]

    def _lora_of(self, model: str):
        """The adapter a served name stands for (None: the base model)."""
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

    async def _with_images(self, ids: list[int], urls: list[tuple[str, str]]):
        """The prompt for the engine: the ids, or (with image parts) vLLM's prompt dict with
        the images loaded here (``(where, url)`` each; a bad one is a 400 naming its part)."""
        if not urls:
            return ids
        if not getattr(self.engine, "takes_images", False):
            raise InvalidRequestError(f"{urls[0][0]}: this model takes no images here (a "
                                      "text-only model, a vision tower jaxserve does not run "
                                      "yet, or --limit-mm-per-prompt image 0)",
                                      param=urls[0][0])
        mmc = self.engine.config.multimodal
        limit = mmc.limit("image")
        if len(urls) > limit:
            raise InvalidRequestError(f"{urls[limit][0]}: {len(urls)} images, more than the "
                                      f"limit of {limit} per prompt (--limit-mm-per-prompt)",
                                      param=urls[limit][0])
        from jaxserve.multimodal.media import load_image_url

        def load(url, where):
            return load_image_url(url, where, allowed_local_media_path=mmc.allowed_local_media_path,
                                  allowed_media_domains=mmc.allowed_media_domains)

        images = [await self._off_loop(load, url, where) for where, url in urls]
        return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}

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
               lora_request=None) -> FanIn:
        self._admit()
        self.engine.check_health()
        observers = [self.metrics.observer() for _ in prompts]
        fanin = FanIn(self.engine, prompts, params, request_id, priority, observers,
                      on_close=self._live.discard, lora_request=lora_request)
        self._live.add(fanin)
        logger.debug("request %s: response id %r", fanin.internal_id, request_id)
        if self.log_requests:
            for i, (ids, sp) in enumerate(zip(prompts, params if isinstance(params, list)
                                               else [params] * len(prompts))):
                if isinstance(ids, dict) and "prompt_embeds" in ids:
                    n, shown = len(ids["prompt_embeds"]), "(embeddings)"
                else:
                    if isinstance(ids, dict):  # with images
                        ids = ids["prompt_token_ids"]
                    n, shown = len(ids), ids if self.max_log_len is None else ids[:self.max_log_len]
                logger.info("received request %s-%d (response id %r): %d prompt tokens %s, "
                            "params %r", fanin.internal_id, i, request_id, n, shown, sp)
        return fanin

    async def _stream_tail(self, chunks: AsyncIterator[str], fanin: FanIn, include_usage: bool,
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
                yield sse(response(
                    id=fanin.request_id, created=created, model=model, choices=[],
                    usage=P.UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                                      total_tokens=prompt + completion)))
        except Exception as e:  # noqa: BLE001 - headers are sent; report in-band
            body, _ = error_from_exception(e, self.engine)
            yield sse(body)
        finally:
            fanin.close()
            await chunks.aclose()
        yield "data: [DONE]\n\n"

def max_token_bytes(tokenizer) -> int | None:
    """The most UTF-8 bytes one vocabulary entry spells (its token string, which is never
    shorter than the text it decodes to); None when the vocabulary cannot be listed."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 - no bound; prompts are then checked after tokenizing
        return None
    return max((len(t.encode("utf-8", "replace")) for t in vocab), default=0) or None


def is_json_media_type(value: str) -> bool:
    """application/json or a ``+json`` type (parameters such as charset allowed)."""
    media = value.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/")
                                            and media.endswith("+json"))


def raise_if_failed(outputs) -> None:
    """A sequence the engine ended with an error (``finish_reason`` "error": its prompt's KV
    never arrived from the prefill instance) fails the request: a 500 carrying the reason."""
    for out in outputs:
        for c in out.outputs:
            if c.finish_reason == "error":
                raise InvalidRequestError(str(c.stop_reason), param="kv_transfer_params",
                                          status_code=500, type="InternalServerError")


def header_id(request: Request) -> str | None:
    return client_request_id(request.scope)


def check_strings(value, path: str) -> None:
    """JSON may carry lone UTF-16 surrogates ("\\ud800"), which no tokenizer can encode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequestError("a string holds an unpaired UTF-16 surrogate",
                                      param=path or None) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            check_strings(k, path)
            check_strings(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_strings(v, f"{path}.{i}" if path else str(i))


def reject_constant(name: str):
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


