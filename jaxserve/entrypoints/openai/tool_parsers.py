"""Tool calls in model text, vLLM's ``--tool-call-parser`` names: ``hermes``, ``llama3_json``,
``mistral``, ``gemma4``, ``qwen3_coder``; and the JSON schemas that make ``tool_choice``
"required" / a named function a grammar (the model then cannot answer anything but a valid call).

A parser splits a finished text into (content, [(name, arguments JSON)]); ``content_end`` says
how much of a growing text is surely plain content, so a stream can show that much; and
``partial_calls`` reads the calls of a growing text as far as they are written, so a stream can
send each call's name and then its arguments piece by piece (see ``tool_call_stream``).
"""
from __future__ import annotations

import json
import re
from typing import Any

from jaxserve.entrypoints.openai.tool_call_stream import (PartialCall, call_sequence,
                                                          calls_in_array, partial_call, skip_ws)

ToolCallTuple = tuple[str, str]  # (function name, arguments as a JSON text)


def _args_text(args: Any) -> str:
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _call(obj: Any, args_key: str) -> ToolCallTuple | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            return None
    return obj["name"], _args_text(args)


def _held(text: str, marker: str) -> int:
    """Length of ``text`` that cannot be the start of ``marker``."""
    i = text.find(marker)
    if i >= 0:
        return i
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return len(text) - k
    return len(text)


class ToolParser:
    name = ""
    special_markers = False  # its markers are special tokens: keep them in the text

    def extract(self, text: str) -> tuple[str | None, list[ToolCallTuple]]:
        raise NotImplementedError

    def content_end(self, text: str) -> int:
        raise NotImplementedError

    def partial_calls(self, text: str) -> list[PartialCall]:
        """The calls of a growing text, as far as they are written."""
        raise NotImplementedError


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen, SmolLM2)."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text):
        if self.START not in text:
            return text, []
        calls = []
        for m in self._RE.finditer(text):
            try:
                c = _call(json.loads(m.group(1)), "arguments")
            except ValueError:
                c = None
            if c is None:
                return text, []
            calls.append(c)
        content = text[: text.index(self.START)]
        return (content if content.strip() else None), calls

    def content_end(self, text):
        return _held(text, self.START)

    def partial_calls(self, text):
        calls, i = [], text.find(self.START)
        while i >= 0:
            call, end = partial_call(text, i + len(self.START))
            if call is None:
                break
            calls.append(call)
            if end is None:
                break
            i = text.find(self.START, end)
        return calls


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON calls: the whole answer is ``{"name": ..., "parameters": {...}}`` (several
    joined by ``;``), optionally after ``<|python_tag|>``."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def extract(self, text):
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):].strip()
        if not body.startswith("{"):
            return text, []
        dec, calls, i = json.JSONDecoder(), [], 0
        while i < len(body):
            try:
                obj, i = dec.raw_decode(body, i)
            except ValueError:
                return text, []
            c = _call(obj, "parameters")
            if c is None:
                return text, []
            calls.append(c)
            while i < len(body) and body[i] in " \n\t;":
                i += 1
        return None, calls

    def content_end(self, text):
        s = text.lstrip()
        if not s or s.startswith("{") or self.TAG.startswith(s[:len(self.TAG)]):
            return 0
        return len(text)

    def partial_calls(self, text):
        i = skip_ws(text, 0)
        if text.startswith(self.TAG, i):
            i += len(self.TAG)
        return call_sequence(text, i, ";")


class MistralToolParser(ToolParser):
    """``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (Mistral)."""

    name = "mistral"
    START = "[TOOL_CALLS]"

    def extract(self, text):
        if self.START not in text:
            return text, []
        i = text.index(self.START)
        try:
            obj, _ = json.JSONDecoder().raw_decode(text[i + len(self.START):].lstrip())
        except ValueError:
            return text, []
        objs = obj if isinstance(obj, list) else [obj]
        calls = [_call(o, "arguments") for o in objs]
        if not calls or any(c is None for c in calls):
            return text, []
        content = text[:i]
        return (content if content.strip() else None), calls

    def content_end(self, text):
        return _held(text, self.START)

    def partial_calls(self, text):
        i = text.find(self.START)
        return [] if i < 0 else calls_in_array(text, i + len(self.START))


class Gemma4ToolParser(ToolParser):
    """Gemma 4's native calls, ``<|tool_call>call:NAME{key:value,...}<tool_call|>``, one block
    per call. Values are Gemma's own notation: strings between ``<|"|>`` delimiters, bare keys,
    numbers, ``true``/``false``/``null``, nested ``{...}`` and ``[...]``; they become JSON.

    The markers are special tokens, so requests parsed with it keep special tokens in the text
    (``special_markers``). A call streams as its name, then its whole arguments once the call
    is closed (the notation is converted, so no JSON prefix exists before that)."""

    name = "gemma4"
    special_markers = True
    START, END, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
    _HEAD = re.compile(r"call:([\w.\-]+)\{")

    def _calls(self, text: str):
        """(name, arguments or None while open, end of the block or None) per call block."""
        i = text.find(self.START)
        while i >= 0:
            head = self._HEAD.match(text, i + len(self.START))
            if head is None:
                return
            try:
                args, j = _gemma_object(text, head.end() - 1, self.QUOTE)
            except _Unfinished:
                yield head.group(1), None, None
                return
            end = text.find(self.END, j)
            yield head.group(1), args, (None if end < 0 else end + len(self.END))
            if end < 0:
                return
            i = text.find(self.START, end)

    def extract(self, text):
        if self.START not in text:
            return text, []
        try:
            calls = [(name, json.dumps(args, ensure_ascii=False))
                     for name, args, _ in self._calls(text) if args is not None]
        except ValueError:
            return text, []
        if not calls:
            return text, []
        content = text[: text.index(self.START)]
        return (content if content.strip() else None), calls

    def content_end(self, text):
        return _held(text, self.START)

    def partial_calls(self, text):
        try:
            return [PartialCall(name, "" if args is None else
                                json.dumps(args, ensure_ascii=False), args is not None)
                    for name, args, _ in self._calls(text)]
        except ValueError:
            return []


class _Unfinished(Exception):
    """The text ends inside a value."""


def _skip(text: str, i: int, chars: str = " \n\t") -> int:
    """The index of the first character at or after ``i`` not in ``chars``; the text ending
    first means the value is still being written."""
    while i < len(text) and text[i] in chars:
        i += 1
    if i >= len(text):
        raise _Unfinished
    return i


def _gemma_value(text: str, i: int, quote: str):
    """One value of Gemma 4's notation at ``text[i]`` -> (Python value, index after it)."""
    i = _skip(text, i)
    if text.startswith(quote, i):
        j = text.find(quote, i + len(quote))
        if j < 0:
            raise _Unfinished
        return text[i + len(quote):j], j + len(quote)
    if text[i] == "{":
        return _gemma_object(text, i, quote)
    if text[i] == "[":
        items, i = [], i + 1
        while True:
            i = _skip(text, i, " \n\t,")
            if text[i] == "]":
                return items, i + 1
            v, i = _gemma_value(text, i, quote)
            items.append(v)
    j = i
    while j < len(text) and text[j] not in ",}]":
        j += 1
    if j >= len(text):
        raise _Unfinished
    word = text[i:j].strip()
    if word in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[word], j
    try:
        return json.loads(word), j  # a number
    except ValueError:
        return word, j  # an unquoted word stays text


def _gemma_object(text: str, i: int, quote: str):
    """``{key:value,...}`` at ``text[i] == "{"`` -> (dict, index after ``}``)."""
    obj, i = {}, i + 1
    while True:
        i = _skip(text, i, " \n\t,")
        if text[i] == "}":
            return obj, i + 1
        if text.startswith(quote, i):
            key, i = _gemma_value(text, i, quote)
        else:
            j = text.find(":", i)
            if j < 0:
                raise _Unfinished
            key, i = text[i:j].strip(), j
        i = _skip(text, i)
        if text[i] != ":":
            raise ValueError(f"expected ':' after the key {key!r}")
        obj[key], i = _gemma_value(text, i + 1, quote)


class Qwen3CoderToolParser(ToolParser):
    """Qwen 3.5 / 3.6 and Qwen3-Coder's XML calls::

        <tool_call>
        <function=NAME>
        <parameter=ARG>
        value
        </parameter>
        </function>
        </tool_call>

    A value is taken as JSON when it parses as JSON (numbers, booleans, null, objects, arrays),
    else as a string with the one newline after ``<parameter=ARG>`` and before
    ``</parameter>`` dropped. (vLLM types values by the request's tool schema; this parser does
    not see the schema, so a string parameter whose value looks like a number arrives as one.)
    The arguments of a growing call grow one finished parameter at a time, so every streamed
    prefix is a prefix of the final JSON."""

    name = "qwen3_coder"
    START, END = "<tool_call>", "</tool_call>"
    _FUNC = re.compile(r"<function=([^>\n]+)>")
    _PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

    @staticmethod
    def _value(raw: str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw

    def _calls(self, text: str) -> list[PartialCall]:
        calls, i = [], text.find(self.START)
        while i >= 0:
            m = self._FUNC.search(text, i + len(self.START))
            if m is None or text[i + len(self.START):m.start()].strip():
                break
            body_end = text.find("</function>", m.end())
            body = text[m.end():] if body_end < 0 else text[m.end():body_end]
            params = [(p.group(1).strip(), self._value(p.group(2)))
                      for p in self._PARAM.finditer(body)]
            args = json.dumps(dict(params), ensure_ascii=False)
            done = body_end >= 0
            if not done:  # up to the last finished parameter, the closing brace held back
                args = args[:-1]
            calls.append(PartialCall(m.group(1).strip(), args, done))
            if not done:
                break
            i = text.find(self.START, body_end)
        return calls

    def extract(self, text):
        if self.START not in text:
            return text, []
        calls = self._calls(text)
        if not calls or not all(c.done for c in calls):
            return text, []
        content = text[: text.index(self.START)]
        return (content if content.strip() else None), [(c.name, c.arguments) for c in calls]

    def content_end(self, text):
        return _held(text, self.START)

    def partial_calls(self, text):
        return self._calls(text)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                         Gemma4ToolParser, Qwen3CoderToolParser)}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose from "
                         f"{sorted(TOOL_PARSERS)}") from None


# ---- grammars for tool_choice ---------------------------------------------------------------
# The most calls one "required" answer may hold when parallel calls are allowed.
MAX_PARALLEL_TOOL_CALLS = 8


def _parameters(tool) -> dict:
    p = tool.function.parameters
    return p if p else {"type": "object", "properties": {}}


def named_tool_schema(tool) -> dict:
    """tool_choice = a named function: the answer is that function's arguments object."""
    return _parameters(tool)


def required_tools_schema(tools, parallel: bool) -> dict:
    """tool_choice = "required": a JSON array of calls ``{"name", "parameters"}`` (vLLM's
    shape): exactly one call unless ``parallel``, else at most ``MAX_PARALLEL_TOOL_CALLS``, so
    the array closes even when a model would repeat calls. The parameters are compiled in
    strict mode like every JSON schema (structured_output.strict_json_schema)."""
    items = {"anyOf": [{"type": "object", "additionalProperties": False,
                        "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                       "parameters": _parameters(t)},
                        "required": ["name", "parameters"]} for t in tools]}
    return {"type": "array", "minItems": 1, "items": items,
            "maxItems": MAX_PARALLEL_TOOL_CALLS if parallel else 1}


def partial_required_calls(text: str) -> list[PartialCall]:
    """The calls of a growing "required" answer (a JSON array of ``{"name", "parameters"}``)."""
    return calls_in_array(text, 0)


def parse_required(text: str) -> list[ToolCallTuple] | None:
    """The calls of a "required" answer (None when it is not a complete array of calls)."""
    try:
        objs = json.loads(text)
    except ValueError:
        return None
    if not isinstance(objs, list):
        return None
    calls = [_call(o, "parameters") for o in objs]
    return None if any(c is None for c in calls) else calls
