"""--batch-invariant: each of 64 prompts' logprobs (and greedy tokens) are bit-identical alone,
in batches of mixed sizes with random neighbours, and split differently by chunked prefill
(prompts longer than the step budget, chunked where their neighbours leave room)."""
import random

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import engine_config_from_kwargs


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), batch_invariant=True, max_model_len=256, max_num_seqs=32,
               max_num_batched_tokens=128)


N = 64  # prompts


def _lps(outs):
    return [(o.outputs[0].token_ids,
             np.array([next(iter(p.values())).logprob for p in o.outputs[0].logprobs]))
            for o in outs]


def test_logprobs_bit_identical_whatever_the_batch(llm):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(4, 200))] for _ in range(N)]
    sp = SamplingParams(temperature=0, max_tokens=6, logprobs=0)
    alone = [_lps(llm.generate([p], sp, use_tqdm=False))[0] for p in prompts]
    order = list(range(N))
    for trial in range(2):  # random neighbours, mixed batch sizes
        rng.shuffle(order)
        got, i = {}, 0
        for size in ([7, 1, 12, 20, 24] if trial == 0 else [3, 17, 31, 13]):
            idx = order[i:i + size]
            i += size
            for j, r in zip(idx, _lps(llm.generate([prompts[j] for j in idx], sp,
                                                   use_tqdm=False))):
                got[j] = r
        assert sorted(got) == list(range(N))
        for j in range(N):
            assert got[j][0] == alone[j][0], (trial, j)
            assert (got[j][1] == alone[j][1]).all(), (trial, j, got[j][1] - alone[j][1])


def test_flag_and_env(monkeypatch):
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert engine_config_from_kwargs("m").batch_invariant
    assert not engine_config_from_kwargs("m", batch_invariant=False).batch_invariant
    monkeypatch.delenv("VLLM_BATCH_INVARIANT")
    assert not engine_config_from_kwargs("m").batch_invariant


def test_features_off_by_default_are_refused(llm):
    """This engine has no prompt embeddings nor hidden-state capture: asking is an error
    naming the field."""
    from jaxserve.errors import InvalidRequestError
    with pytest.raises(InvalidRequestError, match="enable_prompt_embeds") as e:
        llm.generate([{"prompt_embeds": np.zeros((2, 64), np.float32)}], use_tqdm=False)
    assert e.value.param == "prompt_embeds"
    with pytest.raises(InvalidRequestError, match="max_hidden_state_layers") as e:
        llm.generate([[1, 2]], SamplingParams(return_hidden_states=[1]), use_tqdm=False)
    assert e.value.param == "return_hidden_states"
