"""Gemma 4's tool calls (``<|tool_call>call:NAME{...}<tool_call|>``, its own value notation) and
its thought channel, parsed whole and streamed."""
from __future__ import annotations

import json

import pytest

from jaxserve.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from jaxserve.entrypoints.openai.tool_call_stream import ToolCallStreamer
from jaxserve.entrypoints.openai.tool_parsers import get_tool_parser

Q = '<|"|>'
TWO_CALLS = (f"Checking both.<|tool_call>call:get_weather{{city:{Q}Pa}}ris, \"x\" {{{Q},"
             f"days:[1,2.5e1,{{n:null}}],ok:true,unit:{Q}celsius{Q}}}<tool_call|>"
             f"<|tool_call>call:add{{a:1,b:-20,nested:{{deep:[{Q}p{Q},false]}}}}<tool_call|>")
WANT = [("get_weather", {"city": 'Pa}ris, "x" {', "days": [1, 25.0, {"n": None}], "ok": True,
                         "unit": "celsius"}),
        ("add", {"a": 1, "b": -20, "nested": {"deep": ["p", False]}})]


def test_gemma4_calls_become_json_arguments():
    p = get_tool_parser("gemma4")
    content, calls = p.extract(TWO_CALLS)
    assert content == "Checking both."
    assert [(n, json.loads(a)) for n, a in calls] == WANT
    assert p.special_markers  # the markers are special tokens: the server keeps them
    assert p.extract("no call here") == ("no call here", [])
    # a call cut off inside its arguments is not a call
    assert p.extract(f"<|tool_call>call:add{{a:{Q}unfinished") [1] == []
    # content is shown up to a marker in the making, never past it
    assert p.content_end("Sure.<|tool_c") == len("Sure.")
    assert p.content_end("Sure, plain text.") == len("Sure, plain text.")


def test_gemma4_calls_stream_name_first_then_whole_arguments():
    p = get_tool_parser("gemma4")
    ids = iter(range(100))
    st = ToolCallStreamer(new_id=lambda: f"call-{next(ids)}")
    per_call: dict[int, list] = {}
    for end in range(1, len(TWO_CALLS) + 1):
        for k, cid, name, args in st.update(p.partial_calls(TWO_CALLS[:end])):
            per_call.setdefault(k, []).append((cid, name, args))
    assert len(per_call) == 2
    for k, (name, args) in enumerate(WANT):
        deltas = per_call[k]
        assert deltas[0][:2] == (f"call-{k}", name)  # the name as soon as it is written
        assert deltas[0][2] == ""  # arguments wait for the closed call (notation converted)
        assert all(cid is None and n is None for cid, n, _ in deltas[1:])
        assert json.loads("".join(a for _, _, a in deltas)) == args


def test_gemma4_thought_channel_is_reasoning():
    r = get_reasoning_parser("gemma4")
    text = "<|channel>thought\nThe user wants Paris.<channel|>Paris."
    assert r.split(text) == ("The user wants Paris.", "Paris.")
    assert r.split("Just the answer.") == (None, "Just the answer.")
    assert r.special_markers
    shown = [r.split_streaming(text[:n], done=False) for n in range(len(text) + 1)]
    final = r.split_streaming(text, done=True)
    for reasoning, content in shown:  # every view is a prefix of the finished split
        assert final[0].startswith(reasoning) and final[1].startswith(content)
    assert r.split_streaming("<|chan", done=False) == ("", "")  # a tag in the making is held


def test_qwen3_reasoning_parser_unchanged_by_the_tag_attributes():
    r = get_reasoning_parser("qwen3")
    assert r.split("<think>why</think>answer") == ("why", "answer")
    assert r.split("<|channel>thought\nx<channel|>y") == (None, "<|channel>thought\nx<channel|>y")


@pytest.mark.parametrize("flag", ["--tool-call-parser", "--reasoning-parser"])
def test_gemma4_parsers_are_known_to_the_cli(flag):
    from jaxserve.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "m", flag, "gemma4"])
    assert "gemma4" in (args.tool_call_parser, args.reasoning_parser)
