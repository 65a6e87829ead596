"""``POST /v1/chat/completions``: the chat template, tool calls, reasoning, streamed deltas."""
from __future__ import annotations

import time
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from jaxserve.entrypoints.openai import protocol as P
from jaxserve.entrypoints.openai import protocol_chat as PC
from jaxserve.errors import InvalidRequestError
from jaxserve.engine.tokenizer import stop_buffer_length
from jaxserve.entrypoints.openai.tool_call_stream import ToolCallStreamer
from jaxserve.entrypoints.openai.tool_parsers import parse_required, partial_required_calls
from jaxserve.entrypoints.openai.logprobs import chat_logprobs, prompt_logprobs
from jaxserve.entrypoints.openai.responses import ClientGone, JSONModel
from jaxserve.entrypoints.openai.serving_engine import (OpenAIServing, header_id,
                                                       raise_if_failed)
from jaxserve.entrypoints.openai.streaming import FanIn, SSEResponse, collect, shown_text, sse


# ---- streamed tool calls ---------------------------------------------------------------------
class StreamedToolCalls:
    """Tool calls in a chat stream. A named function streams its arguments as they come (they
    concatenate to the answer, valid JSON by the grammar). "required" and "auto" (with a tool
    call parser) stream like vLLM: plain content as far as the parser says it is content, then
    per call a delta with its id, type and name once the name is written, then its arguments
    in fragments that concatenate to the arguments JSON; finish_reason "tool_calls" when the
    finished answer parses as calls."""

    def __init__(self, serving: OpenAIServing, req: PC.ChatCompletionRequest, echo: str):
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
              ) -> tuple[PC.DeltaMessage | None, str | None]:
        req = self.req
        if req.tool_mode == "named":
            new = shown[self.sent[i]:]
            self.sent[i] = len(shown)
            if not new and not done:
                return None, None
            fn = PC.DeltaFunctionCall(arguments=new)
            call = PC.DeltaToolCall(index=0, function=fn)
            if not self.named_started[i]:
                self.named_started[i] = True
                call.id, call.type, fn.name = self.call_id[i], "function", req.named_tool.function.name
            return PC.DeltaMessage(tool_calls=[call]), finish_reason
        reasoning, text = self.serving._split_reasoning(req, self.echo + shown, done)
        new_reasoning = reasoning[self.sent_reasoning[i]:]
        self.sent_reasoning[i] = len(reasoning)
        streamer = self.streamers[i]
        calls = [PC.DeltaToolCall(index=k, id=cid, type="function" if cid else None,
                                 function=PC.DeltaFunctionCall(name=name, arguments=args))
                 for k, cid, name, args in streamer.update(self._partial_calls(text))]
        if not done:
            end = self._content_end(text)
            new = text[self.sent[i]:end] if end > self.sent[i] else ""
            self.sent[i] = max(self.sent[i], end)
            if not (new or new_reasoning or calls):
                return None, None
            return PC.DeltaMessage(content=new or None, reasoning_content=new_reasoning or None,
                                  tool_calls=calls), None
        content, parsed, finish = self.serving._tool_calls(req, text, finish_reason or "abort")
        if streamer.started:  # what is left before the calls; the calls went as deltas
            rest = text[self.sent[i]:self._content_end(text)]
        else:
            rest = (content or "")[self.sent[i]:] if parsed else text[self.sent[i]:]
        return PC.DeltaMessage(content=rest or None, reasoning_content=new_reasoning or None,
                              tool_calls=calls), finish


# ---- the app ---------------------------------------------------------------------------------
class OpenAIServingChat(OpenAIServing):
    """The chat completions route."""

    # -- /v1/chat/completions ------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        req: PC.ChatCompletionRequest = P.parse_request(PC.ChatCompletionRequest,
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
        if self._parses_special_markers(req):
            sp.skip_special_tokens = False
        self._check_vocab(sp)
        echo = ""
        if req.echo and req.messages[-1].role == "assistant":
            echo = req.messages[-1].text(f"messages.{len(req.messages) - 1}")
        request_id = req.request_id or header_id(request) or P.random_id("chatcmpl")
        prompt = await self._with_images(ids, req.image_urls())
        fanin = self._fanin([prompt], sp, request_id, req.priority, self._lora_of(model))
        await fanin.prime()
        top_k = (req.top_logprobs or 0) if req.logprobs else None
        if top_k == -1:
            top_k = self._vocab_size()
        if req.stream:
            return SSEResponse(self._chat_stream(req, fanin, model, echo, top_k))
        try:
            out = (await collect(fanin, request))[0]
        except ClientGone:
            return Response(status_code=499)
        raise_if_failed([out])
        choices = []
        for c in out.outputs:
            logprobs = None
            if top_k is not None:
                logprobs = PC.ChatCompletionLogProbs(content=chat_logprobs(
                    self.tokens, c.token_ids, c.logprobs or [{}] * len(c.token_ids), top_k))
            reasoning, text = self._split_reasoning(req, echo + c.text, True)
            content, calls, finish = self._tool_calls(req, text, c.finish_reason or "abort")
            choices.append(PC.ChatCompletionResponseChoice(
                index=c.index, message=PC.ChatMessage(role=self._role(req), content=content,
                                                     reasoning_content=reasoning or None,
                                                     tool_calls=calls),
                logprobs=logprobs, finish_reason=finish, stop_reason=c.stop_reason))
        completion = sum(len(c.token_ids) for c in out.outputs)
        n_prompt = len(out.prompt_token_ids or ids)  # image placeholders expanded
        usage = P.UsageInfo(prompt_tokens=n_prompt, completion_tokens=completion,
                            total_tokens=n_prompt + completion,
                            prompt_tokens_details=P.PromptTokensDetails(
                                cached_tokens=out.num_cached_tokens))
        return JSONModel(PC.ChatCompletionResponse(id=request_id, model=model, choices=choices,
                                              usage=usage,
                                              prompt_logprobs=prompt_logprobs(self.tokens, out),
                                              kv_transfer_params=out.kv_transfer_params))

    def _parses_special_markers(self, req: PC.ChatCompletionRequest) -> bool:
        """A parser that finds its markers among special tokens (Gemma 4's tool calls and
        thought channel) needs them in the text, as vLLM's parsers ask for."""
        tools = (req.tool_mode == "auto" and req.tools and self.tool_parser is not None
                 and self.tool_parser.special_markers)
        reasoning = (self.reasoning_parser is not None and self.reasoning_parser.special_markers
                     and req.tool_mode not in ("named", "required"))
        return bool(tools or reasoning)

    def _role(self, req: PC.ChatCompletionRequest) -> str:
        """The answer's role: --response-role after a generation prompt, else the role of the
        message being continued (vLLM's rule)."""
        return self.response_role if req.add_generation_prompt else req.messages[-1].role

    def _split_reasoning(self, req: PC.ChatCompletionRequest, text: str, done: bool
                         ) -> tuple[str, str]:
        """(reasoning, the rest) with ``--reasoning-parser``; a tool call forced by the
        grammar has no reasoning."""
        if self.reasoning_parser is None or req.tool_mode in ("named", "required"):
            return "", text
        return self.reasoning_parser.split_streaming(text, done)

    def _tool_calls(self, req: PC.ChatCompletionRequest, text: str, finish: str
                    ) -> tuple[str | None, list[PC.ToolCall], str]:
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
        tool_calls = [PC.ToolCall(function=PC.FunctionCall(name=n, arguments=a)) for n, a in calls]
        if tool_calls and mode != "named":
            finish = "tool_calls"
        return content, tool_calls, finish

    def _chat_stream(self, req: PC.ChatCompletionRequest, fanin: FanIn, model: str,
                     echo: str, top_k: int | None) -> AsyncIterator[str]:
        created = int(time.time())
        chunks = self._chat_chunks(req, fanin, model, created, echo, top_k)
        return self._stream_tail(chunks, fanin, req.include_usage,
                                 PC.ChatCompletionStreamResponse, created, model)

    async def _chat_chunks(self, req: PC.ChatCompletionRequest, fanin: FanIn, model: str,
                           created: int, echo: str, top_k: int | None) -> AsyncIterator[str]:
        def chunk(index, delta, logprobs=None, finish_reason=None, stop_reason=None,
                  prompt_logprobs=None):
            return sse(PC.ChatCompletionStreamResponse(
                id=fanin.request_id, created=created, model=model,
                choices=[PC.ChatCompletionStreamChoice(
                    index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason,
                    stop_reason=stop_reason)], prompt_logprobs=prompt_logprobs))

        sent_text = [0] * req.n
        sent_tokens = [0] * req.n
        finished: set[int] = set()
        hold = stop_buffer_length(fanin.params.stop, fanin.params.include_stop_str_in_output)
        tools = StreamedToolCalls(self, req, echo)
        for i in range(req.n):
            yield chunk(i, PC.DeltaMessage(role=self._role(req), content=echo))
        prompt_lps_due = fanin.params.prompt_logprobs is not None  # with the first output
        async for ev in fanin.events():
            if ev.output is None:
                continue
            for c in ev.output.outputs:
                i = c.index
                done = c.finish_reason is not None and i not in finished
                shown = shown_text(c, hold)
                new_ids = c.token_ids[sent_tokens[i]:]
                prompt_lps = prompt_logprobs(self.tokens, ev.output) if prompt_lps_due else None
                logprobs = None
                if top_k is not None and new_ids:
                    positions = (c.logprobs or [])[sent_tokens[i]:] or [{}] * len(new_ids)
                    logprobs = PC.ChatCompletionLogProbs(
                        content=chat_logprobs(self.tokens, new_ids, positions, top_k))
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
                    yield chunk(i, delta_msg or PC.DeltaMessage(), logprobs,
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
                yield chunk(i, PC.DeltaMessage(content=delta), logprobs,
                            c.finish_reason if done else None,
                            c.stop_reason if done else None, prompt_lps)
        for i in range(req.n):  # streams that ended without a finish (aborted elsewhere)
            if i not in finished:
                yield chunk(i, PC.DeltaMessage(), finish_reason="abort")

    # -- small routes --------------------------------------------------------------------------
