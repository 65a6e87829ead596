"""Tool calls streamed as they are written (vLLM's streaming shape): per call index, one delta
with the call's id, type and function name as soon as the name is complete, then the
arguments in fragments whose concatenation is the call's arguments JSON.

A tolerant scanner reads the growing text of a JSON object (``{"name": ..., "arguments":
{...}}``) without parsing it whole: where each key's value starts and, once written, where it
ends. An arguments object is streamed as its raw text (each new piece of the text is a new
fragment, so the fragments join to exactly what the model wrote); an arguments value written
as a JSON string is sent whole when it is complete, decoded.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

_WS = " \t\n\r"
ARGUMENT_KEYS = ("arguments", "parameters")


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON string starting at ``text[i] == '"'``; None if unfinished."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at ``i``; None while it is unfinished. A
    number or literal at the very end of the text is unfinished (more digits may follow)."""
    i = skip_ws(text, i)
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                e = _string_end(text, j)
                if e is None:
                    return None
                j = e
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in ",}]" + _WS:
        j += 1
    return j if j < len(text) else None


def scan_object(text: str, i: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """The keys of the (possibly unfinished) object at ``i``: ``{key: (value start, value end
    or None)}`` for each key whose value has started, and the object's end (None while
    unfinished or malformed)."""
    fields: dict[str, tuple[int, int | None]] = {}
    i = skip_ws(text, i)
    if i >= len(text) or text[i] != "{":
        return fields, None
    j = i + 1
    while True:
        j = skip_ws(text, j)
        if j >= len(text):
            return fields, None
        if text[j] == "}":
            return fields, j + 1
        if text[j] == ",":
            j += 1
            continue
        if text[j] != '"':
            return fields, None
        ke = _string_end(text, j)
        if ke is None:
            return fields, None
        try:
            key = json.loads(text[j:ke])
        except ValueError:
            return fields, None
        j = skip_ws(text, ke)
        if j >= len(text) or text[j] != ":":
            return fields, None
        vs = skip_ws(text, j + 1)
        if vs >= len(text):
            return fields, None
        ve = value_end(text, vs)
        fields[key] = (vs, ve)
        if ve is None:
            return fields, None
        j = ve


@dataclass
class PartialCall:
    """What is known so far of one call: its name once complete, the arguments text written so
    far (always a prefix of the final one), and whether the arguments are complete."""

    name: str | None
    arguments: str = ""
    done: bool = False


def partial_call(text: str, start: int) -> tuple[PartialCall | None, int | None]:
    """The call object at ``start`` (``{"name": ..., "arguments"|"parameters": ...}``) and the
    object's end (None while unfinished). None for the call until its name is complete."""
    fields, end = scan_object(text, start)
    name = None
    if "name" in fields and fields["name"][1] is not None:
        vs, ve = fields["name"]
        try:
            name = json.loads(text[vs:ve])
        except ValueError:
            name = None
    if not isinstance(name, str):
        return None, end
    call = PartialCall(name)
    key = next((k for k in ARGUMENT_KEYS if k in fields), None)
    if key is not None:
        vs, ve = fields[key]
        if text[vs] == '"':  # arguments written as a JSON string: sent whole, decoded
            if ve is not None:
                try:
                    call.arguments, call.done = json.loads(text[vs:ve]), True
                except ValueError:
                    pass
        elif text[vs] in "{[":
            call.arguments = text[vs:ve] if ve is not None else text[vs:]
            call.done = ve is not None
    elif end is not None:  # a finished call without arguments: an empty object
        call.arguments, call.done = "{}", True
    return call, end


def calls_in_array(text: str, i: int) -> list[PartialCall]:
    """The calls of a JSON array of call objects starting at ``i`` (tool_choice "required",
    Mistral's ``[TOOL_CALLS]``); a single object instead of an array is one call."""
    i = skip_ws(text, i)
    if i >= len(text):
        return []
    if text[i] == "{":
        call, _ = partial_call(text, i)
        return [call] if call is not None else []
    if text[i] != "[":
        return []
    return call_sequence(text, i + 1, ",")


def call_sequence(text: str, i: int, separators: str) -> list[PartialCall]:
    """The call objects from ``i`` on, apart by whitespace and ``separators``, up to the first
    thing that is not a call; the last one may be partial."""
    calls = []
    while True:
        while i < len(text) and (text[i] in _WS or text[i] in separators):
            i += 1
        if i >= len(text) or text[i] != "{":
            return calls
        call, end = partial_call(text, i)
        if call is None:
            return calls
        calls.append(call)
        if end is None:
            return calls
        i = end


@dataclass
class ToolCallStreamer:
    """Turns successive views of one choice's growing calls into deltas: ``(index, id, name,
    arguments fragment)`` tuples, id and name only on a call's first delta."""

    max_calls: int | None = None  # 1 when parallel_tool_calls is false
    ids: list[str] = field(default_factory=list)
    sent_args: list[int] = field(default_factory=list)
    new_id: object = None  # () -> a fresh call id

    @property
    def started(self) -> bool:
        return bool(self.ids)

    def update(self, calls: list[PartialCall]) -> list[tuple[int, str | None, str | None, str]]:
        if self.max_calls is not None:
            calls = calls[:self.max_calls]
        out = []
        for k, call in enumerate(calls):
            if k == len(self.ids):  # a new call: its header (and any arguments already there)
                self.ids.append(self.new_id())
                self.sent_args.append(0)
                out.append((k, self.ids[k], call.name, call.arguments))
                self.sent_args[k] = len(call.arguments)
                continue
            new = call.arguments[self.sent_args[k]:]
            if new:
                out.append((k, None, None, new))
                self.sent_args[k] = len(call.arguments)
        return out
