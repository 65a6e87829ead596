"""``--max-logprobs`` and ``logprobs: -1`` over HTTP (vLLM's semantics) on the tiny random model.

Two engines: one with ``--max-logprobs -1`` (any count, -1 = the whole vocabulary) and one with
``--max-logprobs 3``. The returned values are checked against the model's own distribution as a
second code path computes it (``prompt_logprobs`` over the prompt + the generated tokens, whole
vocabulary: it must be normalised, i.e. a log_softmax), and the sampler's top-k width is the
configured one, compiled at warm-up (no compile when a request asks for the whole vocabulary)."""
from __future__ import annotations

import asyncio
import math
import time

import httpx
import numpy as np
import openai
import pytest

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.entrypoints.cli import build_parser, engine_config_from_args
from jaxserve.entrypoints.openai.app import build_app
from test_server import MODEL, engine_flags

from tests.server_process import ServerThread

VOCAB = 512  # the tiny model's
PROMPT = [5, 17, 33, 9, 250, 77]


def _server(model_dir: str, max_logprobs: str):
    from jaxserve.engine.async_llm import AsyncLLM

    flags = engine_flags(model_dir) + ["--max-logprobs", max_logprobs]
    eng = AsyncLLM(engine_config_from_args(build_parser().parse_args(flags)))
    srv = ServerThread(build_app(eng, served_model_names=[MODEL])).__enter__()
    return eng, srv


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def unlimited(model_dir):
    eng, srv = _server(model_dir, "-1")
    yield eng, srv
    srv.__exit__(None, None, None)
    asyncio.run(eng.shutdown())


@pytest.fixture(scope="module")
def limited(model_dir):
    eng, srv = _server(model_dir, "3")
    yield eng, srv
    srv.__exit__(None, None, None)
    asyncio.run(eng.shutdown())


def _logsumexp(xs) -> float:
    m = max(xs)
    return m + math.log(sum(math.exp(x - m) for x in xs))


def test_logprobs_match_the_full_distribution_and_minus_one_is_the_vocabulary(unlimited):
    eng, srv = unlimited
    assert eng.engine.runner.num_top_logprobs == VOCAB  # the compiled width follows the flag
    compiles = eng.stats()["num_compiles"]
    http = httpx.Client(base_url=srv.url, timeout=120)
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4,
                                           "temperature": 0, "logprobs": 5, "ignore_eos": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["top_logprobs"]) == 4
    # the reference: the prompt + the generated tokens, scored by prompt_logprobs=-1 (all ids)
    gen = eng.tokenizer.encode(choice["text"], add_special_tokens=False)
    ref = http.post("/v1/completions", json={
        "model": MODEL, "prompt": PROMPT + gen, "max_tokens": 1, "temperature": 0,
        "prompt_logprobs": -1}).json()["choices"][0]["prompt_logprobs"]
    for j in range(4):
        full = ref[len(PROMPT) + j]
        assert len(full) == VOCAB  # -1: every token of the vocabulary
        values = [v["logprob"] for v in full.values()]
        assert abs(_logsumexp(values)) < 1e-4  # normalised: a log_softmax of the logits
        ranked = sorted(full.values(), key=lambda v: v["rank"])
        assert [v["rank"] for v in ranked[:5]] == [1, 2, 3, 4, 5]
        want = {}
        for v in ranked[:5]:  # keyed by text, as the completions format is
            want[v["decoded_token"]] = v["logprob"]
        got = lp["top_logprobs"][j]
        assert got.keys() == want.keys()
        np.testing.assert_allclose([got[k] for k in want], list(want.values()), atol=1e-4)
        assert lp["token_logprobs"][j] == pytest.approx(ranked[0]["logprob"], abs=1e-4)  # greedy

    # chat: top_logprobs 5 is five entries, -1 is the whole vocabulary, normalised
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "hi"}]
    for k, n in ((5, 5), (-1, VOCAB)):
        out = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2,
                                             temperature=0, logprobs=True, top_logprobs=k,
                                             extra_body={"ignore_eos": True})
        for t in out.choices[0].logprobs.content:
            assert len(t.top_logprobs) == n
            vals = [e.logprob for e in t.top_logprobs]
            assert vals == sorted(vals, reverse=True)
            assert t.logprob == pytest.approx(vals[0], abs=1e-5)
            if n == VOCAB:
                assert abs(_logsumexp(vals)) < 1e-4
    assert eng.stats()["num_compiles"] == compiles  # the width was compiled at warm-up


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "hi", "logprobs": 5}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 4}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 4}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "logprobs": True, "top_logprobs": 5}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
])
def test_above_max_logprobs_is_a_400_naming_the_field(limited, path, body, param):
    eng, srv = limited
    r = httpx.post(srv.url + path, json={"model": MODEL, "max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "max_logprobs" in err["message"], err


def test_at_max_logprobs_is_served_and_the_engine_refuses_more(limited):
    eng, srv = limited
    assert eng.engine.runner.num_top_logprobs == 3
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "temperature": 0, "logprobs": True, "top_logprobs": 3, "ignore_eos": True})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(t["top_logprobs"]) == 3 for t in content)

    async def direct(params):  # the engine's own check (what LLM(...).generate meets)
        async for _ in eng.generate(PROMPT, params, f"direct-{time.monotonic_ns()}"):
            pass

    for field, params in (("logprobs", SamplingParams(logprobs=4)),
                          ("prompt_logprobs", SamplingParams(prompt_logprobs=-1))):
        with pytest.raises(ValueError, match="max_logprobs") as e:
            asyncio.run(direct(params))
        assert e.value.param == field
