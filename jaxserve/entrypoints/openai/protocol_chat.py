"""Chat-completion bodies of the OpenAI API: messages, tools, the response and its stream
chunks. Shared fields, the sampling rules and the strict-request base live in ``protocol``."""
from __future__ import annotations

import json
import time
from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field, model_validator

from jaxserve.core.sampling_params import SamplingParams, StructuredOutputsParams
from jaxserve.entrypoints.openai.protocol import (INT32_MAX, OpenAIBaseModel, PromptLogprobs,
                                                  RequestModel, UsageInfo, _resolve_max_tokens,
                                                  _SamplingFields, _structured_spec, random_id)
from jaxserve.errors import InvalidRequestError


class ImageURL(RequestModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    url: str
    detail: str | None = None  # OpenAI's hint; the checkpoint's processor decides the size


class ContentPart(RequestModel):
    # a part's keys depend on its type: text and image_url are served, any other type is a 400
    # naming the part (video and audio included)
    model_config = ConfigDict(extra="ignore", strict=True)

    type: str
    text: str | None = None
    image_url: ImageURL | None = None

    def check(self, where: str) -> None:
        if self.type == "text" and self.text is not None:
            return
        if self.type == "image_url" and self.image_url is not None:
            return
        if self.type in ("text", "image_url"):
            raise InvalidRequestError(f"a {self.type} content part needs its {self.type!r} "
                                      "field", param=where)
        raise InvalidRequestError(f"content part type {self.type!r} is not supported (text "
                                  "and image_url are)", param=where)


class FunctionCallParam(RequestModel):
    name: str
    arguments: str


class ToolCallParam(RequestModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessageParam(RequestModel):
    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCallParam] | None = None

    def text(self, where: str) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for j, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                part.check(f"{where}.content.{j}")
                raise InvalidRequestError(
                    f"only text content parts are supported here, got type {part.type!r}",
                    param=f"{where}.content.{j}")
            parts.append(part.text)
        return "".join(parts)

    def image_urls(self, where: str) -> list[tuple[str, str]]:
        """(where, url) of each image part, in order."""
        if not isinstance(self.content, list):
            return []
        out = []
        for j, part in enumerate(self.content):
            part.check(f"{where}.content.{j}")
            if part.type == "image_url":
                out.append((f"{where}.content.{j}", part.image_url.url))
        return out

    def rendered_content(self, where: str):
        """What the chat template sees: a string, or (with images) Qwen's / HF's list of
        ``{"type": "text", "text"}`` and ``{"type": "image"}`` parts."""
        if not self.image_urls(where):
            return self.text(where)
        return [{"type": "text", "text": p.text} if p.type == "text" else {"type": "image"}
                for p in self.content]

    def to_dict(self, where: str) -> dict[str, Any]:
        d: dict[str, Any] = {"role": self.role, "content": self.rendered_content(where)}
        if self.name is not None:
            d["name"] = self.name
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            # templates index the arguments as a mapping (vLLM parses them the same way)
            calls = []
            for j, c in enumerate(self.tool_calls):
                try:
                    args = json.loads(c.function.arguments)
                except ValueError:
                    raise InvalidRequestError(
                        "tool call arguments must be a JSON text",
                        param=f"{where}.tool_calls.{j}.function.arguments") from None
                calls.append({"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": args}})
            d["tool_calls"] = calls
        return d


class FunctionDefinition(RequestModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessageParam]
    max_tokens: int | None = Field(default=None, ge=1)  # deprecated by OpenAI, still accepted
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=-1, le=INT32_MAX)  # -1: whole vocab
    TOP_LOGPROBS_FIELD: ClassVar[str] = "top_logprobs"
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_chat(self):
        if not self.messages:
            raise InvalidRequestError("messages must contain at least one message",
                                      param="messages")
        reserved = {"messages", "conversation", "tools", "documents", "chat_template",
                    "add_generation_prompt", "continue_final_message", "tokenize",
                    "return_dict", "return_assistant_tokens_mask"}
        clash = sorted(reserved & set(self.chat_template_kwargs or {}))
        if clash:
            raise InvalidRequestError(f"chat_template_kwargs may not set {clash}",
                                      param="chat_template_kwargs")
        if self.tool_choice is None:  # OpenAI's default
            self.tool_choice = "auto" if self.tools else "none"
        if self.tool_mode in ("required", "named"):
            if not self.tools:
                raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
            if self.tool_mode == "named" and self.named_tool is None:
                raise InvalidRequestError(
                    f"tool_choice names {self.tool_choice.function.name!r}, which is not in "
                    "tools", param="tool_choice")
            if _structured_spec(self) is not None:
                raise InvalidRequestError("tool_choice required or a named function cannot be "
                                          "combined with a structured output",
                                          param="tool_choice")
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true",
                                      param="top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequestError(
                "continue_final_message and add_generation_prompt cannot both be true",
                param="continue_final_message")
        return self

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.to_dict(f"messages.{i}") for i, m in enumerate(self.messages)]

    def image_urls(self) -> list[tuple[str, str]]:
        """(where, url) of every image part of the conversation, in order."""
        return [u for i, m in enumerate(self.messages) for u in m.image_urls(f"messages.{i}")]

    @property
    def tool_mode(self) -> str:
        """none | auto | required | named."""
        return self.tool_choice if isinstance(self.tool_choice, str) else "named"

    @property
    def named_tool(self) -> ChatCompletionToolsParam | None:
        if not isinstance(self.tool_choice, NamedToolChoice):
            return None
        return next((t for t in self.tools or () if t.function.name ==
                     self.tool_choice.function.name), None)

    def template_tools(self) -> list[dict] | None:
        """The tools as the chat template sees them (none when tool_choice is "none")."""
        if not self.tools or self.tool_mode == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def _tool_spec(self) -> StructuredOutputsParams | None:
        from jaxserve.entrypoints.openai.tool_parsers import (named_tool_schema,
                                                              required_tools_schema)
        if self.tool_mode == "named":
            return StructuredOutputsParams(json=named_tool_schema(self.named_tool),
                                           _origin="tools")
        if self.tool_mode == "required":
            return StructuredOutputsParams(
                json=required_tools_schema(self.tools, self.parallel_tool_calls is not False),
                _origin="tools")
        return None

    def content_bytes(self) -> int:
        """UTF-8 bytes of all message text: the rendered prompt holds at least these."""
        total = 0
        for i, m in enumerate(self.messages):
            if isinstance(m.content, list):
                m.image_urls(f"messages.{i}")  # every part checked
                total += sum(len(p.text.encode()) for p in m.content if p.type == "text")
            else:
                total += len(m.text(f"messages.{i}").encode())
        return total

    def to_sampling_params(self, max_model_len: int, prompt_len: int,
                           defaults: dict | None = None) -> SamplingParams:
        kw = self._sampling_kwargs(defaults)
        requested = self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens
        param = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        kw["max_tokens"] = _resolve_max_tokens(requested, max_model_len, prompt_len, param)
        kw["logprobs"] = (self.top_logprobs or 0) if self.logprobs else None
        tool_spec = self._tool_spec()
        if tool_spec is not None:
            kw["structured_outputs"] = tool_spec
        return SamplingParams(**kw)


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str


class ToolCall(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl-tool"))
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a prefill's, for its remote decode


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)


class ChatCompletionStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None  # in a stream's first chunk


class TokenizeChatRequest(RequestModel):
    model: str | None = None
    messages: list[ChatMessageParam]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _check(self):
        if not self.messages:
            raise InvalidRequestError("messages must contain at least one message",
                                      param="messages")
        return self

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.to_dict(f"messages.{i}") for i, m in enumerate(self.messages)]
