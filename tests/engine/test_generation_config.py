"""The model's generation_config.json: request defaults for unset sampling fields, extra EOS
ids, and vLLM's ``--generation-config auto|vllm|DIR`` / ``--override-generation-config``."""
from __future__ import annotations

import json
import shutil

import pytest

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.generation_config import (default_sampling, eos_token_ids,
                                               load_generation_config)
from jaxserve.entrypoints.openai.protocol import CompletionRequest
from jaxserve.entrypoints.openai.protocol_chat import ChatCompletionRequest

SMALL = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, min_token_bucket=32,
             num_gpu_blocks_override=64)


def _with_generation_config(src, dst, **fields):
    shutil.copytree(src, dst)
    path = dst / "generation_config.json"
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config))
    return dst


def test_sources_and_overrides(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "generation_config.json").write_text('{"temperature": 0.6, "top_p": 0.9}')
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "generation_config.json").write_text('{"top_k": 5}')
    assert load_generation_config("auto", tmp_path / "m") == {"temperature": 0.6, "top_p": 0.9}
    assert load_generation_config("vllm", tmp_path / "m") == {}
    assert load_generation_config(str(tmp_path / "g"), tmp_path / "m") == {"top_k": 5}
    assert load_generation_config("auto", tmp_path / "m", {"temperature": 0.1}) == {
        "temperature": 0.1, "top_p": 0.9}
    assert load_generation_config("auto", None) == {}  # a GGUF file has none
    with pytest.raises(ValueError, match="generation_config"):
        load_generation_config(str(tmp_path / "missing"), None)


def test_default_sampling_keeps_only_sampling_fields():
    gc = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
          "repetition_penalty": 1.1, "max_new_tokens": 99, "eos_token_id": 2, "bos_token_id": 1}
    assert default_sampling(gc) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                                    "repetition_penalty": 1.1}
    assert default_sampling({"do_sample": False, "temperature": 0.6}) == {}


def test_eos_ids_are_the_union_in_order():
    assert eos_token_ids(2, [4, 2], None, 7) == (2, 4, 7)
    assert eos_token_ids(None, None) == ()


@pytest.mark.parametrize("cls,body", [
    (CompletionRequest, {"model": "m", "prompt": "x"}),
    (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}]}),
])
def test_server_requests_take_the_defaults_for_unset_fields(cls, body):
    defaults = {"temperature": 0.3, "top_k": 7}
    p = cls(**body).to_sampling_params(100, 1, defaults)
    assert p.temperature == 0.3 and p.top_k == 7
    p = cls(**body, temperature=0.9).to_sampling_params(100, 1, defaults)
    assert p.temperature == 0.9 and p.top_k == 7  # what the client sets wins
    p = cls(**body).to_sampling_params(100, 1)
    assert p.temperature == SamplingParams().temperature


def test_llm_uses_the_models_defaults_unless_told_not_to(tiny_model_factory, tmp_path):
    """A generation config with temperature 0 makes LLM.generate() greedy; ``vllm`` ignores it
    and samples (a random model's sampled tokens differ from its greedy ones)."""
    from jaxserve.entrypoints.llm import LLM

    model = _with_generation_config(tiny_model_factory("llama"), tmp_path / "m",
                                    temperature=0.0)
    prompt = [[5, 6, 7]]
    llm = LLM(str(model), **SMALL)
    assert llm.get_default_sampling_params().temperature == 0.0
    greedy = llm.generate(prompt, SamplingParams(temperature=0.0), use_tqdm=False)[0].outputs[0]
    default = llm.generate(prompt, use_tqdm=False)[0].outputs[0]
    assert default.token_ids == greedy.token_ids
    plain = LLM(str(model), generation_config="vllm", **SMALL)
    assert plain.get_default_sampling_params().temperature == 1.0
    sampled = plain.generate(prompt, use_tqdm=False)[0].outputs[0]
    assert sampled.token_ids != greedy.token_ids


def test_generation_config_eos_ids_stop_generation(tiny_model_factory, tmp_path):
    """Token 7 is an EOS id only in generation_config.json: pushed up by logit_bias, the request
    stops on it; with ``--generation-config vllm`` it does not."""
    from jaxserve.entrypoints.llm import LLM

    model = _with_generation_config(tiny_model_factory("llama"), tmp_path / "m",
                                    eos_token_id=[7])
    params = SamplingParams(temperature=0.0, max_tokens=5, logit_bias={7: 100.0})
    out = LLM(str(model), **SMALL).generate([[5, 6]], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [7] and out.finish_reason == "stop"
    out = LLM(str(model), generation_config="vllm", **SMALL).generate(
        [[5, 6]], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [7] * 5 and out.finish_reason == "length"


def test_bad_flags_name_the_field():
    from jaxserve.config import engine_config_from_kwargs

    with pytest.raises(ValueError, match="override_generation_config"):
        engine_config_from_kwargs("m", override_generation_config="{not json")
    with pytest.raises(ValueError, match="override_generation_config"):
        engine_config_from_kwargs("m", override_generation_config="[1]")
    c = engine_config_from_kwargs("m", override_generation_config='{"temperature": 0.5}')
    assert c.override_generation_config == {"temperature": 0.5}
