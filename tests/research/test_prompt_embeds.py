"""{"prompt_embeds": array} prompts: the model's own embeddings of a prompt's tokens give the
token path's output; the prefix cache keys them by their digest, never by placeholder ids."""
import base64
import io

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from jaxserve import SamplingParams
from jaxserve.core.prompt_embeds import decode_base64
from jaxserve.errors import InvalidRequestError


@pytest.fixture(scope="module")
def llm(embeds_llm):
    return embeds_llm


@pytest.fixture(scope="module")
def table(tiny_llama_dir):
    [path] = tiny_llama_dir.glob("*.safetensors")
    return load_file(path)["model.embed_tokens.weight"].astype(np.float32)


def _params():
    return SamplingParams(temperature=0, max_tokens=6, logprobs=3)


def test_embeds_equal_tokens(llm, table):
    compiles = llm.llm_engine.stats()["num_compiles"]
    prompts = [[1, 5, 9, 13, 200, 7], list(range(3, 60))]  # the long one is chunked
    by_ids = llm.generate(prompts, _params(), use_tqdm=False)
    by_embeds = llm.generate([{"prompt_embeds": table[p]} for p in prompts] + [[8, 8, 8]],
                             _params(), use_tqdm=False)
    for a, b in zip(by_ids, by_embeds):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.num_cached_tokens == 0  # the token prompt's pages are not the embeds'
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            np.testing.assert_allclose([x.logprob for x in lb.values()],
                                       [x.logprob for x in la.values()], rtol=0, atol=1e-5)
    # the same embeddings again: served from the prefix cache, same tokens
    [again] = llm.generate([{"prompt_embeds": torch.tensor(table[prompts[1]])}], _params(),
                           use_tqdm=False)
    assert again.num_cached_tokens >= 16
    assert again.outputs[0].token_ids == by_ids[1].outputs[0].token_ids
    # other embeddings of the same length share nothing with them
    [other] = llm.generate([{"prompt_embeds": table[prompts[1]] * 0.5}], _params(),
                           use_tqdm=False)
    assert other.num_cached_tokens == 0
    assert llm.llm_engine.stats()["num_compiles"] == compiles


def test_bad_embeds(llm, tiny_llama_dir):
    for bad in (np.zeros((3, 7), np.float32), np.zeros((0, 64), np.float32),
                np.full((2, 64), np.nan, np.float32), "text"):
        with pytest.raises(InvalidRequestError, match="prompt_embeds"):
            llm.generate([{"prompt_embeds": bad}], _params(), use_tqdm=False)


def test_base64_formats(table):
    x = table[[1, 2, 3]]
    buf = io.BytesIO()
    np.save(buf, x)
    np.testing.assert_array_equal(decode_base64(base64.b64encode(buf.getvalue()).decode()), x)
    buf = io.BytesIO()
    torch.save(torch.tensor(x), buf)
    np.testing.assert_array_equal(decode_base64(base64.b64encode(buf.getvalue()).decode()), x)
    with pytest.raises(InvalidRequestError, match="prompt_embeds"):
        decode_base64("!!not base64")
