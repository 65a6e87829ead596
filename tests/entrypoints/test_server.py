"""The OpenAI server end to end: a real uvicorn on 127.0.0.1, the real engine on the random tiny
model, driven by the official ``openai`` client (and raw httpx where the client would hide the
HTTP details). One server for the whole module keeps it fast."""
from __future__ import annotations

import asyncio
import logging
import json
import time

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.entrypoints.cli import build_parser, engine_config_from_args
from jaxserve.entrypoints.openai.app import build_app
from jaxserve.core.sampling_params import SamplingParams

from tests.server_process import ServerThread

API_KEY = "sk-test-key"
MODEL = "tiny"
MAX_MODEL_LEN = 256


def engine_flags(model: str) -> list[str]:
    return ["serve", model, "--served-model-name", MODEL, "other-name",
            "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8",
            # one token bucket: a handful of compiles in warm-up keep the module fast on CPU
            "--max-num-batched-tokens", "32", "--min-token-bucket", "32",
            "--num-gpu-blocks-override", "96"]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def engine(model_dir):
    from jaxserve.engine.async_llm import AsyncLLM

    eng = AsyncLLM(engine_config_from_args(build_parser().parse_args(engine_flags(model_dir))))
    yield eng
    asyncio.run(eng.shutdown())


@pytest.fixture(scope="module")
def server(engine):
    app = build_app(engine, api_key=API_KEY, served_model_names=[MODEL, "other-name"])
    with ServerThread(app) as srv:
        srv.full_free_pages = engine.stats()["num_free_pages"]
        srv.warm_compiles = engine.stats()["num_compiles"]
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def wait_idle(engine, full_free_pages, timeout=30.0) -> dict:
    """Poll until no request runs or waits and every page is free again; return the stats."""
    deadline = time.time() + timeout
    while True:
        s = engine.stats()
        if s["num_running"] == 0 and s["num_waiting"] == 0 \
                and s["num_free_pages"] == full_free_pages:
            return s
        if time.time() > deadline:
            return s
        time.sleep(0.05)


def engine_generate(engine, prompt, params: SamplingParams):
    """The engine's own answer, bypassing HTTP (same engine, a different event loop)."""

    async def run():
        last = None
        async for out in engine.generate(prompt, params, f"direct-{time.monotonic_ns()}"):
            last = out
        return last

    return asyncio.run(run())


def metric_values(text: str) -> dict[str, float]:
    values = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.labels.get("model_name", MODEL) == MODEL and "le" not in s.labels \
                    and "finished_reason" not in s.labels:
                values[s.name] = s.value
    return values


# ---- basic routes ----------------------------------------------------------------------------
def test_models_lists_served_names(client, engine):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL, "other-name"]
    assert models.data[0].max_model_len == MAX_MODEL_LEN


def test_health_and_version(server):
    assert httpx.get(server.url + "/health").status_code == 200  # no key needed
    v = httpx.get(server.url + "/version")
    import jaxserve
    assert v.json() == {"version": jaxserve.__version__}


def test_tokenize_detokenize_round_trip(http):
    text = "The quick brown fox jumps over the lazy dog."
    r = http.post("/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False,
                                     "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 0
    assert body["max_model_len"] == MAX_MODEL_LEN
    assert len(body["token_strs"]) == body["count"]
    back = http.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert back.status_code == 200
    assert back.json()["prompt"] == text
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": text}]})
    assert chat.status_code == 200
    assert chat.json()["count"] > body["count"]  # the template adds role markers


# ---- completions -----------------------------------------------------------------------------
def test_completion_greedy_matches_engine(client, http, engine):
    prompt = "Once upon a time"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == MODEL
    (choice,) = r.choices
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 12
    n_prompt = http.post("/tokenize", json={"prompt": prompt}).json()["count"]
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.total_tokens == n_prompt + 12
    direct = engine_generate(engine, prompt, SamplingParams(max_tokens=12, temperature=0,
                                                            ignore_eos=True))
    assert choice.text == direct.outputs[0].text


def test_completion_stream_matches_non_stream(client):
    kw = dict(model=MODEL, prompt="The capital of France", max_tokens=10, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True,
                                            stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream_sends_tokens_whose_text_is_held(client):
    """A stop string longer than the whole output holds all text back until the end; the
    stream still sends a chunk as tokens arrive (vLLM's rule), with empty text until then."""
    kw = dict(model=MODEL, prompt="The capital of France", max_tokens=12, temperature=0,
              stop=["z" * 200], extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    chunks = [c for c in client.completions.create(stream=True, **kw) if c.choices]
    assert len(chunks) > 1
    assert all(c.choices[0].text == "" for c in chunks[:-1])
    assert chunks[-1].choices[0].text == full and chunks[-1].choices[0].finish_reason == "length"


def test_completion_batch_prompts_and_token_ids(client, http):
    ids = http.post("/tokenize", json={"prompt": "hello there"}).json()["tokens"]
    r = client.completions.create(model=MODEL, prompt=["hello there", "a b c"], max_tokens=4,
                                  temperature=0, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == r.choices[0].text  # same prompt as ids or as text
    assert r.choices[0].text == r.choices[1].text  # greedy n=2: identical samples


def test_completion_n2_with_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Tell me", max_tokens=6, n=2,
                                  temperature=1.0, seed=3, logprobs=3,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 12
    for c in r.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
        assert all(x <= 0 for x in lp.token_logprobs)
        for tok, top in zip(lp.tokens, lp.top_logprobs):
            assert 1 <= len(top) <= 4 and tok in top  # top-3 and the sampled token, by text
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_completion_echo(client):
    prompt = "Echo this prompt"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                  echo=True)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    assert r.choices[0].text == prompt + plain.choices[0].text
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                  echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == r.usage.prompt_tokens + 3
    assert lp.token_logprobs[0] is None  # the first prompt token has no logprob
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)


def test_completion_stop_string(client):
    kw = dict(model=MODEL, prompt="In the beginning", max_tokens=24, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    assert len(full) > 6
    # a stop string that first occurs strictly inside the text
    stop = next(full[i:i + 2] for i in range(2, len(full) - 2)
                if full.find(full[i:i + 2]) > 0 and full[i:i + 2].strip())
    cut = full.find(stop)
    r = client.completions.create(stop=[stop], **kw).choices[0]
    assert r.finish_reason == "stop"
    assert r.text == full[:cut]
    assert stop not in r.text


def test_seed_reproducible(client):
    kw = dict(model=MODEL, prompt="Random words:", max_tokens=12, temperature=1.0,
              extra_body={"ignore_eos": True})
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    assert a == b
    others = {client.completions.create(seed=s, **kw).choices[0].text for s in (1, 2, 3)}
    assert len(others | {a}) > 1  # the seed actually changes the sample


# ---- chat ------------------------------------------------------------------------------------
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is the capital of France?"}]


def test_chat_non_stream_and_stream_agree(client, http):
    kw = dict(model=MODEL, messages=MESSAGES, max_completion_tokens=10, temperature=0,
              extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    (choice,) = r.choices
    assert r.object == "chat.completion"
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    n_prompt = http.post("/tokenize", json={"messages": MESSAGES}).json()["count"]
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.prompt_tokens == n_prompt
    assert chunks[-1].usage.completion_tokens == 10


def test_chat_n2_logprobs_stream_and_non_stream(client):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=5, n=2, temperature=0.8, seed=11,
              logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    assert sorted(c.index for c in r.choices) == [0, 1]
    for c in r.choices:
        content = c.logprobs.content
        assert len(content) == 5
        for t in content:
            assert t.logprob <= 0 and len(t.top_logprobs) == 2
            assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
            assert t.logprob <= t.top_logprobs[0].logprob + 1e-5
            assert bytes(t.bytes) == t.token.encode()
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = {0: [], 1: []}
    for ch in chunks:
        for c in ch.choices:
            if c.logprobs and c.logprobs.content:
                streamed[c.index] += c.logprobs.content
    for c in r.choices:  # same seed: the stream carries the same tokens and logprobs
        assert [t.token for t in streamed[c.index]] == [t.token for t in c.logprobs.content]


def test_chat_echo_and_generation_prompt(client):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, temperature=0,
                                       extra_body={"echo": True, "add_generation_prompt": False})
    assert r.choices[0].message.content.startswith("Hello")


# ---- metrics ---------------------------------------------------------------------------------
METRIC_NAMES = [
    "jaxserve:num_requests_running", "jaxserve:num_requests_waiting",
    "jaxserve:kv_cache_usage_perc", "jaxserve:gpu_cache_usage_perc",
    "jaxserve:prefix_cache_queries_total", "jaxserve:prefix_cache_hits_total",
    "jaxserve:prompt_tokens_total", "jaxserve:generation_tokens_total",
    "jaxserve:num_preemptions_total", "jaxserve:num_compiles",
    "jaxserve:time_to_first_token_seconds_count", "jaxserve:inter_token_latency_seconds_count",
    "jaxserve:time_per_output_token_seconds_count", "jaxserve:e2e_request_latency_seconds_count",
]


def test_metrics_names_and_counters_move(client, server, engine):
    before = metric_values(httpx.get(server.url + "/metrics").text)
    for name in METRIC_NAMES:
        assert name in before, name
    client.completions.create(model=MODEL, prompt="count me", max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    wait_idle(engine, server.full_free_pages)
    after = metric_values(httpx.get(server.url + "/metrics").text)
    assert after["jaxserve:prompt_tokens_total"] > before["jaxserve:prompt_tokens_total"]
    assert after["jaxserve:generation_tokens_total"] >= \
        before["jaxserve:generation_tokens_total"] + 5
    assert after["jaxserve:e2e_request_latency_seconds_count"] == \
        before["jaxserve:e2e_request_latency_seconds_count"] + 1
    assert after["jaxserve:time_to_first_token_seconds_count"] == \
        before["jaxserve:time_to_first_token_seconds_count"] + 1
    assert after["jaxserve:inter_token_latency_seconds_count"] >= \
        before["jaxserve:inter_token_latency_seconds_count"] + 4
    assert after["jaxserve:num_compiles"] == server.warm_compiles  # nothing compiles after warm-up
    assert 0.0 <= after["jaxserve:kv_cache_usage_perc"] <= 1.0


def test_metrics_report_the_engine_memory_by_part(server, engine):
    """The engine core's memory by part: weights as the engine counts them, the pool reserved,
    and on the CPU the resident set split so that the parts add up."""
    parts = {}
    for fam in text_string_to_metric_families(httpx.get(server.url + "/metrics").text):
        if fam.name == "jaxserve:process_memory_bytes":
            parts = {s.labels["part"]: s.value for s in fam.samples
                     if s.labels.get("model_name") == MODEL}
    weights = sum(x.nbytes for x in engine.engine.runner.weight_leaves())
    assert parts["weights"] == weights > 0
    assert parts["kv_reserved"] > 0
    assert parts["rss"] > parts["weights"]
    if "kv_resident" in parts:
        assert 0 <= parts["kv_resident"] <= parts["kv_reserved"]
        assert parts["rest"] == parts["rss"] - parts["weights"] - parts["kv_resident"]


# ---- auth ------------------------------------------------------------------------------------
@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("POST", "/v1/completions"),
                                         ("POST", "/v1/chat/completions")])
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": API_KEY}])
def test_v1_routes_need_the_key(server, method, path, headers):
    r = httpx.request(method, server.url + path, headers=headers,
                      json={"model": MODEL, "prompt": "x", "messages": MESSAGES})
    assert r.status_code == 401
    assert r.json()["error"]["code"] == 401


def test_openai_client_with_wrong_key(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


# ---- bad requests ----------------------------------------------------------------------------
LONG = "word " * (MAX_MODEL_LEN * 2)
BAD = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, None),
    ("/v1/completions", b'{"prompt": "a\\ud800b"}', 400, "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400,
     "messages.0.content"),
    ("/v1/completions", {"prompt": 12}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "model": "no-such-model"}, 404, "model"),
    ("/v1/completions", {"prompt": LONG}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": 1000}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "seed": -1}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": [10**8]}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 20, "max_tokens": 4}, 400, "min_tokens"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": -1}, 400, "n"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 3}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 10**6}, 400,
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400,
     "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages.0.content.0"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stream": True, "n": 0}, 400, "n"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
]


@pytest.mark.parametrize("path,body,status,param", BAD,
                         ids=[f"{p}-{i}" for i, (p, *_) in enumerate(BAD)])
def test_bad_requests_get_openai_errors(http, path, body, status, param):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param, err


def test_oversized_body_is_413(http):
    r = http.post("/v1/completions", content=b'{"prompt": "' + b"a" * (33 * 2**20) + b'"}')
    assert r.status_code == 413 and r.json()["error"]["code"] == 413


def test_unknown_route_and_method(http):
    r = http.get("/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    r = http.get("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == 405


@pytest.mark.parametrize("path,body", [
    ("/v1/embeddings", {"input": "x"}), ("/pooling", {"input": "x"}),
    ("/score", {"text_1": "a", "text_2": "b"}), ("/rerank", {"query": "q", "documents": ["d"]}),
    ("/v2/rerank", {"query": "q", "documents": ["d"]}), ("/classify", {"input": "x"})])
def test_pooling_route_on_a_generative_server_names_the_runner(http, path, body):
    r = http.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    assert "--runner generate" in r.json()["error"]["message"]


def test_openai_client_sees_bad_request(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", n=0)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=MESSAGES)


json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                      st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12),
                      st.sampled_from(["\ud800", "a\udfffb", "\x00", "<|im_end|>"]))
json_value = st.recursive(json_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)
FIELDS = ["model", "prompt", "messages", "tokens", "max_tokens", "max_completion_tokens", "n", "stream",
          "temperature", "top_p", "top_k", "min_p", "logprobs", "top_logprobs", "echo", "stop",
          "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
          "min_tokens", "ignore_eos", "priority", "stop_token_ids", "stream_options", "best_of",
          "add_generation_prompt", "include_stop_str_in_output", "prompt_logprobs"]
small_ints = st.integers(-3, 40)
field_values = {
    "model": st.sampled_from([MODEL, "other-name", "nope", 5]),
    "prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(-5, 600), max_size=6),
                        json_value),
    "messages": st.one_of(st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system", "", "robot"]),
         "content": st.one_of(st.text(max_size=20), json_value)}), max_size=3), json_value),
    "tokens": st.one_of(st.lists(st.integers(-5, 10**6), max_size=6), json_value),
    "max_tokens": st.one_of(small_ints, json_value), "n": st.one_of(small_ints, json_value),
    "stream": st.one_of(st.booleans(), json_value),
    "logprobs": st.one_of(small_ints, st.booleans(), json_value),
    "top_logprobs": st.one_of(small_ints, json_value),
}


@st.composite
def request_bodies(draw):
    keys = draw(st.lists(st.sampled_from(FIELDS), unique=True, max_size=8))
    body = {k: draw(field_values.get(k, json_value)) for k in keys}
    if "max_tokens" not in body or draw(st.booleans()):  # keep valid requests short
        body["max_tokens"] = draw(st.integers(1, 4))
    return body


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=request_bodies(), path=st.sampled_from(["/v1/completions", "/v1/chat/completions",
                                                    "/tokenize", "/detokenize"]))
def test_fuzzed_bodies_never_500(http, body, path):
    r = http.post(path, content=json.dumps(body).encode(),  # ASCII: lone surrogates survive
                  headers={"Content-Type": "application/json"})
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["code"] == r.status_code and isinstance(err["message"], str)
    elif body.get("stream") is True and path.startswith("/v1/"):  # tokenize has no stream
        assert r.text.rstrip().endswith("data: [DONE]")


# ---- disconnects and load --------------------------------------------------------------------
def test_disconnect_mid_stream_frees_pages(server, engine):
    body = {"model": MODEL, "prompt": "Keep talking", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(g.startswith("data: ") for g in got)
            assert engine.stats()["num_running"] + engine.stats()["num_waiting"] >= 1
    s = wait_idle(engine, server.full_free_pages)
    assert s["num_running"] == 0 and s["num_waiting"] == 0
    assert s["num_free_pages"] == server.full_free_pages


def test_disconnect_non_stream_aborts(server, engine):
    # 16 sequences x 230 tokens with max_num_seqs 8: two waves, ~460 decode steps, far more
    # than the 0.1 s after which the client hangs up (even on a fast, quiet machine)
    body = {"model": MODEL, "prompt": "Keep talking", "max_tokens": 230, "temperature": 0,
            "ignore_eos": True, "n": 16}
    before = engine.stats()["generation_tokens_total"]
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.1,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    s = wait_idle(engine, server.full_free_pages)
    assert s["num_running"] == 0 and s["num_free_pages"] == server.full_free_pages
    assert s["generation_tokens_total"] - before < 16 * 230  # aborted, not run to the end


@pytest.mark.slow
def test_200_concurrent_streams_30pct_cancelled(server, engine, client):
    async def one(aclient, i):
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"request {i}"}],
            max_tokens=12 if i % 10 < 7 else 64, temperature=0.7, seed=i, stream=True,
            extra_body={"ignore_eos": True})
        text, n = "", 0
        async for chunk in stream:
            n += 1
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if i % 10 >= 7 and n == 3:  # 30 % hang up mid-stream
                await stream.close()
                return None
        return text

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY,
                                      max_retries=0, timeout=120) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(200)))

    results = asyncio.run(run())
    assert sum(r is None for r in results) == 60
    assert all(isinstance(r, str) for r in results if r is not None)
    s = wait_idle(engine, server.full_free_pages, timeout=60)
    assert s["num_running"] == 0 and s["num_waiting"] == 0
    assert s["num_free_pages"] == server.full_free_pages
    r = client.completions.create(model=MODEL, prompt="still there?", max_tokens=2)
    assert r.choices[0].finish_reason in ("length", "stop")
    assert engine.stats()["num_compiles"] == server.warm_compiles


@pytest.mark.slow
def test_greedy_server_equals_offline_llm(client, model_dir):
    # Late in the module: a second engine in this process would muddle the compile counts
    # the tests above check (the runner's trace counter is process-wide).
    from jaxserve.entrypoints.cli import engine_kwargs_from_args
    from jaxserve.entrypoints.llm import LLM

    prompts = ["Once upon a time", "The capital of France is", "1 2 3 4"]
    llm = LLM(**engine_kwargs_from_args(build_parser().parse_args(engine_flags(model_dir))))
    offline = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0),
                           use_tqdm=False)
    served = client.completions.create(model=MODEL, prompt=prompts, max_tokens=10,
                                       temperature=0)
    assert [c.text for c in served.choices] == [o.outputs[0].text for o in offline]
    assert [c.finish_reason for c in served.choices] == \
        [o.outputs[0].finish_reason for o in offline]


# ---- prompt_logprobs over HTTP -----------------------------------------------------------------
def _sse_json(r) -> list[dict]:
    return [json.loads(ln[6:]) for ln in r.text.splitlines()
            if ln.startswith("data: {")]


def test_prompt_logprobs_are_returned(http):
    """vLLM's shape: per prompt position None (the first) or {token id: {logprob, rank,
    decoded_token}} holding the prompt's own token and the top k; streamed in the first chunk."""
    prompt = [5, 17, 33, 9, 250]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "prompt_logprobs": 2,
            "temperature": 0}
    full = http.post("/v1/completions", json=body).json()["choices"][0]["prompt_logprobs"]
    assert len(full) == len(prompt) and full[0] is None
    for tid, pos in zip(prompt[1:], full[1:]):
        assert str(tid) in pos and 2 <= len(pos) <= 3
        assert all(v["logprob"] <= 0 and v["rank"] >= 1 for v in pos.values())
        assert {1, 2} <= {v["rank"] for v in pos.values()}  # the top 2, and the prompt's own
    chunks = _sse_json(http.post("/v1/completions", json={**body, "stream": True}))
    assert chunks[0]["choices"][0]["prompt_logprobs"] == full
    assert all(c["choices"][0].get("prompt_logprobs") is None for c in chunks[1:] if c["choices"])
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "prompt_logprobs": 1}
    r = http.post("/v1/chat/completions", json=chat).json()
    lps = r["prompt_logprobs"]
    assert lps[0] is None and len(lps) == r["usage"]["prompt_tokens"]
    chunks = _sse_json(http.post("/v1/chat/completions", json={**chat, "stream": True}))
    assert [c["prompt_logprobs"] for c in chunks if c.get("prompt_logprobs")] == [lps]


# ---- CORS, request logging ---------------------------------------------------------------------
def test_cors_request_logging_and_response_role(engine, caplog):
    """vLLM's CORS flags: an allowed origin gets the headers (a preflight without a key too),
    another origin does not; --enable-log-requests logs each request with its params."""
    from jaxserve.entrypoints.cli import build_parser

    a = build_parser().parse_args(["serve", "--allowed-origins", '["http://ok.example"]',
                                   "--allowed-methods", '["GET", "POST"]',
                                   "--enable-log-requests", "--max-log-len", "3",
                                   "--response-role", "model"])
    assert a.allowed_headers == ["*"] and a.allow_credentials is False
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--allowed-origins", "http://not-json"])
    cors = dict(allowed_origins=a.allowed_origins, allowed_methods=a.allowed_methods,
                allowed_headers=a.allowed_headers, allow_credentials=a.allow_credentials)
    app = build_app(engine, api_key=API_KEY, served_model_names=[MODEL], cors=cors,
                    log_requests=a.enable_log_requests, max_log_len=a.max_log_len,
                    response_role=a.response_role)
    with ServerThread(app) as srv:
        pre = {"Access-Control-Request-Method": "POST"}
        ok = httpx.options(srv.url + "/v1/completions", timeout=30,
                           headers={"Origin": "http://ok.example", **pre})
        assert ok.status_code == 200
        assert ok.headers["access-control-allow-origin"] == "http://ok.example"
        bad = httpx.options(srv.url + "/v1/completions", timeout=30,
                            headers={"Origin": "http://evil.example", **pre})
        assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
        with caplog.at_level(logging.INFO, logger="jaxserve.entrypoints.openai.serving_engine"):
            r = httpx.post(srv.url + "/v1/completions", timeout=60,
                           headers={"Authorization": f"Bearer {API_KEY}",
                                    "Origin": "http://ok.example"},
                           json={"model": MODEL, "prompt": [5, 6, 7, 8, 9], "max_tokens": 2,
                                 "temperature": 0})
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "http://ok.example"
        logged = [m for m in caplog.messages if m.startswith("received request")]
        assert len(logged) == 1 and "5 prompt tokens [5, 6, 7]" in logged[0], logged
        assert "temperature=0" in logged[0]
        auth = {"Authorization": f"Bearer {API_KEY}"}
        chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, headers=auth, json=chat)
        assert r.json()["choices"][0]["message"]["role"] == "model"  # --response-role
        cont = {**chat, "messages": [*MESSAGES, {"role": "assistant", "content": "Sure"}],
                "add_generation_prompt": False, "continue_final_message": True}
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, headers=auth, json=cont)
        assert r.json()["choices"][0]["message"]["role"] == "assistant"  # the continued one


# ---- must run last: it stops the engine --------------------------------------------------------
def test_zz_dead_engine_gives_503(server, engine, http):
    asyncio.run(engine.shutdown())
    assert httpx.get(server.url + "/health").status_code == 503
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == 503
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES,
                                                "stream": True})
    assert r.status_code == 503
