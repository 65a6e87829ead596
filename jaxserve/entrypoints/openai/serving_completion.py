"""``POST /v1/completions``: prompts (text or ids, one or many) to completion choices."""
from __future__ import annotations

import time
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from jaxserve.core.prompt_embeds import as_embeds, decode_base64
from jaxserve.entrypoints.openai import protocol as P
from jaxserve.errors import InvalidRequestError
from jaxserve.core.outputs import CompletionOutput, RequestOutput
from jaxserve.engine.tokenizer import stop_buffer_length
from jaxserve.entrypoints.openai.logprobs import legacy_logprobs, prompt_logprobs
from jaxserve.entrypoints.openai.responses import ClientGone, JSONModel
from jaxserve.entrypoints.openai.serving_engine import (OpenAIServing, header_id,
                                                       raise_if_failed)
from jaxserve.entrypoints.openai.streaming import FanIn, SSEResponse, collect, shown_text, sse


class OpenAIServingCompletion(OpenAIServing):
    """The completions route."""

    # -- /v1/completions -----------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        req: P.CompletionRequest = P.parse_request(P.CompletionRequest, await self._body(request))
        model = self._model_name(req.model)
        prompts, echo_texts = self._embeds_prompts(req), []
        echo_texts += [""] * len(prompts)
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
        params = [req.to_sampling_params(self.engine.max_model_len, _prompt_len(ids),
                                         self.defaults)
                  for ids in prompts]
        # One SamplingParams serves all prompts; the tightest max_tokens default applies.
        sp = min(params, key=lambda s: s.max_tokens if s.max_tokens is not None else 1 << 62)
        self._check_vocab(sp)
        request_id = req.request_id or header_id(request) or P.random_id("cmpl")
        engine_prompts = prompts
        if isinstance(req.prompt, P.MultiModalPrompt):
            engine_prompts = [await self._with_images(prompts[0], req.prompt.image_urls())]
        if req.kv_transfer_params is not None and len(engine_prompts) != 1:
            raise InvalidRequestError("kv_transfer_params takes one prompt per request",
                                      param="kv_transfer_params")
        fanin = self._fanin(engine_prompts, sp, request_id, req.priority,
                            self._lora_of(model))
        await fanin.prime()
        if req.stream:
            return SSEResponse(self._completion_stream(req, fanin, model, echo_texts))
        try:
            finals = await collect(fanin, request)
        except ClientGone:
            return Response(status_code=499)
        raise_if_failed([finals[i] for i in range(len(prompts))])
        choices = []
        usage = P.UsageInfo()
        for i, ids in enumerate(prompts):
            out = finals[i]
            usage.prompt_tokens += len(out.prompt_token_ids or []) or _prompt_len(ids)
            usage.completion_tokens += sum(len(c.token_ids) for c in out.outputs)
            for c in out.outputs:
                logprobs = None
                if req.logprobs is not None:
                    logprobs = self._completion_choice_logprobs(req, out, c, echo_texts[i])
                choices.append(P.CompletionResponseChoice(
                    index=i * req.n + c.index, text=echo_texts[i] + c.text, logprobs=logprobs,
                    finish_reason=c.finish_reason or "abort", stop_reason=c.stop_reason,
                    prompt_logprobs=prompt_logprobs(self.tokens, out)))
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        choices.sort(key=lambda ch: ch.index)
        return JSONModel(P.CompletionResponse(id=request_id, model=model, choices=choices,
                                              usage=usage,
                                              kv_transfer_params=finals[0].kv_transfer_params))

    def _embeds_prompts(self, req: P.CompletionRequest) -> list[dict]:
        """``prompt_embeds`` decoded: one ``{"prompt_embeds": [n, hidden]}`` prompt each (the
        engine checks the hidden size)."""
        if req.prompt_embeds is None:
            return []
        if not self.engine.config.enable_prompt_embeds:
            raise InvalidRequestError("prompt_embeds needs a server started with "
                                      "--enable-prompt-embeds", param="prompt_embeds")
        items = [req.prompt_embeds] if isinstance(req.prompt_embeds, str) else req.prompt_embeds
        out = []
        for text in items:
            arr = decode_base64(text)
            arr = as_embeds(arr, arr.shape[-1] if arr.ndim else 0)
            if len(arr) > self.engine.max_model_len:
                raise InvalidRequestError(f"prompt_embeds has {len(arr)} rows, more than "
                                          f"max_model_len={self.engine.max_model_len}",
                                          param="prompt_embeds")
            out.append({"prompt_embeds": arr})
        return out

    def _completion_choice_logprobs(self, req, out: RequestOutput, c: CompletionOutput,
                                    echo_text: str) -> P.CompletionLogProbs:
        positions = c.logprobs or [{}] * len(c.token_ids)
        if not req.echo:
            return legacy_logprobs(self.tokens, c.token_ids, positions, 0)
        # Echo: the prompt's tokens first (the first has no logprob), offsets run on through
        # both, counted over the token strings as vLLM does.
        prompt_lps = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        head = legacy_logprobs(self.tokens, out.prompt_token_ids, prompt_lps, 0)
        end = head.text_offset[-1] + len(head.tokens[-1]) if head.tokens else 0
        gen = legacy_logprobs(self.tokens, c.token_ids, positions, end)
        return P.CompletionLogProbs(
            text_offset=head.text_offset + gen.text_offset,
            token_logprobs=head.token_logprobs + gen.token_logprobs,
            tokens=head.tokens + gen.tokens, top_logprobs=head.top_logprobs + gen.top_logprobs)

    def _completion_stream(self, req: P.CompletionRequest, fanin: FanIn, model: str,
                           echo_texts: list[str]) -> AsyncIterator[str]:
        created = int(time.time())
        chunks = self._completion_chunks(req, fanin, model, created, echo_texts)
        return self._stream_tail(chunks, fanin, req.include_usage, P.CompletionStreamResponse,
                                 created, model)

    async def _completion_chunks(self, req: P.CompletionRequest, fanin: FanIn, model: str,
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
                    prompt_lps = prompt_logprobs(self.tokens, ev.output)
                done = c.finish_reason is not None and idx not in finished
                shown = shown_text(c, hold)
                delta = shown[sent_text[idx]:]
                new_ids = c.token_ids[sent_tokens[idx]:]
                # A chunk per step that made tokens, even when their text is still held back
                # (a partial UTF-8 character, a possible stop string): vLLM's rule, so clients
                # see every token arrive.
                if not (prefix or prompt_lps or delta or done or new_ids):
                    continue
                logprobs = None
                if req.logprobs is not None:
                    start = sent_tokens[idx]
                    logprobs = legacy_logprobs(
                        self.tokens, new_ids, (c.logprobs or [])[start:] or [{}] * len(new_ids),
                        len(prefix) + sent_text[idx])
                sent_text[idx] = len(shown)
                sent_tokens[idx] = len(c.token_ids)
                if done:
                    finished.add(idx)
                yield sse(P.CompletionStreamResponse(
                    id=fanin.request_id, created=created, model=model,
                    choices=[P.CompletionResponseChoice(
                        index=idx, text=prefix + delta, logprobs=logprobs,
                        finish_reason=c.finish_reason if done else None,
                        stop_reason=c.stop_reason if done else None,
                        prompt_logprobs=prompt_lps)]))


def _prompt_len(prompt) -> int:
    """Prompt tokens of a token-id prompt, an embeddings prompt or a prompt with images."""
    if isinstance(prompt, dict):
        return len(prompt["prompt_embeds"] if "prompt_embeds" in prompt
                   else prompt["prompt_token_ids"])
    return len(prompt)
