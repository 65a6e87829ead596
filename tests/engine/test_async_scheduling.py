"""Async scheduling is exact: the same tokens, logprobs and finish reasons as the synchronous
loop, for every feature that touches a step (greedy, seeded sampling with penalties, n > 1,
stop strings, stop ids, logprobs, prompt logprobs, preemption by recompute and by swap), and no
token sampled past a stop is ever shown or counted."""
from __future__ import annotations

import random

import pytest

from jaxserve import LLM, SamplingParams

VOCAB = 500


def _prompts(n, seed=0, lo=3, hi=40):
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _llm(model_dir, async_scheduling, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("max_model_len", 128)
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("max_num_batched_tokens", 32)
    kw.setdefault("min_token_bucket", 8)
    return LLM(str(model_dir), async_scheduling=async_scheduling, **kw)


@pytest.fixture(scope="module")
def llama_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def pair(llama_dir):
    return _llm(llama_dir, False), _llm(llama_dir, True)


def _summary(outs):
    rows = []
    for o in outs:
        for c in o.outputs:
            lps = None
            if c.logprobs is not None:
                lps = [{t: round(lp.logprob, 4) for t, lp in d.items()} for d in c.logprobs]
            rows.append((c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason, lps))
        if o.prompt_logprobs is not None:
            rows.append([None if d is None else {t: round(lp.logprob, 4) for t, lp in d.items()}
                         for d in o.prompt_logprobs])
    return rows


def _assert_same(pair, prompts, params):
    sync_llm, async_llm = pair
    want = _summary(sync_llm.generate(prompts, params, use_tqdm=False))
    got = _summary(async_llm.generate(prompts, params, use_tqdm=False))
    assert got == want
    for llm in pair:
        eng = llm.llm_engine
        assert not eng.has_unfinished_requests()
        assert eng.block_manager.num_free_pages == eng.runner.num_pages - 1
    return got


def test_async_is_on_by_default_and_overlaps(llama_dir, pair):
    """Between two steps the async engine holds a dispatched step whose ids it has not read,
    and the scheduler already counts placeholders for them."""
    _, llm = pair
    eng = llm.llm_engine
    assert eng.async_scheduling
    eng.add_request("a", _prompts(1, seed=3)[0], SamplingParams(max_tokens=6, ignore_eos=True))
    eng.step()  # dispatches the prefill; nothing read yet
    assert eng.num_in_flight == 1
    (req,) = eng.scheduler.requests.values()  # keyed by a core id, never the caller's
    assert req.num_pending == 1 and req.output_token_ids == [-1]
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    final = outs[-1].outputs[0]
    assert len(final.token_ids) == 6 and -1 not in final.token_ids
    assert eng.generation_tokens_total >= 6


def test_greedy_identical(pair):
    _assert_same(pair, _prompts(12), SamplingParams(temperature=0, max_tokens=10,
                                                    ignore_eos=True))


def test_seeded_sampling_with_penalties_identical(pair):
    """Penalties read the output history, whose last id is still on the device."""
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=7, max_tokens=12,
                            presence_penalty=0.5, frequency_penalty=0.3,
                            repetition_penalty=1.3, ignore_eos=True)
    got = _assert_same(pair, _prompts(6, seed=1), params)
    assert len({tuple(r[1]) for r in got}) > 1


def test_n_and_logprobs_identical(pair):
    params = SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=8, logprobs=3,
                            ignore_eos=True)
    got = _assert_same(pair, _prompts(3, seed=2), params)
    assert len(got) == 9 and all(r[5] is not None and len(r[5]) == 8 for r in got)


def test_prompt_logprobs_identical(pair):
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2, ignore_eos=True)
    _assert_same(pair, _prompts(3, seed=4), params)


def test_stops_one_step_behind_drop_the_extra_token(pair):
    """Stop ids and stop strings are checked a step late; the token sampled in the step that was
    already running is dropped: outputs end exactly where the synchronous loop ends them and the
    generation counter counts only the tokens shown."""
    sync_llm, async_llm = pair
    prompts = _prompts(8, seed=5)
    free = sync_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12,
                                                     ignore_eos=True), use_tqdm=False)
    stop_ids = sorted({o.outputs[0].token_ids[3] for o in free})[:4]
    _assert_same(pair, prompts, SamplingParams(temperature=0, max_tokens=12,
                                               stop_token_ids=stop_ids, ignore_eos=True))
    texts = [o.outputs[0].text for o in free if len(o.outputs[0].text) > 6]
    stops = sorted({t[3:5] for t in texts})[:3]
    eng = async_llm.llm_engine
    before = eng.generation_tokens_total
    got = _assert_same(pair, prompts, SamplingParams(temperature=0, max_tokens=12, stop=stops,
                                                     ignore_eos=True))
    assert any(r[3] == "stop" for r in got)
    assert eng.generation_tokens_total - before == sum(len(r[1]) for r in got)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_identical(llama_dir, mode):
    """A pool too small for the batch: requests are preempted (and resumed) mid-generation,
    some with a token still in flight."""
    kw = dict(num_gpu_blocks_override=12, block_size=8, preemption_mode=mode)
    pair = (_llm(llama_dir, False, **kw), _llm(llama_dir, True, **kw))
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=24, ignore_eos=True)
    _assert_same(pair, _prompts(8, seed=6, lo=10, hi=30), params)
    for llm in pair:
        assert llm.llm_engine.scheduler.num_preemptions_total > 0
