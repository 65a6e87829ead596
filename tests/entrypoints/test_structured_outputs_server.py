"""Structured outputs over HTTP with the official ``openai`` client against a real uvicorn and
the tiny random-weight model: every answer parses and validates only because of the grammar
mask. ``response_format`` (json_schema on 10 schemas, json_object), vLLM's
``structured_outputs`` and the older ``guided_*`` names, chat and completions, streamed and not;
bad schemas / regexes / grammars are 400s naming the field and leave the engine serving."""
from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time

import httpx
import jsonschema
import openai
import pytest
import uvicorn

from jaxserve.entrypoints.cli import build_parser, engine_config_from_args
from jaxserve.entrypoints.openai.app import build_app, uvicorn_config

FLAGS = ["--max-model-len", "512", "--max-num-seqs", "16", "--max-num-batched-tokens", "64",
         "--min-token-bucket", "64", "--dtype", "float32"]
MAX_TOKENS = 160
MODEL = "tiny"

S = {"type": "string", "maxLength": 6}


def _obj(props: dict, required=None) -> dict:
    return {"type": "object", "properties": props, "additionalProperties": False,
            "required": list(props) if required is None else required}


SCHEMAS = [
    _obj({"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    _obj({"user": _obj({"id": {"type": "integer", "minimum": 1, "maximum": 999},
                        "profile": _obj({"nick": S, "active": {"type": "boolean"}})})}),
    _obj({"tags": {"type": "array", "items": S, "minItems": 2, "maxItems": 3}}),
    _obj({"color": {"enum": ["red", "green", "blue"]},
          "size": {"type": "string", "enum": ["S", "M", "L", "XL"]}}),
    _obj({"score": {"type": "integer", "minimum": -5, "maximum": 5},
          "ratio": {"type": "number", "minimum": 0, "maximum": 1}}),
    _obj({"nickname": {"type": ["string", "null"], "maxLength": 4},
          "parent": {"anyOf": [{"type": "null"}, _obj({"id": {"type": "integer", "minimum": 0,
                                                              "maximum": 9}})]}}),
    _obj({"points": {"type": "array", "minItems": 1, "maxItems": 2,
                     "items": _obj({"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                    "y": {"type": "integer", "minimum": 0, "maximum": 9}})}}),
    _obj({"ok": {"type": "boolean"}, "code": {"const": 200}}),
    {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 1, "maxItems": 4},
    _obj({"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer", "minimum": 0,
                                                     "maximum": 4},
          "owner": _obj({"name": S, "phone": {"type": ["string", "null"], "pattern": "^[0-9]{3}$"}}),
          "vaccinated": {"type": ["boolean", "null"]}}),
    _obj({"matrix": {"type": "array", "minItems": 1, "maxItems": 2,
                     "items": {"type": "array", "minItems": 1, "maxItems": 2,
                               "items": {"type": "integer", "minimum": 0, "maximum": 99}}}}),
]


class _Server:
    def __init__(self, app):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn_config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.time() < deadline, "uvicorn did not start"
            time.sleep(0.02)

    def close(self):
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()


@pytest.fixture(scope="module")
def engine(tiny_model_factory):
    from jaxserve.engine.async_llm import AsyncLLM

    eng = AsyncLLM(engine_config_from_args(build_parser().parse_args(
        ["serve", str(tiny_model_factory("llama")), "--served-model-name", MODEL, *FLAGS])))
    yield eng
    asyncio.run(eng.shutdown())


@pytest.fixture(scope="module")
def base_url(engine):
    srv = _Server(build_app(engine))
    yield f"http://127.0.0.1:{srv.port}/v1"
    srv.close()


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def aclient(base_url):
    return openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=120)


def _messages(i):
    return [{"role": "user", "content": f"Give me record number {i} as JSON."}]


def _stream_text(stream, chat=True):
    parts, finish = [], None
    for chunk in stream:
        for ch in chunk.choices:
            parts.append((ch.delta.content if chat else ch.text) or "")
            finish = ch.finish_reason or finish
    return "".join(parts), finish


def test_json_schema_answers_validate(aclient):
    """10+ schemas at once (they share batches), half greedy, half sampled; chat."""
    async def one(i, schema):
        kw = {"temperature": 0.0} if i % 2 == 0 else {"temperature": 1.0, "seed": i}
        r = await aclient.chat.completions.create(
            model=MODEL, messages=_messages(i), max_tokens=MAX_TOKENS,
            response_format={"type": "json_schema",
                             "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}},
            **kw)
        return r.choices[0]

    async def main():
        return await asyncio.gather(*(one(i, s) for i, s in enumerate(SCHEMAS)))

    for schema, choice in zip(SCHEMAS, asyncio.run(main())):
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_streamed_and_not_in_chat_and_completions(client, stream):
    schema = SCHEMAS[9]
    rf = {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}}
    r = client.chat.completions.create(model=MODEL, messages=_messages(9), max_tokens=MAX_TOKENS,
                                       temperature=0.0, response_format=rf, stream=stream)
    text, finish = _stream_text(r) if stream else (r.choices[0].message.content,
                                                    r.choices[0].finish_reason)
    assert finish == "stop"
    jsonschema.validate(json.loads(text), schema)
    # completions: vLLM's structured_outputs field
    r = client.completions.create(model=MODEL, prompt="A pet record:", max_tokens=MAX_TOKENS,
                                  temperature=0.0, stream=stream,
                                  extra_body={"structured_outputs": {"json": schema}})
    text, finish = _stream_text(r, chat=False) if stream else (r.choices[0].text,
                                                                r.choices[0].finish_reason)
    assert finish == "stop"
    jsonschema.validate(json.loads(text), schema)


def test_json_object(client, engine):
    tok = engine.tokenizer
    # a nudge to close strings and objects early (the mask keeps it valid; the bias keeps a
    # random model from writing one string for ever)
    bias = {str(t): 8 for t in tok.encode('"}', add_special_tokens=False)}
    for stream in (False, True):
        r = client.chat.completions.create(
            model=MODEL, messages=_messages(0), max_tokens=MAX_TOKENS, temperature=1.0, seed=1,
            response_format={"type": "json_object"}, logit_bias=bias, stream=stream)
        text, finish = _stream_text(r) if stream else (r.choices[0].message.content,
                                                        r.choices[0].finish_reason)
        assert finish == "stop", text
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("stream", [False, True])
def test_choice_regex_grammar_with_both_field_names(client, stream):
    cases = [
        ({"guided_choice": ["alpha", "beta", "gamma"]},
         lambda t: t in ("alpha", "beta", "gamma")),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
        ({"guided_regex": r"[A-Z][a-z]{2,5} [0-9]{1,3}"},
         lambda t: re.fullmatch(r"[A-Z][a-z]{2,5} [0-9]{1,3}", t)),
        ({"structured_outputs": {"regex": r"(ab|cd){2,3}!"}},
         lambda t: re.fullmatch(r"(ab|cd){2,3}!", t)),
        ({"guided_grammar": 'start: "SELECT " col " FROM " tbl\ncol: "a" | "b"\ntbl: /[a-z]{1,4}/'},
         lambda t: re.fullmatch(r"SELECT (a|b) FROM [a-z]{1,4}", t)),
        ({"structured_outputs": {"grammar": 'root ::= "x" ("," "x")? ("," "x")?'}},
         lambda t: t in ("x", "x,x", "x,x,x")),
    ]
    for i, (extra, ok) in enumerate(cases):
        r = client.chat.completions.create(model=MODEL, messages=_messages(i), max_tokens=40,
                                           temperature=1.0, seed=i, stream=stream,
                                           extra_body=extra)
        text, finish = _stream_text(r) if stream else (r.choices[0].message.content,
                                                        r.choices[0].finish_reason)
        assert finish == "stop" and ok(text), (extra, text)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "integer",
                                                            "minimum": "x"}}}}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "start: missing_rule"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"backend": "xgrammar"}}, "structured_outputs.backend"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
])
def test_bad_specs_are_400_naming_the_field(base_url, body, param):
    for path, base in (("/chat/completions", {"messages": _messages(0)}),
                       ("/completions", {"prompt": "hi"})):
        r = httpx.post(base_url + path, json={"max_tokens": 4, **base, **body},
                       timeout=60)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["param"] == param, r.text
    r = httpx.post(base_url + "/completions", timeout=60,
                   json={"prompt": "alive?", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


# ---- tool calling ------------------------------------------------------------------------------
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 8},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}}
ADD = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                      "b": {"type": "integer", "minimum": 0, "maximum": 99}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
PARAMS = {"get_weather": WEATHER, "add": ADD}


@pytest.fixture(scope="module")
def tool_client(engine):
    srv = _Server(build_app(engine, enable_auto_tool_choice=True, tool_call_parser="hermes"))
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="x", max_retries=0,
                        timeout=120)
    srv.close()


def _streamed_calls(stream, pieces=None):
    """Reassemble streamed tool-call deltas: {index: [id, name, arguments]}, content, finish.
    ``pieces`` (a dict) receives each index's deltas as (id, name, arguments) in order."""
    calls, content, finish = {}, "", None
    for chunk in stream:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or ():
                entry = calls.setdefault(d.index, [None, None, ""])
                fn = d.function
                if pieces is not None:
                    pieces.setdefault(d.index, []).append(
                        (d.id, fn.name if fn else None, fn.arguments if fn else None))
                if d.id:
                    entry[0] = d.id
                if fn and fn.name:
                    entry[1] = fn.name
                if fn and fn.arguments:
                    entry[2] += fn.arguments
            finish = ch.finish_reason or finish
    return [tuple(calls[k]) for k in sorted(calls)], content, finish


def _check_incremental(pieces):
    """vLLM's streaming shape: each call's first delta has its id and name, the later ones
    only argument fragments, and there is more than one fragment."""
    assert pieces
    for deltas in pieces.values():
        assert deltas[0][0] and deltas[0][1]
        assert all(cid is None and name is None for cid, name, _ in deltas[1:])
        assert sum(1 for *_, args in deltas if args) > 1, deltas


def _check_calls(calls, names=None):
    assert calls
    for call_id, name, args in calls:
        assert call_id and name in PARAMS and (names is None or name in names)
        jsonschema.validate(json.loads(args), PARAMS[name])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parallel", [True, False])
def test_tool_choice_required(tool_client, stream, parallel):
    for seed in range(3):
        r = tool_client.chat.completions.create(
            model=MODEL, messages=_messages(seed), tools=TOOLS, tool_choice="required",
            parallel_tool_calls=parallel, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed,
            stream=stream)
        if stream:
            pieces = {}
            calls, content, finish = _streamed_calls(r, pieces)
            _check_incremental(pieces)
        else:
            m = r.choices[0].message
            calls = [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls]
            content, finish = m.content, r.choices[0].finish_reason
        assert finish == "tool_calls" and not content
        _check_calls(calls)
        if not parallel:
            assert len(calls) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_named(tool_client, stream):
    choice = {"type": "function", "function": {"name": "add"}}
    r = tool_client.chat.completions.create(
        model=MODEL, messages=_messages(1), tools=TOOLS, tool_choice=choice,
        max_tokens=MAX_TOKENS, temperature=0.0, stream=stream)
    if stream:
        calls, content, finish = _streamed_calls(r)
    else:
        m = r.choices[0].message
        calls = [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls]
        content, finish = m.content, r.choices[0].finish_reason
    assert finish == "stop" and not content  # OpenAI's finish_reason for a forced function
    assert len(calls) == 1
    _check_calls(calls, names={"add"})


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_auto_parses_hermes_calls(tool_client, stream):
    """auto: the model's text is parsed by --tool-call-parser. A random model never writes a
    call by itself, so a regex makes it write one (hermes format) around free content."""
    regex = (r'[a-z]{1,6} <tool_call>\{"name": "get_weather", "arguments": \{"city": '
             r'"[a-z]{1,6}", "unit": "(celsius|fahrenheit)"\}\}</tool_call>')
    r = tool_client.chat.completions.create(
        model=MODEL, messages=_messages(2), tools=TOOLS, max_tokens=MAX_TOKENS,
        temperature=1.0, seed=5, stream=stream, extra_body={"guided_regex": regex})
    if stream:
        pieces = {}
        calls, content, finish = _streamed_calls(r, pieces)
        _check_incremental(pieces)
    else:
        m = r.choices[0].message
        calls = [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls]
        content, finish = m.content, r.choices[0].finish_reason
    assert finish == "tool_calls"
    assert re.fullmatch(r"[a-z]{1,6} ", content) and "<tool" not in content
    _check_calls(calls, names={"get_weather"})


def test_tool_choice_auto_without_a_call_is_content(tool_client, client):
    r = tool_client.chat.completions.create(model=MODEL, messages=_messages(3), tools=TOOLS,
                                            max_tokens=8, temperature=0.0)
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length") and not c.message.tool_calls
    assert c.message.content
    # without --enable-auto-tool-choice, tools with tool_choice auto are refused by name
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=_messages(3), tools=TOOLS,
                                       max_tokens=8)
    assert e.value.body["param"] == "tool_choice"
    # "none" answers plainly
    r = client.chat.completions.create(model=MODEL, messages=_messages(3), tools=TOOLS,
                                       tool_choice="none", max_tokens=4, temperature=0.0)
    assert not r.choices[0].message.tool_calls


def test_tool_messages_go_through_the_template(reason_client, engine):
    """Assistant tool_calls (arguments as a mapping), tool messages and the tools themselves
    reach the chat template: a template that prints them gives the prompt's token count."""
    template = ("{% for m in messages %}{{ m.role }}:{% if m.tool_calls %}"
                "{{ m.tool_calls[0].function.name }}({{ m.tool_calls[0].function.arguments.a }})"
                "{% else %}{{ m.content }}{% endif %};{% endfor %}"
                "{% for t in tools %}{{ t.function.name }},{% endfor %}")
    msgs = [{"role": "user", "content": "add 1 and 2"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    r = reason_client.chat.completions.create(
        model=MODEL, messages=msgs, tools=TOOLS, max_tokens=2, temperature=0.0,
        tool_choice={"type": "function", "function": {"name": "add"}},
        extra_body={"chat_template": template})
    rendered = "user:add 1 and 2;assistant:add(1);tool:3;get_weather,add,"
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode(rendered,
                                                                add_special_tokens=False))


# ---- reasoning output, chat_template_kwargs ----------------------------------------------------
@pytest.fixture(scope="module")
def reason_client(engine):
    srv = _Server(build_app(engine, reasoning_parser="qwen3", trust_request_chat_template=True))
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="x", max_retries=0,
                        timeout=120)
    srv.close()


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_content_is_split_off(reason_client, stream):
    """A regex makes the random model think first; --reasoning-parser qwen3 splits it off."""
    regex = r"<think>[a-z]{1,8}( [a-z]{1,8}){0,3}</think>[A-Z][a-z]{1,6}\."
    r = reason_client.chat.completions.create(
        model=MODEL, messages=_messages(4), max_tokens=80, temperature=1.0, seed=2,
        stream=stream, extra_body={"guided_regex": regex})
    if stream:
        reasoning = content = ""
        finish = None
        for chunk in r:
            for ch in chunk.choices:
                reasoning += getattr(ch.delta, "reasoning_content", None) or ""
                content += ch.delta.content or ""
                finish = ch.finish_reason or finish
    else:
        m = r.choices[0].message
        reasoning, content, finish = m.reasoning_content, m.content, r.choices[0].finish_reason
    assert finish == "stop"
    assert re.fullmatch(r"[a-z]{1,8}( [a-z]{1,8}){0,3}", reasoning), reasoning
    assert re.fullmatch(r"[A-Z][a-z]{1,6}\.", content), content


def test_chat_template_kwargs_and_request_template(reason_client, client, engine):
    template = "{{ greeting }}{% for m in messages %}|{{ m['content'] }}{% endfor %}"
    r = reason_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=2,
        extra_body={"chat_template": template,
                    "chat_template_kwargs": {"greeting": "good morning everyone"}})
    want = len(engine.tokenizer.encode("good morning everyone|hello", add_special_tokens=False))
    assert r.usage.prompt_tokens == want
    with pytest.raises(openai.BadRequestError) as e:  # not without the flag
        client.chat.completions.create(model=MODEL, messages=_messages(0), max_tokens=2,
                                       extra_body={"chat_template": template})
    assert e.value.body["param"] == "chat_template"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=_messages(0), max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"tools": []}})
    assert e.value.body["param"] == "chat_template_kwargs"
