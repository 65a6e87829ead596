"""JSON schemas compile in strict mode (vLLM's default grammar backend): an object admits only
the properties its schema lists unless the schema says otherwise, and the "required" tool-call
array closes. Checked on the grammar the engine compiles (``grammar_text``) with a byte-level
tokenizer, so every text is matched byte by byte (fast: no model)."""
from __future__ import annotations

import json

import pytest

llguidance = pytest.importorskip("llguidance")

from llguidance._tokenizer import TokenizerWrapper  # noqa: E402

from jaxserve.core.sampling_params import StructuredOutputsParams  # noqa: E402
from jaxserve.engine.structured_output import grammar_text, strict_json_schema  # noqa: E402
from jaxserve.entrypoints.openai.protocol_chat import ChatCompletionRequest  # noqa: E402
from jaxserve.entrypoints.openai.tool_parsers import MAX_PARALLEL_TOOL_CALLS  # noqa: E402


class _ByteTokenizer:
    """One token per byte, and an end-of-sequence token."""
    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"</s>"]
    special_token_ids = [256]

    def __call__(self, s):
        return list(s)


_TOK = llguidance.LLTokenizer(TokenizerWrapper(_ByteTokenizer()))


def _matcher(spec: StructuredOutputsParams):
    m = llguidance.LLMatcher(_TOK, grammar_text(spec), log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def accepts(spec, text: str) -> bool:
    """Whether ``text`` is a complete answer of the grammar."""
    if isinstance(spec, dict):
        spec = StructuredOutputsParams(json=spec)
    m = _matcher(spec)
    return bool(m.consume_tokens(list(text.encode()))) and m.is_accepting()


def can_continue_with(spec, prefix: str) -> bool:
    """Whether ``prefix`` is allowed so far (not necessarily complete)."""
    m = _matcher(spec)
    return bool(m.consume_tokens(list(prefix.encode())))


INT = {"type": "integer"}
CITY = {"type": "object", "required": ["city", "population"],
        "properties": {"city": {"type": "string"}, "population": INT}}


def test_strict_schema_rejects_extra_keys():
    assert accepts(CITY, '{"city":"Paris","population":2100000}')
    assert not accepts(CITY, '{"city":"Paris","population":2100000,"population_density":1}')
    assert not can_continue_with(StructuredOutputsParams(json=CITY),
                                 '{"city":"Paris","population":2100000,"')
    # nested objects, arrays of objects, $defs targets and nullable objects are strict too
    nested = {"type": "object", "properties": {
        "owner": {"type": "object", "properties": {"id": INT}},
        "points": {"type": "array", "items": {"type": "object", "properties": {"x": INT}}},
        "ref": {"$ref": "#/$defs/R"},
        "maybe": {"type": ["object", "null"], "properties": {"q": INT}}},
        "$defs": {"R": {"type": "object", "properties": {"r": INT}}}}
    assert accepts(nested, '{"owner":{"id":1},"points":[{"x":1}],"ref":{"r":2},"maybe":null}')
    for extra in ('{"owner":{"id":1,"z":0}}', '{"points":[{"x":1,"z":0}]}',
                  '{"ref":{"r":2,"z":0}}', '{"maybe":{"q":1,"z":0}}', '{"z":0}'):
        assert not accepts(nested, extra), extra
    # prefixItems: no items past the listed ones
    pair = {"type": "array", "prefixItems": [INT, INT]}
    assert accepts(pair, "[1,2]") and not accepts(pair, "[1,2,3]")


def test_explicit_additional_properties_wins():
    assert accepts({**CITY, "additionalProperties": True},
                   '{"city":"Paris","population":2100000,"population_density":1}')
    typed = {**CITY, "additionalProperties": INT}
    assert accepts(typed, '{"city":"Paris","population":2,"rank":1}')
    assert not accepts(typed, '{"city":"Paris","population":2,"rank":"x"}')
    assert accepts({"type": "array", "prefixItems": [INT], "items": INT}, "[1,2,3]")
    # an object that lists no properties, and json_object, stay open
    assert accepts({"type": "object"}, '{"any":1}')
    assert accepts(StructuredOutputsParams(json_object=True), '{"any":1}')


def test_combined_subschemas_still_combine():
    """Names listed in allOf branches (a $ref among them) and in anyOf alternatives beside the
    parent's count for the object, as with unevaluatedProperties: false."""
    base = {"type": "object", "properties": {"a": INT}}
    both = {"$defs": {"Base": base}, "allOf": [{"$ref": "#/$defs/Base"},
                                               {"properties": {"b": INT}}]}
    assert accepts(both, '{"a":1,"b":2}') and accepts(both, '{"a":1}')
    assert not accepts(both, '{"a":1,"c":3}')
    alt = {"type": "object", "properties": {"kind": {"type": "string"}},
           "anyOf": [{"properties": {"x": INT}, "required": ["x"]},
                     {"properties": {"y": INT}, "required": ["y"]}]}
    assert accepts(alt, '{"kind":"k","x":1}') and accepts(alt, '{"kind":"k","y":1}')
    assert not accepts(alt, '{"kind":"k","x":1,"z":1}')


def test_strict_json_schema_leaves_the_input_alone_and_keeps_explicit_rules():
    schema = {"type": "object", "properties": {"o": {"type": "object", "properties": {}}},
              "additionalProperties": True}
    before = json.dumps(schema, sort_keys=True)
    out = strict_json_schema(schema)
    assert json.dumps(schema, sort_keys=True) == before
    assert out["additionalProperties"] is True
    assert out["properties"]["o"]["additionalProperties"] is False
    assert strict_json_schema({"not": {"properties": {"a": INT}}}) == {
        "not": {"properties": {"a": INT}}}


# ---- tool_choice "required" ------------------------------------------------------------------
TIME = {"type": "object", "required": ["tz"], "properties": {"tz": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": TIME}},
         {"type": "function", "function": {"name": "ping"}}]  # no parameters: only {}
CALL = '{"name":"get_time","parameters":{"tz":"UTC"}}'
PING = '{"name":"ping","parameters":{}}'


def _required_spec(parallel: bool | None) -> StructuredOutputsParams:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
            "tool_choice": "required"}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    req = ChatCompletionRequest.model_validate(body)
    return req.to_sampling_params(max_model_len=512, prompt_len=8).structured_outputs


@pytest.mark.parametrize("parallel", [None, True, False])
def test_required_calls_are_strict_and_the_array_closes(parallel):
    spec = _required_spec(parallel)
    assert accepts(spec, f"[{CALL}]") and accepts(spec, f"[{PING}]")
    assert not accepts(spec, "[]")
    assert not can_continue_with(spec, '[{"name":"get_time","parameters":{"tz":"UTC","')
    assert not can_continue_with(spec, '[{"name":"ping","parameters":{"')
    assert not can_continue_with(spec, '[{"name":"get_time","parameters":{"tz":"UTC"},"')
    if parallel is False:  # exactly one call: after it only the closing bracket
        assert not can_continue_with(spec, f"[{CALL},")
    else:
        n = MAX_PARALLEL_TOOL_CALLS
        assert accepts(spec, "[" + ",".join([CALL, PING] * (n // 2)) + "]")
        assert not can_continue_with(spec, "[" + ",".join([CALL] * n) + ",")
        # the model can end the array after any call
        for k in range(1, n + 1):
            assert accepts(spec, "[" + ",".join([CALL] * k) + "]")


def test_named_tool_is_strict():
    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
         "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    spec = req.to_sampling_params(max_model_len=512, prompt_len=8).structured_outputs
    assert accepts(spec, '{"tz":"UTC"}') and not accepts(spec, '{"tz":"UTC","time":"noon"}')
