"""return_hidden_states: the residual stream at asked layers equals Hugging Face's
``output_hidden_states`` on the tiny Llama checkpoint, for prompt and generated tokens, with
no compile after warm-up."""
import numpy as np
import pytest
import torch

from jaxserve import SamplingParams
from jaxserve.errors import InvalidRequestError


@pytest.fixture(scope="module")
def llm(hidden_llm):
    return hidden_llm


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()


def _hf_hidden(hf, ids, layers):
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    return np.stack([out.hidden_states[i][0].numpy() for i in layers], axis=1)


def test_hidden_states_equal_hf(llm, hf):
    compiles = llm.llm_engine.stats()["num_compiles"]
    prompts = [[1, 5, 9, 13, 200, 7], list(range(3, 80)), [42, 43]]  # the long one is chunked
    asks = [[0, 1, 2], [-1], [2, 0]]
    params = [SamplingParams(temperature=0, max_tokens=5, extra_args={"return_hidden_states": a})
              for a in asks]
    params.append(SamplingParams(temperature=0, max_tokens=5))  # a neighbour that asks nothing
    outs = llm.generate(prompts + [[9, 9, 9]], params, use_tqdm=False)
    for ids, a, out in zip(prompts, asks, outs):
        gen = out.outputs[0].token_ids
        got = out.hidden_states
        read = ids + gen[:-1]  # every token the model read
        want = _hf_hidden(hf, read, a)
        assert got.shape == want.shape == (len(read), len(a), hf.config.hidden_size)
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    assert outs[3].hidden_states is None
    assert llm.llm_engine.stats()["num_compiles"] == compiles


def test_named_field_and_bad_input(llm):
    [out] = llm.generate([[4, 5, 6]], SamplingParams(temperature=0, max_tokens=2,
                                                      return_hidden_states=[2]), use_tqdm=False)
    assert out.hidden_states.shape == (4, 1, 64)
    with pytest.raises(InvalidRequestError, match="return_hidden_states"):
        llm.generate([[1, 2]], SamplingParams(return_hidden_states=[0, 1, 2, -1]), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="return_hidden_states"):
        llm.generate([[1, 2]], SamplingParams(return_hidden_states=[3]), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="return_hidden_states"):
        SamplingParams(extra_args={"return_hidden_states": "last"})
    with pytest.raises(InvalidRequestError, match="return_hidden_states"):
        SamplingParams(n=2, return_hidden_states=[1])
