"""allowed_token_ids and bad_words: mask rows of the step bitmask, exact under async scheduling."""
from __future__ import annotations

import numpy as np
import pytest

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.token_filter import TokenFilter, bad_words_token_ids

SMALL = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, min_token_bucket=32,
             num_gpu_blocks_override=64)


def _allowed(row: np.ndarray, vocab: int) -> set[int]:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab]
    return {int(t) for t in np.flatnonzero(bits)}


def test_rows():
    f = TokenFilter(100, allowed_token_ids=[0, 31, 32, 63, 99])
    assert _allowed(f.base, 100) == {0, 31, 32, 63, 99} and not f.needs_history
    f = TokenFilter(100, bad_words_ids=[[31], [5, 6, 7]])
    assert _allowed(f.base, 100) == set(range(100)) - {31}
    assert f.needs_history
    assert _allowed(f.row([1, 5, 6]), 100) == set(range(100)) - {31, 7}  # after its prefix
    assert _allowed(f.row([5, 6, 1]), 100) == set(range(100)) - {31}
    assert _allowed(f.row([6]), 100) == set(range(100)) - {31}


def test_validation():
    for bad in ([], [-1], [1.5], "7", [True]):
        with pytest.raises(ValueError, match="allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad)
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["ok", ""])
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[3, 600]).verify_vocab(512)


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    from jaxserve.entrypoints.llm import LLM

    return LLM(str(tiny_model_factory("llama")), **SMALL)


def _contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def test_allowed_token_ids_only(llm):
    allowed = [7, 11, 13, 300]
    outs = llm.generate([[5, 6, 7], [9, 9]], SamplingParams(
        max_tokens=24, ignore_eos=True, seed=3, allowed_token_ids=allowed), use_tqdm=False)
    for o in outs:
        assert len(o.outputs[0].token_ids) == 24 and set(o.outputs[0].token_ids) <= set(allowed)
    plain = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=24, ignore_eos=True, seed=3),
                         use_tqdm=False)[0].outputs[0].token_ids
    assert not set(plain) <= set(allowed)  # the restriction is not the model's own habit


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_bad_words_never_appear(tiny_model_factory, async_scheduling):
    """Words taken from the greedy answer itself (one-token and multi-token ones): with them
    banned, none of their token sequences appears, and the answer changes."""
    from jaxserve.entrypoints.llm import LLM

    llm = LLM(str(tiny_model_factory("llama")), async_scheduling=async_scheduling, **SMALL)
    tok = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = llm.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    words = [w for w in {tok.decode(want[i:i + n]).strip() for i in (2, 6) for n in (1, 2)} if w]
    banned = bad_words_token_ids(tok, words)
    assert any(_contains(want, ids) for ids in banned), (words, banned)
    assert any(len(ids) > 1 for ids in banned)
    got = llm.generate([[5, 6, 7]], SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, bad_words=words),
        use_tqdm=False)[0].outputs[0].token_ids
    assert len(got) == 24 and got != want
    for ids in banned:
        assert not _contains(got, ids), (ids, got)
