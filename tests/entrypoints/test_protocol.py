"""OpenAI request/response models: validation errors name the field, requests map to vLLM's
SamplingParams, responses parse with the official ``openai`` types, logprob formats, metrics."""
from __future__ import annotations

import json
import math

import openai.types as ot
import openai.types.chat as oc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.entrypoints.openai import protocol as P
from jaxserve.entrypoints.openai import protocol_chat as PC
from jaxserve.entrypoints.openai.logprobs import chat_logprobs as _chat_logprobs, legacy_logprobs as _legacy_logprobs, Tokens as _Tokens
from jaxserve.errors import InvalidRequestError
from jaxserve.entrypoints.openai.metrics import ServerMetrics
from jaxserve.core.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


def parse_err(cls, body) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as e:
        P.parse_request(cls, body)
    return e.value


# ---- request validation ----------------------------------------------------------------------
@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": P.MAX_N + 1}, "n"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "x", "logprobs": -2}, "logprobs"),
    ({"prompt": "x", "prompt_logprobs": -2}, "prompt_logprobs"),
    ({"prompt": "x", "temperature": -0.5}, "temperature"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "best_of": 4}, "best_of"),
    ({"prompt": "x", "suffix": "tail"}, "suffix"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids.0"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[1, 2], []]}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({}, "prompt"),
])
def test_completion_request_errors_name_the_field(body, param):
    assert parse_err(P.CompletionRequest, body).param == param


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": 7}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": -3},
     "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "continue_final_message": True,
      "add_generation_prompt": True}, "continue_final_message"),
])
def test_chat_request_errors_name_the_field(body, param):
    assert parse_err(PC.ChatCompletionRequest, body).param == param


def test_non_object_body_is_rejected():
    assert parse_err(P.CompletionRequest, [1, 2]).param is None
    assert "JSON object" in parse_err(P.CompletionRequest, "prompt").message


def test_unknown_fields_are_ignored():
    req = P.parse_request(PC.ChatCompletionRequest, {
        "messages": [{"role": "user", "content": "hi"}], "tools": [], "metadata": {"a": 1}})
    assert req.messages[0].content == "hi"


def test_content_parts_join_render_images_and_reject_other_types():
    req = P.parse_request(PC.ChatCompletionRequest, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert req.message_dicts() == [{"role": "user", "content": "ab"}]
    req = P.parse_request(PC.ChatCompletionRequest, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert req.message_dicts() == [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image"}]}]
    assert req.image_urls() == [("messages.0.content.1", "x")]
    for part in ({"type": "video_url", "video_url": {"url": "x"}}, {"type": "image_url"}):
        req = P.parse_request(PC.ChatCompletionRequest, {"messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, part]}]})
        with pytest.raises(InvalidRequestError) as e:
            req.message_dicts()
        assert e.value.param == "messages.0.content.1"


def test_prompt_shapes():
    assert P.parse_request(P.CompletionRequest, {"prompt": "a"}).prompt_list() == ["a"]
    assert P.parse_request(P.CompletionRequest, {"prompt": ["a", "b"]}).prompt_list() == ["a", "b"]
    assert P.parse_request(P.CompletionRequest, {"prompt": [1, 2]}).prompt_list() == [[1, 2]]
    assert P.parse_request(P.CompletionRequest,
                           {"prompt": [[1], [2, 3]]}).prompt_list() == [[1], [2, 3]]


# ---- to_sampling_params ----------------------------------------------------------------------
def test_completion_sampling_params_mapping():
    req = P.parse_request(P.CompletionRequest, {
        "prompt": "x", "n": 3, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
        "repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "seed": 9, "stop": "END", "stop_token_ids": [4], "ignore_eos": True, "min_tokens": 2,
        "logprobs": 2, "logit_bias": {"7": -100, "8": 5.5}, "skip_special_tokens": False,
        "include_stop_str_in_output": True, "max_tokens": 20})
    sp = req.to_sampling_params(max_model_len=100, prompt_len=10)
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (3, 0.5, 0.9, 5, 0.1)
    assert (sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty) == (1.2, 0.5, -0.5)
    assert sp.seed == 9 and sp.stop == ["END"] and sp.stop_token_ids == [4]
    assert sp.ignore_eos and sp.min_tokens == 2 and sp.logprobs == 2 and sp.max_tokens == 20
    assert sp.logit_bias == {7: -100.0, 8: 5.5}
    assert not sp.skip_special_tokens and sp.include_stop_str_in_output
    assert sp.prompt_logprobs is None


def test_completion_defaults_follow_vllm():
    sp = P.parse_request(P.CompletionRequest, {"prompt": "x"}).to_sampling_params(100, 10)
    assert sp.max_tokens == 16 and sp.temperature == 1.0 and sp.top_p == 1.0 and sp.n == 1
    sp = P.parse_request(P.CompletionRequest,
                         {"prompt": "x", "max_tokens": None}).to_sampling_params(100, 10)
    assert sp.max_tokens == 90  # no limit: the room left in the context


def test_echo_with_logprobs_asks_for_prompt_logprobs():
    sp = P.parse_request(P.CompletionRequest, {"prompt": "x", "echo": True, "logprobs": 1}
                         ).to_sampling_params(100, 10)
    assert sp.prompt_logprobs == 1


def test_max_tokens_beyond_the_context_is_rejected():
    req = P.parse_request(P.CompletionRequest, {"prompt": "x", "max_tokens": 91})
    with pytest.raises(InvalidRequestError) as e:
        req.to_sampling_params(max_model_len=100, prompt_len=10)
    assert e.value.param == "max_tokens" and "100" in e.value.message
    with pytest.raises(InvalidRequestError) as e:
        P.parse_request(P.CompletionRequest, {"prompt": "x"}).to_sampling_params(100, 100)
    assert e.value.param == "prompt"


def test_chat_sampling_params_mapping():
    msgs = [{"role": "user", "content": "hi"}]
    base = {"messages": msgs}
    sp = P.parse_request(PC.ChatCompletionRequest, base).to_sampling_params(100, 30)
    assert sp.max_tokens == 70 and sp.logprobs is None  # chat: no limit by default
    sp = P.parse_request(PC.ChatCompletionRequest, {**base, "max_tokens": 5,
                                                   "max_completion_tokens": 7}
                         ).to_sampling_params(100, 30)
    assert sp.max_tokens == 7  # the newer name wins
    sp = P.parse_request(PC.ChatCompletionRequest, {**base, "logprobs": True}
                         ).to_sampling_params(100, 30)
    assert sp.logprobs == 0  # sampled token only
    sp = P.parse_request(PC.ChatCompletionRequest, {**base, "logprobs": True, "top_logprobs": 4}
                         ).to_sampling_params(100, 30)
    assert sp.logprobs == 4
    with pytest.raises(InvalidRequestError) as e:
        P.parse_request(PC.ChatCompletionRequest, {**base, "max_completion_tokens": 71}
                        ).to_sampling_params(100, 30)
    assert e.value.param == "max_completion_tokens"


def test_sampling_params_errors_keep_their_field():
    req = P.parse_request(P.CompletionRequest, {"prompt": "x", "seed": -3})
    with pytest.raises(InvalidRequestError) as e:
        req.to_sampling_params(100, 1)
    assert e.value.param == "seed"


# ---- responses parse with the official client types -------------------------------------------
def roundtrip(model) -> dict:
    return json.loads(model.model_dump_json())


def test_responses_match_openai_types():
    usage = P.UsageInfo(prompt_tokens=3, completion_tokens=2, total_tokens=5)
    comp = P.CompletionResponse(model="m", usage=usage, choices=[P.CompletionResponseChoice(
        index=0, text="hi", finish_reason="length", logprobs=P.CompletionLogProbs(
            text_offset=[0], token_logprobs=[-0.5], tokens=["hi"],
            top_logprobs=[{"hi": -0.5}]))])
    c = ot.Completion.model_validate(roundtrip(comp))
    assert c.choices[0].logprobs.token_logprobs == [-0.5] and c.usage.total_tokens == 5
    chat = PC.ChatCompletionResponse(model="m", usage=usage, choices=[
        PC.ChatCompletionResponseChoice(
            index=0, message=PC.ChatMessage(role="assistant", content="yo"), finish_reason="stop",
            logprobs=PC.ChatCompletionLogProbs(content=[PC.ChatCompletionLogProbsContent(
                token="yo", logprob=-0.1, bytes=[121, 111],
                top_logprobs=[PC.ChatCompletionLogProb(token="yo", logprob=-0.1)])]))])
    cc = oc.ChatCompletion.model_validate(roundtrip(chat))
    assert cc.choices[0].logprobs.content[0].top_logprobs[0].token == "yo"
    chunk = PC.ChatCompletionStreamResponse(id="x", created=1, model="m", choices=[
        PC.ChatCompletionStreamChoice(index=0, delta=PC.DeltaMessage(role="assistant",
                                                                    content=""))])
    assert oc.ChatCompletionChunk.model_validate(roundtrip(chunk)).choices[0].delta.role \
        == "assistant"
    models = P.ModelList(data=[P.ModelCard(id="m", max_model_len=10)])
    assert ot.Model.model_validate(roundtrip(models)["data"][0]).id == "m"
    err = P.ErrorResponse(error=P.ErrorInfo(message="bad", type="BadRequestError", param="n",
                                            code=400))
    assert roundtrip(err) == {"error": {"message": "bad", "type": "BadRequestError",
                                        "param": "n", "code": 400}}


# ---- logprob formats -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokens():
    from jaxserve.testing.tiny_model import train_tokenizer

    return _Tokens(train_tokenizer(300))


def test_chat_logprobs_are_ranked_and_clamped(tokens):
    pos = {5: Logprob(-2.0, 3, "a"), 6: Logprob(-0.1, 1, "b"), 7: Logprob(-0.5, 2, "c"),
           8: Logprob(-math.inf, 4, "d")}
    (entry,) = _chat_logprobs(tokens, [5], [pos], k=2)
    assert entry.token == "a" and entry.logprob == -2.0 and entry.bytes == [97]
    assert [t.token for t in entry.top_logprobs] == ["b", "c"]
    (entry,) = _chat_logprobs(tokens, [8], [pos], k=0)
    assert entry.logprob == -9999.0 and entry.top_logprobs == []


def test_legacy_logprobs_offsets_and_prompt_none(tokens):
    pos = [None, {9: Logprob(-1.0, 1, "xy")}, {10: Logprob(-0.25, 2, "z"),
                                               11: Logprob(-0.2, 1, "w")}]
    lp = _legacy_logprobs(tokens, [3, 9, 10], pos, start_offset=4)
    assert lp.token_logprobs == [None, -1.0, -0.25]
    assert lp.top_logprobs[0] is None and lp.top_logprobs[2] == {"w": -0.2, "z": -0.25}
    first = tokens.text(3)
    assert lp.text_offset == [4, 4 + len(first), 4 + len(first) + 2]


# ---- metrics (no server needed) --------------------------------------------------------------
def test_metrics_collector_and_request_histograms():
    stats = dict(num_running=2, num_waiting=1, kv_cache_usage=0.25, prefix_cache_queries=40,
                 prefix_cache_hits=10, num_preemptions=3, num_compiles=12,
                 prompt_tokens_total=100, generation_tokens_total=50, num_free_pages=30,
                 num_pages=40)
    m1, m2 = ServerMetrics(lambda: stats, "a"), ServerMetrics(lambda: stats, "b")  # no clash
    obs = m1.observer()
    t0 = 1000.0
    metrics = RequestMetrics(arrival_time=t0, first_scheduled_time=t0 + 0.1,
                             first_token_time=t0 + 0.5)
    out = RequestOutput("r", None, [1, 2, 3], [CompletionOutput(0, "a", [4])], metrics=metrics)
    obs.on_output(out)
    out2 = RequestOutput("r", None, [1, 2, 3], [CompletionOutput(0, "abc", [4, 5, 6],
                                                                 finish_reason="length")],
                         finished=True, metrics=metrics)
    metrics.finished_time = t0 + 1.5
    obs.on_output(out2)
    obs.on_finish(out2, ["length"])
    obs.on_finish(out2, ["length"])  # idempotent
    fams = {f.name: f for f in text_string_to_metric_families(m1.render().decode())}
    val = {s.name: s.value for f in fams.values() for s in f.samples if "le" not in s.labels}
    assert val["jaxserve:num_requests_running"] == 2
    assert val["jaxserve:kv_cache_usage_perc"] == 0.25
    assert val["jaxserve:gpu_prefix_cache_hit_rate"] == 0.25
    assert val["jaxserve:prompt_tokens_total"] == 100
    assert val["jaxserve:num_preemptions_total"] == 3
    assert val["jaxserve:num_compiles"] == 12
    assert val["jaxserve:time_to_first_token_seconds_count"] == 1
    assert val["jaxserve:time_to_first_token_seconds_sum"] == pytest.approx(0.5)
    assert val["jaxserve:e2e_request_latency_seconds_sum"] == pytest.approx(1.5)
    # vLLM's meanings: per-request mean over decode (1 s / 2 gaps), and one sample per gap
    assert val["jaxserve:request_time_per_output_token_seconds_sum"] == pytest.approx(0.5)
    assert val["jaxserve:request_time_per_output_token_seconds_count"] == 1
    assert val["jaxserve:inter_token_latency_seconds_count"] == 2
    assert val["jaxserve:time_per_output_token_seconds_count"] == 2
    assert val["jaxserve:request_success_total"] == 1
    assert val["jaxserve:request_generation_tokens_sum"] == 3
    assert all(s.labels["model_name"] == "a" and s.labels["engine"] == "0"
               for f in fams.values() for s in f.samples)
    assert b'model_name="b"' in m2.render()


# ---- --chat-template -------------------------------------------------------------------------
def test_chat_template_flag_takes_a_file_or_a_template(tmp_path):
    from jaxserve.entrypoints.openai.serving_engine import load_chat_template

    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert load_chat_template(str(f)) == f.read_text()
    assert load_chat_template("{{ messages[0]['content'] }}") == "{{ messages[0]['content'] }}"
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="neither a readable file nor a template"):
        load_chat_template(str(tmp_path / "missing.jinja"))


# ---- nothing silently ignored (issue #20) ------------------------------------------------------
LIVE_VALUES = {"response_format": {"type": "json_object"}, "tool_choice": "required",
               "function_call": {"name": "f"}, "parallel_tool_calls": "yes",
               "modalities": ["text", "audio"], "chat_template_kwargs": {"enable_thinking": False},
               "tools": [{"type": "function", "function": {"name": "f"}}],
               "functions": [{"name": "f"}], "bad_words": ["x"], "use_beam_search": True,
               "early_stopping": True, "include_reasoning": True, "store": True,
               "return_tokens_as_token_ids": True, "return_token_ids": True,
               "tool_calls": [{"id": "1"}]}
ALWAYS_INERT = {"metadata", "service_tier"}


@pytest.mark.parametrize("name", sorted(set(P.UNSUPPORTED_FIELDS) - ALWAYS_INERT))
@pytest.mark.parametrize("cls,base", [
    (P.CompletionRequest, {"prompt": "x"}),
    (PC.ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]}),
    (P.TokenizeCompletionRequest, {"prompt": "x"}),
])
def test_unsupported_fields_are_refused_by_name(cls, base, name):
    if name in cls.model_fields:
        pytest.skip(f"{cls.__name__} implements {name}")
    value = LIVE_VALUES.get(name, {"a": 1})
    with pytest.raises(InvalidRequestError) as e:
        P.parse_request(cls, {**base, name: value})
    assert e.value.param == name and name in e.value.message and e.value.status_code == 400


@pytest.mark.parametrize("extra", [
    {"tools": []}, {"tools": None}, {"tool_choice": "none"}, {"response_format": {"type": "text"}},
    {"metadata": {"k": "v"}}, {"store": False}, {"guided_json": None},
    {"parallel_tool_calls": True}, {"modalities": ["text"]}, {"user": "u-1"},
])
def test_inert_values_of_unsupported_fields_are_accepted(extra):
    req = P.parse_request(PC.ChatCompletionRequest,
                          {"messages": [{"role": "user", "content": "x"}], **extra})
    assert req.messages[0].content == "x"


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "max_tokenz": 3}, "max_tokenz"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": True,
                                                        "continuous_usage_stats": True}},
     "continuous_usage_stats"),
    ({"prompt": "x", "stream": True, "stream_options": {"usage": True}}, "stream_options.usage"),
])
def test_unknown_fields_are_refused_by_name(body, param):
    with pytest.raises(InvalidRequestError) as e:
        P.parse_request(P.CompletionRequest, body)
    assert e.value.param == param and param.split(".")[-1] in e.value.message


def test_unknown_message_field_names_its_path():
    with pytest.raises(InvalidRequestError) as e:
        P.parse_request(PC.ChatCompletionRequest, {"messages": [
            {"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "foo": 1}]})
    assert e.value.param == "messages.1.foo"


def test_speculative_decoding_opt_out_field():
    sp = P.parse_request(P.CompletionRequest, {"prompt": "x", "disable_speculative_decoding":
                                               True}).to_sampling_params(100, 10)
    assert sp.disable_speculative_decoding is True
    assert P.parse_request(PC.ChatCompletionRequest, {
        "messages": [{"role": "user", "content": "x"}]}).to_sampling_params(
            100, 10).disable_speculative_decoding is False
    assert parse_err(P.CompletionRequest, {"prompt": "x", "disable_speculative_decoding":
                                           "yes"}).param == "disable_speculative_decoding"
