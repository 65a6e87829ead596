"""End-to-end engine tests on tiny random models: HF parity, preemption, prefix caching, seeds."""
from __future__ import annotations

import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxserve import LLM, SamplingParams  # noqa: E402

MAX_NEW = 12


def _hf_greedy(model_dir, prompts, max_new):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model.eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                               do_sample=False, min_new_tokens=max_new, pad_token_id=0)
            outs.append(g[0, len(p):].tolist())
    return outs


def _prompts(n, vocab, seed=0, lo=3, hi=40):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _assert_pool_full(llm):
    bm = llm.llm_engine.block_manager
    assert not llm.llm_engine.has_unfinished_requests()
    assert bm.num_free_pages == llm.llm_engine.runner.num_pages - 1


@pytest.fixture(scope="module")
def llama_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def hf_ref(llama_dir):
    prompts = _prompts(16, 500)
    return prompts, _hf_greedy(llama_dir, prompts, MAX_NEW)


def _llm(model_dir, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("max_model_len", 128)
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("max_num_batched_tokens", 32)
    kw.setdefault("min_token_bucket", 8)  # ladder 8, 16, 32: few compiles on CPU
    return LLM(str(model_dir), **kw)


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def test_greedy_batch_equals_hf(llama_dir, hf_ref):
    prompts, want = hf_ref
    llm = _llm(llama_dir)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    _assert_pool_full(llm)
    assert llm.llm_engine.runner.num_compiles <= llm.llm_engine.runner.num_graphs


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs(llama_dir, hf_ref, mode):
    prompts, want = hf_ref
    # 10 pages of 16 tokens for 8 concurrent sequences of up to 52 tokens: preemption is forced
    llm = _llm(llama_dir, num_gpu_blocks_override=12, preemption_mode=mode)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    _assert_pool_full(llm)


def test_prefix_caching_same_outputs_and_hits(llama_dir):
    rng = random.Random(1)
    shared = [rng.randrange(3, 500) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, 500) for _ in range(rng.randint(1, 10))]
               for _ in range(6)]
    results = {}
    for on in (True, False):
        llm = _llm(llama_dir, enable_prefix_caching=on)
        # two waves so the second finds the first's pages cached
        first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
        rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
        results[on] = [o.outputs[0].token_ids for o in first + rest]
        bm = llm.llm_engine.block_manager
        if on:
            assert bm.hit_rate > 0
            assert rest[0].num_cached_tokens >= 32
        _assert_pool_full(llm)
    assert results[True] == results[False]


def test_seeded_sampling_alone_equals_in_batch(llama_dir):
    llm = _llm(llama_dir)
    p = _prompts(1, 500, seed=5)[0]
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = _prompts(5, 500, seed=6)
    batch = llm.generate(others[:2] + [p] + others[2:],
                         [SamplingParams(temperature=0.8, max_tokens=7, ignore_eos=True)] * 2
                         + [sp] + [SamplingParams(temperature=0.0, max_tokens=5)] * 3,
                         use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone
    _assert_pool_full(llm)


def test_unseeded_sampling_draws_fresh_randomness(llama_dir):
    """Unseeded rows get fresh seeds from the engine's generator: two identical requests (and
    the steps of one request) do not repeat each other's draws."""
    llm = _llm(llama_dir)
    p = _prompts(1, 500, seed=8)[0]
    sp = SamplingParams(temperature=1.5, max_tokens=12, ignore_eos=True)
    a, b = (o.outputs[0].token_ids for o in llm.generate([p, p], sp, use_tqdm=False))
    c = llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert len({tuple(a), tuple(b), tuple(c)}) == 3
    _assert_pool_full(llm)


def test_no_compiles_after_warmup_mixed_workload(llama_dir):
    llm = _llm(llama_dir, max_num_seqs=8)
    runner = llm.llm_engine.runner
    warm = runner.num_compiles
    rng = random.Random(7)
    prompts = _prompts(200, 500, seed=7, lo=1, hi=90)
    params = [SamplingParams(temperature=rng.choice([0.0, 0.7, 1.0]), top_k=rng.choice([0, 5]),
                             top_p=rng.choice([1.0, 0.8]), max_tokens=rng.randint(1, 8),
                             presence_penalty=rng.choice([0.0, 0.5]), seed=rng.choice([None, 3]))
              for _ in prompts]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outs) == 200
    assert all(1 <= len(o.outputs[0].token_ids) <= p.max_tokens for o, p in zip(outs, params))
    assert runner.num_compiles == warm
    _assert_pool_full(llm)


def test_n_and_stop_strings(llama_dir):
    llm = _llm(llama_dir)
    tok = llm.get_tokenizer()
    prompt = "The capital of France is"
    out = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=8,
                                                ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # stop string: take the greedy text and stop on a piece of it
    base = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    text = base.text
    assert text == tok.decode(base.token_ids, skip_special_tokens=True)
    if len(text.strip()) >= 4:
        stop = text.strip()[2:4]
        cut = text.index(stop)
        o = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, stop=[stop],
                                                  ignore_eos=True), use_tqdm=False)[0].outputs[0]
        assert o.finish_reason == "stop" and o.stop_reason == stop
        assert o.text == text[:cut]
        o2 = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, stop=[stop],
                                                   include_stop_str_in_output=True,
                                                   ignore_eos=True), use_tqdm=False)[0].outputs[0]
        assert o2.text == text[:cut + len(stop)]
    _assert_pool_full(llm)


def test_n_fans_out_into_core_requests_that_share_the_prompt_pages(llama_dir):
    """The core sees one request per choice (seed + i, prompt logprobs on choice 0 only);
    siblings take choice 0's full prompt pages from the prefix cache; choice i equals the
    n = 1 request with seed + i; prompt logprobs come once; aborting the request aborts every
    child and frees every page."""
    llm = _llm(llama_dir, enable_prefix_caching=True)
    eng = llm.llm_engine
    prompt = _prompts(1, 500, seed=4, lo=36, hi=36)[0]  # 2 full pages of 16
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True,
                            prompt_logprobs=1)
    eng.add_request("p", prompt, params)
    kids = sorted(eng.scheduler.requests.values(), key=lambda r: r.request_id)
    assert [r.sampling_params.seed for r in kids] == [7, 8, 9]
    assert all(r.sampling_params.n == 1 for r in kids)
    assert [r.sampling_params.prompt_logprobs for r in kids] == [1, None, None]
    assert [r.prefix_parent for r in kids] == [None] + [kids[0].request_id] * 2
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert [k.num_cached_tokens for k in kids] == [0, 32, 32]
    assert all(o.request_id == "p" for o in outs)
    final = outs[-1]
    assert final.finished and [c.index for c in final.outputs] == [0, 1, 2]
    assert len(final.prompt_logprobs) == len(prompt)  # once, not per choice
    for i, c in enumerate(final.outputs):
        one = llm.generate([{"prompt_token_ids": prompt}],
                           SamplingParams(temperature=1.0, seed=7 + i, max_tokens=6,
                                          ignore_eos=True), use_tqdm=False)[0].outputs[0]
        assert c.token_ids == one.token_ids and c.finish_reason == "length"
    eng.add_request("q", prompt, SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    eng.step()
    eng.step()
    eng.abort_request("q")
    assert not eng.scheduler.requests and not eng.has_unfinished_requests()
    _assert_pool_full(llm)


def test_bad_input_raises_named_field(llama_dir):
    llm = _llm(llama_dir)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[1] * 200], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        llm.generate(["hi"], SamplingParams(temperature=-1.0), use_tqdm=False)
    _assert_pool_full(llm)


def test_abort_frees_pages(llama_dir):
    llm = _llm(llama_dir)
    eng = llm.llm_engine
    for i, p in enumerate(_prompts(4, 500, seed=9)):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.block_manager.num_free_pages < eng.runner.num_pages - 1
    eng.abort_request([f"r{i}" for i in range(4)])
    assert not eng.has_unfinished_requests()
    assert eng.block_manager.num_free_pages == eng.runner.num_pages - 1


def test_logprobs_match_log_softmax(llama_dir):
    llm = _llm(llama_dir)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=4, logprobs=3,
                                                      ignore_eos=True), use_tqdm=False)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 4
    for tok, pos in zip(c.token_ids, c.logprobs):
        assert tok in pos and pos[tok].rank == 1  # greedy picks the top token
        lps = sorted((lp.logprob for lp in pos.values()), reverse=True)
        assert len(pos) >= 3 and all(v <= 0 for v in lps)
        assert np.isclose(pos[tok].logprob, lps[0])
    assert np.isclose(c.cumulative_logprob, sum(pos[t].logprob for t, pos in
                                                zip(c.token_ids, c.logprobs)), atol=1e-4)


def test_prompt_logprobs_match_hf(llama_dir):
    prompt = _prompts(1, 500, seed=11, lo=45, hi=45)[0]  # longer than a 32-token step: chunked
    llm = _llm(llama_dir)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2,
                                                ignore_eos=True), use_tqdm=False)[0]
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(prompt) and plp[0] is None
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), -1).numpy()
    for j in range(1, len(prompt)):
        d = plp[j]
        assert prompt[j] in d and len(d) >= 2
        np.testing.assert_allclose(d[prompt[j]].logprob, ref[j - 1, prompt[j]], atol=1e-4)
        assert d[prompt[j]].rank == 1 + int((ref[j - 1] > ref[j - 1, prompt[j]]).sum())
        top = int(np.argmax(ref[j - 1]))
        assert top in d and np.isclose(d[top].logprob, ref[j - 1, top], atol=1e-4)
    _assert_pool_full(llm)


def test_token_ids_outside_vocab_name_the_field(llama_dir):
    llm = _llm(llama_dir)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(["hi"], SamplingParams(stop_token_ids=[10**6]), use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(["hi"], SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[10**6]], GREEDY, use_tqdm=False)
    _assert_pool_full(llm)


def test_warmup_plans_fill_each_bucket_with_trash_page_rows(llama_dir):
    """Warm-up runs real rows (both attention paths: single-token rows and long rows), all on
    the trash page, so no loop body is first entered by a request and no live page is written."""
    from jaxserve.worker.warmup import warmup_plan
    from pallas_kernels.xla_attention import SHORT_QUERY

    runner = _llm(llama_dir, max_num_seqs=8).llm_engine.runner
    for t in runner.ladder:
        s = min(t, runner.max_num_seqs)
        mixed, long_rows = warmup_plan(runner, t, s, False), warmup_plan(runner, t, s, True)
        for plan in (mixed, long_rows):
            assert plan.token_bucket == t and plan.num_tokens == t
            assert not plan.block_tables[:, :plan.num_seqs].any()  # every page is the trash page
            assert np.all(plan.slot_mapping < runner.block_size)
        q = np.diff(long_rows.query_start[:long_rows.num_seqs + 1])
        assert q.max() == min(t, runner.max_pages_per_seq * runner.block_size - 1)
        assert mixed.num_seqs == s
        if t > SHORT_QUERY + s - 1:
            assert np.diff(mixed.query_start[:s + 1]).max() > SHORT_QUERY
