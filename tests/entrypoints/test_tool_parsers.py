"""Tool call parsers on canned model text (the formats of Hermes/Qwen/SmolLM2, Llama 3 and
Mistral), the prefix a stream may show before a call is complete, and the "required" schema."""
from __future__ import annotations

import json

import jsonschema
import pytest

from jaxserve.entrypoints.openai import protocol as P
from jaxserve.entrypoints.openai import protocol_chat as PC
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
    return [PC.ChatCompletionToolsParam.model_validate(t) for t in (
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
        P.parse_request(PC.ChatCompletionRequest,
                        {"messages": [{"role": "user", "content": "x"}], **body})
    assert getattr(e.value, "param", None) == param, e.value


def test_assistant_tool_calls_reach_the_template_as_mappings():
    req = P.parse_request(PC.ChatCompletionRequest, {"messages": [
        {"role": "user", "content": "add"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"}]})
    msgs = req.message_dicts()
    assert msgs[1]["tool_calls"][0]["function"] == {"name": "f", "arguments": {"x": 1}}
    assert msgs[2] == {"role": "tool", "content": "1", "tool_call_id": "c1"}


# ---- streaming: calls read from a growing text -------------------------------------------------
def _stream(partial_calls, text: str, cuts, max_calls=None):
    """Feed ``text`` cut at ``cuts`` (every prefix a stream could show) to a streamer; return
    the deltas per call index."""
    from jaxserve.entrypoints.openai.tool_call_stream import ToolCallStreamer

    ids = iter(range(1000))
    st = ToolCallStreamer(max_calls=max_calls, new_id=lambda: f"call-{next(ids)}")
    per_call: dict[int, list] = {}
    for end in list(cuts) + [len(text)]:
        for k, cid, name, args in st.update(partial_calls(text[:end])):
            per_call.setdefault(k, []).append((cid, name, args))
    return per_call


def _check_streamed(per_call, want):
    """First delta: id, name; later ones: argument fragments only; they join to the arguments
    JSON the model wrote."""
    assert len(per_call) == len(want)
    for k, (name, args) in enumerate(want):
        deltas = per_call[k]
        assert deltas[0][0] == f"call-{k}" and deltas[0][1] == name
        assert all(cid is None and n is None for cid, n, _ in deltas[1:])
        joined = "".join(a for _, _, a in deltas)
        assert json.loads(joined) == args
        assert sum(1 for _, _, a in deltas if a) > 1  # the arguments came in pieces


HERMES_TWO = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
              '"Pa}ris \\"x\\" {", "days": [1, 2.5e1, {"n": null}], "ok": true}}\n</tool_call>\n'
              '<tool_call>{"name":"add","arguments":{"a":1,"b":-20}}</tool_call>')
HERMES_WANT = [("get_weather", {"city": 'Pa}ris "x" {', "days": [1, 25.0, {"n": None}],
                                "ok": True}), ("add", {"a": 1, "b": -20})]


@pytest.mark.parametrize("step", [1, 3, 7])
def test_hermes_calls_stream_name_first_then_argument_fragments(step):
    p = get_tool_parser("hermes")
    per_call = _stream(p.partial_calls, HERMES_TWO, range(1, len(HERMES_TWO), step))
    _check_streamed(per_call, HERMES_WANT)
    assert [n for n, _ in p.extract(HERMES_TWO)[1]] == ["get_weather", "add"]
    # parallel_tool_calls false: only the first call is streamed
    one = _stream(p.partial_calls, HERMES_TWO, range(1, len(HERMES_TWO), step), max_calls=1)
    _check_streamed(one, HERMES_WANT[:1])


def test_streaming_follows_a_tokenizer_split(tiny_llama_dir):
    """The same on the pieces a real tokenizer cuts the text into (one token per step)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ids = tok.encode(HERMES_TWO, add_special_tokens=False)
    cuts = [len(tok.decode(ids[:n])) for n in range(1, len(ids))]
    assert tok.decode(ids) == HERMES_TWO
    _check_streamed(_stream(get_tool_parser("hermes").partial_calls, HERMES_TWO, cuts),
                    HERMES_WANT)


def test_required_llama3_and_mistral_calls_stream():
    from jaxserve.entrypoints.openai.tool_parsers import partial_required_calls

    text = ('[{"name":"get_weather","parameters":{"city":"Oslo","unit":"celsius"}},'
            '{"name":"add","parameters":{"a":3,"b":4}}]')
    want = [("get_weather", {"city": "Oslo", "unit": "celsius"}), ("add", {"a": 3, "b": 4})]
    _check_streamed(_stream(partial_required_calls, text, range(1, len(text))), want)
    assert [(n, json.loads(a)) for n, a in parse_required(text)] == want
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}; {"name": "add", "parameters": {"a": 3, "b": 4}}'
    _check_streamed(_stream(get_tool_parser("llama3_json").partial_calls, text,
                            range(1, len(text))), want)
    text = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}, {"name": "add", "arguments": {"a": 3, "b": 4}}]'
    _check_streamed(_stream(get_tool_parser("mistral").partial_calls, text,
                            range(1, len(text))), want)


def test_partial_call_edge_cases():
    from jaxserve.entrypoints.openai.tool_call_stream import partial_call

    assert partial_call('{"name": "ad', 0) == (None, None)  # no call before the name is whole
    call, end = partial_call('{"name": "f", "arguments": {"x": 12', 0)
    assert (call.name, call.arguments, call.done, end) == ("f", '{"x": 12', False, None)
    # arguments written as a JSON string: sent whole and decoded, once complete
    call, _ = partial_call('{"name": "f", "arguments": "{\\"x\\": 1', 0)
    assert call.arguments == "" and not call.done
    text = '{"name": "f", "arguments": "{\\"x\\": 1}"}'
    call, end = partial_call(text, 0)
    assert json.loads(call.arguments) == {"x": 1} and call.done and end == len(text)
    call, _ = partial_call('{"name": "f"}', 0)  # no arguments: an empty object
    assert call.arguments == "{}" and call.done


QWEN3_CODER_TWO = (
    "I will look it up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco, "
    "CA\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=opts>\n{\"units\": \"C\", "
    "\"hourly\": false}\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=ping>\n"
    "</function>\n</tool_call>")
QWEN3_CODER_WANT = [("get_weather", {"city": "San Francisco, CA", "days": 3,
                                     "opts": {"units": "C", "hourly": False}}), ("ping", {})]


def test_qwen3_coder_xml_calls():
    p = get_tool_parser("qwen3_coder")
    content, calls = p.extract(QWEN3_CODER_TWO)
    assert content == "I will look it up.\n"
    assert [(n, json.loads(a)) for n, a in calls] == QWEN3_CODER_WANT
    assert p.extract("no calls here") == ("no calls here", [])
    # an unfinished call is not a call: the text stays content
    cut = QWEN3_CODER_TWO[:QWEN3_CODER_TWO.index("</function>")]
    assert p.extract(cut) == (cut, [])
    assert p.content_end("Sure <tool_") == len("Sure ")


@pytest.mark.parametrize("step", [1, 5, 11])
def test_qwen3_coder_calls_stream_each_finished_parameter(step):
    p = get_tool_parser("qwen3_coder")
    text = QWEN3_CODER_TWO
    per_call = _stream(p.partial_calls, text, range(1, len(text), step))
    assert len(per_call) == 2
    first = per_call[0]
    assert first[0][:2] == ("call-0", "get_weather")
    assert json.loads("".join(a for _, _, a in first)) == QWEN3_CODER_WANT[0][1]
    assert sum(1 for _, _, a in first if a) > 1  # parameter by parameter
    assert json.loads("".join(a for _, _, a in per_call[1])) == {}
