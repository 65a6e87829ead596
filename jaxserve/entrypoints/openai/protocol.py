"""Request and response bodies of the OpenAI API (plus vLLM's extra sampling fields), in pydantic.

Requests are strict: types as OpenAI's schema, and a field is either implemented or answered
with a 400 that names it (OpenAI refuses unknown arguments too; vLLM would drop them). Each
request turns into ``SamplingParams`` through ``to_sampling_params``, which is where the OpenAI
names meet the engine's and where length limits are checked.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from jaxserve.errors import InvalidRequestError
from jaxserve.core.sampling_params import (SamplingParams, StructuredOutputsParams,
                                           resolve_num_logprobs)

# OpenAI caps n at 128 for chat; the same bound keeps one request from filling the batch.
MAX_N = 128
INT32_MAX = 2**31 - 1  # token ids, top_k, priorities end up in int32 arrays


def truncate_prompt(ids: list[int], keep: int | None) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: keep the prompt's last ``keep`` tokens (left
    truncation, so the end of a conversation survives)."""
    return ids if keep is None or len(ids) <= keep else ids[-keep:]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


def _inert(*values):
    """A field that is fine when absent or set to one of ``values`` (what asks for nothing)."""
    return lambda v: v is None or any(v == x and type(v) is type(x) for x in values)


# OpenAI and vLLM request fields this server does not implement: sent with a value that asks
# for something (not null / the no-op value), they are a 400 naming the field, never dropped.
UNSUPPORTED_FIELDS: dict[str, Any] = {
    **{name: _inert() for name in (
        "guided_decoding_backend", "guided_whitespace_pattern",
        "logits_processors", "prompt_embeds",
        "mm_processor_kwargs", "cache_salt", "kv_transfer_params", "documents",
        "chat_template", "audio", "prediction", "reasoning_effort", "web_search_options",
        "length_penalty", "thinking_token_budget")},
    "functions": _inert([]),
    "function_call": _inert("none", "auto"),
    "chat_template_kwargs": _inert({}),  # chat requests implement it (and chat_template)
    "use_beam_search": _inert(False),
    "early_stopping": _inert(False),
    "include_reasoning": _inert(False),
    "return_tokens_as_token_ids": _inert(False),
    "return_token_ids": _inert(False),
    "modalities": _inert(["text"]),
    "store": _inert(False),
    "metadata": lambda v: True,  # only kept with store=true, which is refused
    "service_tier": lambda v: True,  # scheduling hint of OpenAI's fleet: nothing to do here
    "continuous_usage_stats": _inert(False),
    "refusal": _inert(),
}


class RequestModel(OpenAIBaseModel):
    """A request body: strict types, as OpenAI's schema (``true`` is not 1, ``"1"`` is not 1),
    and every field either implemented or refused: a known field we lack is a 400 naming it
    (``UNSUPPORTED_FIELDS``), an unknown one too (OpenAI: "Unrecognized request argument")."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        kept = {}
        for name, value in data.items():
            inert = UNSUPPORTED_FIELDS.get(name)
            if inert is None or name in cls.model_fields:
                kept[name] = value
            elif not inert(value):
                raise InvalidRequestError(f"{name} is not supported by this server",
                                          param=name)
        return kept


def parse_request(model_cls: type[BaseModel], body: Any) -> BaseModel:
    """Validate a decoded JSON body; every failure becomes ``InvalidRequestError`` with the field
    that caused it as ``param`` (pydantic wraps the ones raised by our own validators)."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object", param=None)
    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        raise _from_validation_error(e) from None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "json-or-python"}


def _from_validation_error(e: ValidationError) -> InvalidRequestError:
    err = e.errors(include_url=False)[0]
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, InvalidRequestError):
        return InvalidRequestError(cause.message, param=cause.param,
                                   status_code=cause.status_code)
    if err.get("type") == "extra_forbidden":
        param = ".".join(str(p) for p in err.get("loc", ()))
        return InvalidRequestError(f"Unrecognized request argument supplied: {param}",
                                   param=param)
    path = []
    for part in err.get("loc", ()):
        if isinstance(part, int) or (part.isidentifier() and part not in _TYPE_TAGS):
            path.append(str(part))
        else:  # a union member tag such as "list[int]": the rest describes that member
            break
    param = ".".join(path) or None
    msg = err.get("msg", "invalid value")
    return InvalidRequestError(f"{param}: {msg}" if param else msg, param=param)


# ---- errors ----------------------------------------------------------------------------------
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# ---- shared pieces ---------------------------------------------------------------------------
class StreamOptions(RequestModel):
    include_usage: bool | None = False


class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    out = {}
    for k, v in bias.items():
        try:
            tok = int(k)
        except ValueError:
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {k!r}",
                                      param="logit_bias") from None
        if not -100.0 <= v <= 100.0:
            raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {v!r}",
                                      param="logit_bias")
        out[tok] = v
    return out


def _resolve_max_tokens(requested: int | None, max_model_len: int, prompt_len: int,
                        param: str) -> int:
    """vLLM's rule: no limit given -> the room left in the context; too much asked -> 400."""
    room = max_model_len - prompt_len
    if room < 1:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {prompt_len} tokens, which leaves no room for a completion. "
            "Please reduce the length of the prompt.", param="prompt")
    if requested is None:
        return room
    if requested > room:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} "
            "in the completion). Please reduce the length of the prompt or completion.",
            param=param)
    return requested


# ---- structured outputs ----------------------------------------------------------------------
class JsonSchemaFormat(RequestModel):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced (the grammar allows nothing else)


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.type == "json_schema" and (self.json_schema is None
                                           or self.json_schema.json_schema is None):
            raise InvalidRequestError("response_format of type json_schema needs "
                                      "json_schema.schema", param="response_format")
        return self


class StructuredOutputsField(RequestModel):
    """vLLM's ``structured_outputs`` request field (one of these)."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None


def _structured_spec(req) -> StructuredOutputsParams | None:
    """The one grammar a request asks for, from whichever field names it (OpenAI's
    ``response_format``, vLLM's ``structured_outputs`` or the older ``guided_*``)."""
    found: list[tuple[str, dict]] = []
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type != "text":
        found.append(("response_format",
                      {"json_object": True} if rf.type == "json_object"
                      else {"json": rf.json_schema.json_schema}))
    if req.structured_outputs is not None:
        so = {k: v for k, v in req.structured_outputs.model_dump(by_alias=True).items()
              if v is not None and v is not False}
        kind = next(iter(so), None) if len(so) == 1 else None
        found.append((f"structured_outputs.{kind}" if kind else "structured_outputs", so))
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        v = getattr(req, name)
        if v is not None:
            found.append((name, {name[len("guided_"):]: v}))
    if not found:
        return None
    if len(found) > 1:
        names = [f.split(".")[0] for f, _ in found]
        raise InvalidRequestError(f"only one structured output may be asked for, got {names}",
                                  param=names[1])
    origin, kw = found[0]
    return StructuredOutputsParams(**kw, _origin=origin)


class _SamplingFields(RequestModel):
    """Fields common to completions and chat: OpenAI's, then vLLM's extras (same defaults)."""

    model: str | None = None
    frequency_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    best_of: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    user: str | None = None
    # vLLM extras
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = Field(default=0, ge=0, le=INT32_MAX)
    ignore_eos: bool = False
    priority: int = Field(default=0, ge=-INT32_MAX, le=INT32_MAX)
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = Field(default=None, ge=-1, le=INT32_MAX)  # -1: whole vocab
    echo: bool = False
    request_id: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    allowed_token_ids: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | None = Field(
        default=None, min_length=1)
    bad_words: list[str] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # jaxserve's extra: this request is never speculated on (see SamplingParams)
    disable_speculative_decoding: bool = False
    # vLLM's per-request arguments for custom logits processors (SamplingParams.extra_args)
    vllm_xargs: dict[str, Union[str, int, float, bool, list[Union[str, int, float]]]] | None \
        = None
    # vLLM's disaggregated prefill/decode (NIXL protocol): {"do_remote_decode": true} on a
    # prefill, the prefill response's params on its decode (core.kv_transfer checks them)
    kv_transfer_params: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_common(self):
        if self.vllm_xargs and "return_hidden_states" in self.vllm_xargs:
            raise InvalidRequestError("return_hidden_states is not served over HTTP (the "
                                      "responses do not carry hidden states; use the Python "
                                      "API)", param="vllm_xargs")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of is not supported (it must be unset or equal n)",
                                      param="best_of")
        if (self.kv_transfer_params is not None and self.n != 1
                and self.kv_transfer_params.get("do_remote_decode")):
            raise InvalidRequestError("kv_transfer_params.do_remote_decode needs n = 1 (the "
                                      "decode request asks for n)", param="kv_transfer_params")
        if (self.kv_transfer_params is not None and self.stream
                and self.kv_transfer_params.get("do_remote_decode")):
            raise InvalidRequestError("kv_transfer_params.do_remote_decode needs stream false "
                                      "(the response carries the decode's params)",
                                      param="kv_transfer_params")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true",
                                      param="stream_options")
        return self

    def check_logprobs(self, max_logprobs: int, vocab_size: int) -> None:
        """The logprob counts asked for against the server's ``--max-logprobs`` (vLLM's rule:
        -1 is the whole vocabulary); a 400 naming the field."""
        for name in ("prompt_logprobs", self.TOP_LOGPROBS_FIELD):
            resolve_num_logprobs(name, getattr(self, name), max_logprobs, vocab_size)

    TOP_LOGPROBS_FIELD: ClassVar[str] = "logprobs"  # the request field of the top-k count

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _sampling_kwargs(self, defaults: dict | None = None) -> dict[str, Any]:
        kw: dict[str, Any] = dict(
            n=self.n, presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0, seed=self.seed,
            stop=_stop_list(self.stop), stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            logit_bias=_logit_bias(self.logit_bias), prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=_structured_spec(self),
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words or None,
            disable_speculative_decoding=self.disable_speculative_decoding,
            extra_args=dict(self.vllm_xargs) if self.vllm_xargs else None)
        if self.kv_transfer_params is not None:
            kw["extra_args"] = {**(kw["extra_args"] or {}),
                                "kv_transfer_params": dict(self.kv_transfer_params)}
        # None means the model's default (its generation config), else SamplingParams' own.
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if value is None:
                value = (defaults or {}).get(name)
            if value is not None:
                kw[name] = value
        return kw


# ---- completions -----------------------------------------------------------------------------
class MultiModalPrompt(RequestModel):
    """vLLM's prompt dict over HTTP: text (or ids) holding the model's image placeholders, and
    its images as URLs (``data:``, ``file://``, http(s)) in ``multi_modal_data.image``."""

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    multi_modal_data: dict[str, Any]

    def check(self) -> None:
        """(Called by the request: an error raised inside a union member would lose its
        field name.)"""
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise InvalidRequestError("a prompt dict needs exactly one of prompt and "
                                      "prompt_token_ids", param="prompt")
        for k in self.multi_modal_data:
            if k != "image":
                raise InvalidRequestError(f"prompt.multi_modal_data.{k}: only images are "
                                          "supported (video and audio are not)",
                                          param=f"prompt.multi_modal_data.{k}")

    def image_urls(self) -> list[tuple[str, str]]:
        images = self.multi_modal_data.get("image")
        if images is None:
            return []
        single = not isinstance(images, list)
        images = [images] if single else images
        out = []
        for j, im in enumerate(images):
            where = "prompt.multi_modal_data.image" + ("" if single else f".{j}")
            if isinstance(im, dict) and im.get("type") == "image_url":
                im = (im.get("image_url") or {}).get("url")
            if not isinstance(im, str):
                raise InvalidRequestError(f"{where} must be an image URL (data:, file:// or "
                                          "http(s)) or an image_url part", param=where)
            out.append((where, im))
        return out


class CompletionRequest(_SamplingFields):
    prompt: Union[list[int], list[list[int]], str, list[str], MultiModalPrompt,
                   None] = None
    # --enable-prompt-embeds: base64 of a torch.save'd float tensor [tokens, hidden] (vLLM's
    # format) or of a .npy array; run before the prompts, as vLLM orders them
    prompt_embeds: Union[str, list[str], None] = None
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=-1, le=INT32_MAX)  # -1: whole vocabulary
    suffix: str | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _check_prompt(self):
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")
        p = self.prompt
        if isinstance(p, MultiModalPrompt):
            p.check()
            return self
        if p is None:
            if self.prompt_embeds is None:
                raise InvalidRequestError("prompt (or prompt_embeds) is required",
                                          param="prompt")
            if not self.prompt_embeds:
                raise InvalidRequestError("prompt_embeds must not be empty",
                                          param="prompt_embeds")
            return self
        if isinstance(p, str):
            return self
        if len(p) == 0:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        for item in p:
            if isinstance(item, list) and len(item) == 0:
                raise InvalidRequestError("prompt must not contain an empty token list",
                                          param="prompt")
        return self

    def prompt_list(self) -> list[str | list[int]]:
        """The prompts of this (possibly batched) request, each a string or a token id list."""
        p = self.prompt
        if isinstance(p, MultiModalPrompt):
            return [p.prompt if p.prompt is not None else list(p.prompt_token_ids)]
        if p is None:
            return []
        if isinstance(p, str):
            return [p]
        if all(isinstance(t, int) for t in p):
            return [list(p)]
        return list(p)

    def to_sampling_params(self, max_model_len: int, prompt_len: int,
                           defaults: dict | None = None) -> SamplingParams:
        kw = self._sampling_kwargs(defaults)
        kw["max_tokens"] = _resolve_max_tokens(self.max_tokens, max_model_len, prompt_len,
                                               "max_tokens")
        kw["logprobs"] = self.logprobs
        if self.echo and self.logprobs is not None and kw["prompt_logprobs"] is None:
            kw["prompt_logprobs"] = self.logprobs
        return SamplingParams(**kw)


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


# vLLM's prompt_logprobs: per prompt position, None (the first) or token id -> its logprob
PromptLogprobs = list[dict[str, dict[str, Any]] | None]


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a prefill's, for its remote decode


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# ---- models ----------------------------------------------------------------------------------
class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "jaxserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


# ---- tokenize / detokenize (vLLM's extra routes) ---------------------------------------------
class TokenizeCompletionRequest(RequestModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
