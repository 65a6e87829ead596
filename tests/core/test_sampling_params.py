"""SamplingParams: vLLM defaults, and every invalid value raises InvalidRequestError naming the field."""
import sys

import pytest

from jaxserve.errors import InvalidRequestError
from jaxserve.core.sampling_params import DEFAULT_MAX_LOGPROBS, SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.max_tokens == 16 and p.min_tokens == 0 and p.seed is None
    assert p.stop == [] and p.stop_token_ids == [] and p.logit_bias is None
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.skip_special_tokens and p.spaces_between_special_tokens and p.detokenize
    assert not p.ignore_eos and not p.include_stop_str_in_output
    assert DEFAULT_MAX_LOGPROBS == 20


INVALID = [
    ("n", 0), ("n", 1.5), ("temperature", -0.1), ("temperature", float("nan")),
    ("top_p", 0.0), ("top_p", 1.01), ("top_k", -2), ("top_k", 2.5), ("min_p", -0.1),
    ("min_p", 1.5), ("presence_penalty", 2.5), ("presence_penalty", -2.01),
    ("frequency_penalty", 3.0), ("frequency_penalty", -2.5), ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0), ("seed", -1), ("seed", 2**64), ("max_tokens", 0),
    ("max_tokens", -5), ("min_tokens", -1), ("logprobs", -2), ("logprobs", 2.0),
    ("prompt_logprobs", -3), ("stop", [""]), ("stop", ["ok", 3]), ("stop", 5),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]), ("stop_token_ids", list(range(64))),
    ("logit_bias", {"x": 1.0}), ("logit_bias", {-3: 1.0}), ("logit_bias", {3: float("inf")}),
    ("logit_bias", [1, 2]), ("logit_bias", {i: 1.0 for i in range(1025)}),
    ("ignore_eos", "yes"), ("temperature", "hot"),
]


@pytest.mark.parametrize("field,value", INVALID)
def test_invalid_value_names_field(field, value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field
    assert field in str(e.value)
    assert isinstance(e.value, ValueError)


def test_min_tokens_above_max_tokens():
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert e.value.param == "min_tokens" and "5" in str(e.value)
    SamplingParams(max_tokens=None, min_tokens=50)  # None = up to max_model_len


def test_stop_needs_detokenize():
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(stop="x", detokenize=False)
    assert e.value.param == "stop"


def test_valid_edge_values():
    SamplingParams(temperature=0, top_p=1, top_k=-1, min_p=1.0, presence_penalty=-2,
                   frequency_penalty=2, repetition_penalty=2.0, seed=2**64 - 1, logprobs=20,
                   prompt_logprobs=0, max_tokens=1)


def test_normalisation():
    p = SamplingParams(stop="###", logit_bias={"5": -100, 7: 3}, temperature=1)
    assert p.stop == ["###"]
    assert p.logit_bias == {5: -100, 7: 3}
    assert isinstance(p.temperature, float)


def test_is_greedy():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=5e-6).is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy
    assert not SamplingParams(temperature=0.7, seed=1).is_greedy


def test_verify_vocab():
    SamplingParams(stop_token_ids=[9], logit_bias={9: 1}).verify_vocab(10)
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(stop_token_ids=[10]).verify_vocab(10)
    assert e.value.param == "stop_token_ids"
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(logit_bias={12: 1}).verify_vocab(10)
    assert e.value.param == "logit_bias"


def test_clone_is_deep():
    p = SamplingParams(stop=["a"], logit_bias={1: 2.0})
    q = p.clone()
    q.stop.append("b")
    q.logit_bias[3] = 1.0
    assert p.stop == ["a"] and p.logit_bias == {1: 2.0}


def test_host_module_imports_no_jax():
    import subprocess
    code = ("import sys, jaxserve.core.sampling_params, jaxserve.core.sampling_metadata, jaxserve.engine.tokenizer;"
            "bad=[m for m in sys.modules if m.split('.')[0] in ('jax','flax')];"
            "assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_logprobs_limit_is_the_engines_and_minus_one_is_the_vocabulary():
    p = SamplingParams(logprobs=-1, prompt_logprobs=3)
    assert p.verify_logprobs(-1, 512).logprobs == 512  # resolved on a copy
    assert p.logprobs == -1
    assert p.verify_logprobs(600, 512).logprobs == 512
    q = SamplingParams(logprobs=5)
    assert q.verify_logprobs(20, 512) is q
    for params, limit, field in ((SamplingParams(logprobs=5), 3, "logprobs"),
                                 (SamplingParams(logprobs=-1), 20, "logprobs"),
                                 (SamplingParams(prompt_logprobs=21), 20, "prompt_logprobs")):
        with pytest.raises(ValueError, match="max_logprobs") as e:
            params.verify_logprobs(limit, 512)
        assert e.value.param == field
