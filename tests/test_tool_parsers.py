"""Tool call parsers on canned model text (the formats of Hermes/Qwen/SmolLM2, Llama 3 and
Mistral), the prefix a stream may show before a call is complete, and the "required" schema."""
from __future__ import annotations

import json

import jsonschema
import pytest

from jaxserve.entrypoints.openai import protocol as P
from jaxserve.errors import InvalidRequestError
from jaxserve.entrypoints.openai.tool_parsers import (get_tool_parser, parse_required,
                                                      required_tools_schema)


def test_hermes():
    p = get_tool_parser("hermes")
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    content, calls = p.extract(text)
    assert content == "Let me check.\n"
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Paris"}),
                                                      ("add", {"a": 1, "b": 2})]
    assert p.extract("no call here") == ("no call here", [])
    assert p.extract("<tool_call>{not json</tool_call>")[1] == []  # stays content
    assert p.content_end("Hello <tool") == len("Hello ")  # a marker's prefix is held
    assert p.content_end("Hello <tool_call>{") == len("Hello ")
    assert p.content_end("Hello there") == len("Hello there")


def test_llama3_json():
    p = get_tool_parser("llama3_json")
    content, calls = p.extract('<|python_tag|>{"name": "f", "parameters": {"x": 1}}; '
                               '{"name": "g", "parameters": {}}')
    assert content is None and calls == [("f", '{"x": 1}'), ("g", "{}")]
    assert p.extract("Just text.") == ("Just text.", [])
    assert p.extract('{"name": "f", "parameters": {"x": 1}')[1] == []  # incomplete
    assert p.content_end('  {"na') == 0 and p.content_end("<|python") == 0
    assert p.content_end("Sure") == 4


def test_mistral():
    p = get_tool_parser("mistral")
    content, calls = p.extract('Ok [TOOL_CALLS][{"name": "f", "arguments": {"q": "a b"}}]')
    assert content == "Ok " and calls == [("f", '{"q": "a b"}')]
    assert p.extract("[TOOL_CALLS] nonsense")[1] == []
    assert p.content_end("Ok [TOOL_") == 3


def test_unknown_parser():
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")


def _tools():
    return [P.ChatCompletionToolsParam.model_validate(t) for t in (
        {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}},
        {"type": "function", "function": {"name": "g"}})]


def test_required_schema_accepts_calls_and_refuses_the_rest():
    schema = required_tools_schema(_tools(), parallel=True)
    jsonschema.validate([{"name": "f", "parameters": {"x": 3}}, {"name": "g", "parameters": {}}],
                        schema)
    for bad in ([], [{"name": "h", "parameters": {}}], [{"name": "f", "parameters": {"x": "a"}}],
                {"name": "f", "parameters": {"x": 1}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "g", "parameters": {}}] * 2,
                            required_tools_schema(_tools(), parallel=False))
    assert parse_required('[{"name": "f", "parameters": {"x": 3}}]') == [("f", '{"x": 3}')]
    assert parse_required('[{"name": "f"') is None


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "guided_regex": "a"}, "tool_choice"),
])
def test_bad_tool_choice_is_refused_by_name(body, param):
    with pytest.raises(InvalidRequestError) as e:
        P.parse_request(P.ChatCompletionRequest,
                        {"messages": [{"role": "user", "content": "x"}], **body})
    assert getattr(e.value, "param", None) == param, e.value


def test_assistant_tool_calls_reach_the_template_as_mappings():
    req = P.parse_request(P.ChatCompletionRequest, {"messages": [
        {"role": "user", "content": "add"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"}]})
    msgs = req.message_dicts()
    assert msgs[1]["tool_calls"][0]["function"] == {"name": "f", "arguments": {"x": 1}}
    assert msgs[2] == {"role": "tool", "content": "1", "tool_call_id": "c1"}
