"""Speculative decoding (n-gram and draft model) is exact: greedy output is identical with and
without it (sync and async loop, under preemption, stops and max_tokens inside an accepted run),
rejection sampling reproduces the target distribution (chi-square), seeded requests reproduce,
the verify shapes are compiled at warm-up, and the counters agree with the tokens produced."""
from __future__ import annotations

import json
import random
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxserve import LLM, SamplingParams
from jaxserve.config import SpeculativeConfig
from jaxserve.core.spec_decode import NgramProposer
from jaxserve.core.step_plan import ScheduledSeq, verify_arrays
from jaxserve.testing.reference_plan import build_step_plan, to_rows
from jaxserve.worker import rejection_sampler as rs
from jaxserve.worker.sampler import SamplingMetadata
from jaxserve.testing.reference_plan import build_sampling_arrays

VOCAB = 500
K = 3
SPEC = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}


# ---- host side ---------------------------------------------------------------------------
def test_ngram_longest_then_most_recent_match():
    p = NgramProposer(3, prompt_lookup_min=1, prompt_lookup_max=3)
    #                 0  1  2  3  4  5  6  7  8  9
    toks = np.array([5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7])
    # suffix (6, 7): the 3-gram (2, 6, 7) never occurred; (6, 7) last occurred at 5 -> 9, 2, 6
    assert p.propose_one(toks).tolist() == [9, 2, 6]
    assert p.propose_one(toks, max_len=1).tolist() == [9]
    assert p.propose_one(np.array([1, 2, 3, 4])).tolist() == []  # no earlier occurrence
    # the longest n wins over a more recent shorter match
    toks = np.array([1, 2, 3, 50, 9, 3, 60, 1, 2, 3])
    assert p.propose_one(toks).tolist() == [50, 9, 3]
    assert NgramProposer(3, 2, 3).propose_one(np.array([4, 3, 8, 3])).tolist() == []  # n >= 2


@pytest.mark.parametrize("bad, field", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0},
     "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "typo"),
])
def test_speculative_config_errors_name_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_dict(bad)


def test_speculative_config_defaults_like_vllm():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.from_dict({"num_speculative_tokens": 4, "prompt_lookup_max": 3})
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 3, 3)


def test_verify_arrays_point_at_the_drafted_positions():
    rows = [ScheduledSeq([11, 21, 22], 7, [[1]]), ScheduledSeq([1, 2, 3, 4], 0, [[2]]),
            ScheduledSeq([31], 5, [[3]])]
    rows[0].num_draft = 2
    plan = build_step_plan(rows, block_size=16, max_pages_per_seq=2, ladder=(8, 16),
                           max_num_seqs=4, num_spec_tokens=K)
    assert plan.spec_logits_indices.shape == (plan.seq_bucket, K + 1)
    assert plan.spec_logits_indices[0].tolist() == [0, 1, 2, 2]
    assert plan.spec_logits_indices[1].tolist() == [6] * 4  # a prefill row: its last token
    assert plan.spec_logits_indices[2].tolist() == [7] * 4
    assert plan.draft_token_ids[0].tolist() == [21, 22, 0]
    assert plan.num_draft[:3].tolist() == [2, 0, 0]
    with pytest.raises(ValueError, match="more than"):
        verify_arrays(plan.logits_indices, plan.token_ids, plan.prev_ref, [K + 1], K)


def test_scheduler_lookahead_slots_and_rollback():
    """Drafts get pages (lookahead slots), count as computed only once accepted, keep the
    request out of the next schedule while unread, and never reach past max_tokens; prefix-
    cache pages only ever hash accepted tokens."""
    from jaxserve.config import CacheConfig, SchedulerConfig
    from jaxserve.core.block_manager import BlockManager
    from jaxserve.core.request import Request
    from jaxserve.core.scheduler import Scheduler

    class P:
        max_tokens = 6

    bm = BlockManager(32, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
                      CacheConfig(block_size=4), bm, max_model_len=64)
    r = Request("a", [1, 2, 3, 4, 5, 6, 7], P())
    r.use_spec = True
    sched.add_request(r)
    out = sched.schedule()
    sched.update_after_dispatch(out, {"a": 8})  # prefill samples 8; 7 computed
    r.spec_token_ids = [9, 10, 11, 12, 13]
    out = sched.schedule()
    (s,) = out.scheduled
    # max_tokens 6, one output so far: at most 4 drafts (+ the target's own token = 5 more)
    assert s.num_draft == 4 and s.new_token_ids == [8, 9, 10, 11, 12]
    assert len(r.block_ids) == 3  # 7 + 5 = 12 positions: lookahead pages allocated
    assert s.start_pos == 7 and to_rows(out)[0].num_draft == 4
    sched.update_after_dispatch(out)
    assert r.num_computed_tokens == 8 and r.spec_in_flight and r.spec_token_ids == []
    assert sched.schedule().scheduled == []  # unread verify step: not scheduled again
    assert bm.num_cached_pages == 2  # pages of tokens 1-4 and 5-8 (all accepted or prompt)
    sched.commit_verified(r, 2)  # drafts 9, 10 kept; then the engine appends 9, 10, 77
    for t in (9, 10, 77):
        r.append_output_token(t)
    assert r.num_computed_tokens == 10 and not r.spec_in_flight
    bm.cache_full_blocks(r)
    assert bm.num_cached_pages == 2  # the third page holds 9, 10 and two rejected slots
    r.spec_token_ids = [5, 5]
    (s,) = sched.schedule().scheduled
    assert s.num_draft == 1 and s.new_token_ids == [77, 5]  # 4 outputs: room for 1 + 1


# ---- device acceptance --------------------------------------------------------------------
def test_greedy_verify_longest_prefix_plus_bonus():
    target = jnp.array([[4, 5, 6, 7], [4, 5, 6, 7], [4, 5, 6, 7], [9, 9, 9, 9]])
    drafts = jnp.array([[4, 5, 6], [4, 0, 6], [4, 5, 6], [1, 1, 1]])
    nd = jnp.array([3, 3, 1, 0])
    out = rs.greedy_verify(target, drafts, nd)
    assert out.num_emitted.tolist() == [4, 2, 2, 1]
    assert out.token_ids.tolist() == [[4, 5, 6, 7], [4, 5, -1, -1], [4, 5, -1, -1],
                                      [9, -1, -1, -1]]


def _chi2_pvalue(samples: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(samples, minlength=probs.size)
    keep = probs > 0
    assert counts[~keep].sum() == 0, "sampled a token of probability 0"
    probs = probs[keep].astype(np.float64)
    expected = probs / probs.sum() * counts.sum()
    return stats.chisquare(counts[keep].astype(np.float64), expected).pvalue


def test_rejection_sampling_reproduces_the_target_distribution():
    """Non-point-mass draft q and target p on 6 tokens, 2 drafts per row, drafts drawn from q:
    the first emitted token follows p_0, the second (where the first draft was kept) p_1, and
    the acceptance rate of draft 1 is sum(min(p, q)) (the coupling's overlap)."""
    rng = np.random.default_rng(0)
    V, S = 6, 40000
    p = np.array([[0.4, 0.3, 0.1, 0.1, 0.1, 0.0], [0.05, 0.05, 0.5, 0.2, 0.1, 0.1],
                  [0.2, 0.2, 0.2, 0.2, 0.1, 0.1]])
    q = np.array([[0.1, 0.1, 0.4, 0.2, 0.1, 0.1], [0.3, 0.1, 0.1, 0.1, 0.2, 0.2]])
    drafts = np.stack([rng.choice(V, size=S, p=q[j]) for j in range(2)], axis=1)
    out = jax.jit(rs.rejection_sample)(
        jnp.broadcast_to(jnp.asarray(p, jnp.float32), (S, 3, V)), jnp.asarray(drafts, jnp.int32),
        jnp.full((S,), 2, jnp.int32), jnp.asarray(rng.random((S, 2)), jnp.float32),
        jax.random.gumbel(jax.random.key(1), (S, V)),
        draft_probs=jnp.broadcast_to(jnp.asarray(q, jnp.float32), (S, 2, V)))
    toks, n = np.asarray(out.token_ids), np.asarray(out.num_emitted)
    assert _chi2_pvalue(toks[:, 0], p[0]) > 1e-3
    assert _chi2_pvalue(toks[n >= 2, 1], p[1]) > 1e-3
    assert _chi2_pvalue(toks[n >= 3, 2], p[2]) > 1e-3
    overlap = np.minimum(p[0], q[0]).sum()
    assert abs((n >= 2).mean() - overlap) < 0.01


def test_device_verify_samples_the_tempered_target_with_point_mass_drafts():
    """The step's verify function with n-gram (point-mass) drafts: the first emitted token of
    each row follows softmax(logits / temperature) whatever the draft, and top_k cuts too."""
    V, S = 8, 12000
    logits = np.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2], np.float32)
    for temperature, top_k in ((0.8, 0), (1.0, 3)):
        params = SamplingParams(temperature=temperature, top_k=top_k, seed=None)
        arrays = build_sampling_arrays([(params, [0], [0], None, 1)] * S, S, history_len=1,
                                       rng=np.random.default_rng(5))
        md = SamplingMetadata.from_dict(arrays)
        x = np.broadcast_to(logits, (S, 2, V))
        drafts = jnp.full((S, 1), 0, jnp.int32)  # always the most likely token
        out = jax.jit(rs.verify)(jnp.asarray(x), md, drafts, jnp.ones((S,), jnp.int32),
                        jnp.zeros((S,), jnp.int32))
        want = np.exp(logits / temperature)
        if top_k:
            want[np.argsort(-logits)[top_k:]] = 0
        want /= want.sum()
        first = np.asarray(out.token_ids)[:, 0]
        assert _chi2_pvalue(first, want) > 1e-3
        assert abs((np.asarray(out.num_emitted) == 2).mean() - want[0]) < 0.015


# ---- the engine ---------------------------------------------------------------------------
def _llm(model_dir, async_scheduling, spec, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("max_model_len", 128)
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("max_num_batched_tokens", 16)  # one token bucket: one compile per engine
    kw.setdefault("min_token_bucket", 16)
    kw.setdefault("num_gpu_blocks_override", 24)
    kw.setdefault("block_size", 8)
    return LLM(str(model_dir), async_scheduling=async_scheduling,
               speculative_config=SPEC if spec else None, **kw)


@pytest.fixture(scope="module")
def llama_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def engines(llama_dir):
    """(reference without speculation, speculating sync, speculating async). The pool (23
    usable pages of 8 tokens) holds a few requests, so a batch of 8 preempts."""
    return _llm(llama_dir, False, False), _llm(llama_dir, False, True), \
        _llm(llama_dir, True, True)


def _repeating_prompts(n, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        passage = [rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 10))]
        out.append(passage * 2 + passage[: rng.randint(1, 4)])
    return out


def _rows(outs):
    return [(c.token_ids, c.finish_reason, c.stop_reason) for o in outs for c in o.outputs]


def _generate_all(engines, prompts, params):
    ref, *spec = engines
    want = _rows(ref.generate(prompts, params, use_tqdm=False))
    got = []
    for llm in spec:
        eng = llm.llm_engine
        c0, d0, g0 = eng.runner.num_compiles, eng.spec_stats.num_drafts, eng.generation_tokens_total
        rows = _rows(llm.generate(prompts, params, use_tqdm=False))
        assert eng.runner.num_compiles == c0, "a verify step compiled after warm-up"
        assert eng.generation_tokens_total - g0 == sum(len(r[0]) for r in rows)
        got.append((rows, eng.spec_stats.num_drafts - d0))
        eng.block_manager.check_invariants()
        assert eng.block_manager.num_used_pages == 0  # nothing leaked
    return want, got


def test_greedy_identical_with_and_without_speculation(engines):
    prompts = _repeating_prompts(3, seed=1)
    want, got = _generate_all(engines, prompts,
                              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for rows, n_drafts in got:
        assert rows == want
        assert n_drafts > 0  # the verify path ran
    stats_ = engines[1].llm_engine.stats()
    # counters agree: every accepted draft is a generated token, never more than drafted
    assert 0 < stats_["spec_decode_num_accepted_tokens"] <= stats_["spec_decode_num_draft_tokens"]
    per_pos = stats_["spec_decode_num_accepted_tokens_per_pos"]
    assert sum(per_pos) == stats_["spec_decode_num_accepted_tokens"]
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))  # position j needs j-1 accepted


def test_greedy_identical_under_preemption_and_mixed_features(engines):
    """A batch of 8 over a pool for ~3: preemption (some mid-verify), next to rows that do not
    speculate (penalties, logprobs) and rows that hit max_model_len."""
    prompts = _repeating_prompts(8, seed=2)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True) for _ in prompts]
    params[1] = SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3,
                               ignore_eos=True)
    params[2] = SamplingParams(temperature=0, max_tokens=20, logprobs=2, ignore_eos=True)
    want, got = _generate_all(engines, prompts, params)
    for rows, n_drafts in got:
        assert rows == want
        assert n_drafts > 0
    for llm in engines[1:]:
        assert llm.llm_engine.scheduler.num_preemptions_total > 0


def test_a_request_can_opt_out_of_speculation(engines, monkeypatch):
    """disable_speculative_decoding: the request never gets a draft (the scheduler gives its
    rows none, no drafted token is counted) next to requests that do, and its greedy output
    is unchanged."""
    prompts = _repeating_prompts(3, seed=1)  # prompts the first test sees speculated on
    plain = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    opted = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                           disable_speculative_decoding=True)
    want = _rows(engines[0].generate(prompts, plain, use_tqdm=False))
    for llm in engines[1:]:
        eng = llm.llm_engine
        before = eng.spec_stats.as_dict()
        assert _rows(llm.generate(prompts, opted, use_tqdm=False)) == want
        assert eng.spec_stats.as_dict() == before  # not one draft
        # mixed: the rows of the request that opted out carry no drafts, the others' do
        drafts: dict[tuple, int] = {}
        schedule = eng.scheduler.schedule

        def counting_schedule(*args, **kwargs):
            out = schedule(*args, **kwargs)
            for s in out.scheduled:
                key = tuple(s.request.prompt_token_ids)
                drafts[key] = drafts.get(key, 0) + s.num_draft
            return out

        monkeypatch.setattr(eng.scheduler, "schedule", counting_schedule)
        rows = _rows(llm.generate(prompts, [opted, plain, plain], use_tqdm=False))
        monkeypatch.undo()
        assert rows == want
        assert drafts[tuple(prompts[0])] == 0
        assert drafts[tuple(prompts[1])] + drafts[tuple(prompts[2])] > 0
        assert eng.block_manager.num_used_pages == 0


def test_stops_and_max_tokens_inside_an_accepted_run(engines):
    """A stop token or max_tokens falling inside a run of accepted drafts ends the output
    exactly where plain decoding ends it; nothing past it is shown or counted."""
    prompts = _repeating_prompts(4, seed=3)
    ref = engines[0]
    free = _rows(ref.generate(prompts, SamplingParams(temperature=0, max_tokens=30,
                                                      ignore_eos=True), use_tqdm=False))
    stop_ids = [r[0][12] for r in free]  # a token each output produces mid-way
    for max_tokens in (7, 13):
        params = [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                 stop_token_ids=[s]) for s in stop_ids]
        want, got = _generate_all(engines, prompts, params)
        assert any(r[1] == "stop" for r in want) or max_tokens == 7
        for rows, _ in got:
            assert rows == want
            assert all(len(r[0]) <= max_tokens for r in rows)


def test_seeded_sampling_reproducible_with_speculation(engines):
    prompts = _repeating_prompts(3, seed=4)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=25, ignore_eos=True)
    spec_sync, spec_async = engines[1], engines[2]
    a = _rows(spec_sync.generate(prompts, params, use_tqdm=False))
    b = _rows(spec_sync.generate(prompts[::-1], params, use_tqdm=False))[::-1]
    c = _rows(spec_async.generate(prompts, params, use_tqdm=False))
    assert a == b == c
    assert len({tuple(r[0]) for r in a}) == len(a)


def test_abort_mid_speculation_frees_everything(engines):
    eng = engines[2].llm_engine
    eng.add_request("x", _repeating_prompts(1, seed=5)[0],
                    SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    (req,) = eng.scheduler.requests.values()
    for _ in range(60):
        eng.step()
        if req.spec_in_flight:
            break
    assert req.spec_in_flight, "no verify step was dispatched"
    eng.abort_request("x")
    assert not eng.has_unfinished_requests()
    eng.block_manager.check_invariants()
    assert eng.block_manager.num_used_pages == 0
    # the engine goes on serving exactly afterwards
    prompts = _repeating_prompts(2, seed=6)
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert _rows(engines[2].generate(prompts, p, use_tqdm=False)) == \
        _rows(engines[0].generate(prompts, p, use_tqdm=False))


def test_metrics_export_the_spec_decode_counters(engines):
    from jaxserve.entrypoints.openai.metrics import ServerMetrics

    llm = engines[1]
    llm.generate(_repeating_prompts(3, seed=1),  # outputs that repeat (see the first test)
                 SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    s = llm.llm_engine.stats()
    text = ServerMetrics(llm.llm_engine.stats, "m").render().decode()
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        want = (f'jaxserve:spec_decode_{name}_total{{engine="0",model_name="m"}} '
                f'{float(s["spec_decode_" + name])}')
        assert want in text
    for pos, n in enumerate(s["spec_decode_num_accepted_tokens_per_pos"]):
        assert (f'jaxserve:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",'
                f'model_name="m",position="{pos}"}} {float(n)}') in text
    assert s["spec_decode_num_drafts"] > 0
    # an engine without speculation exports none of them
    assert "spec_decode" not in ServerMetrics(engines[0].llm_engine.stats, "m").render().decode()


def test_cli_speculative_flags(capsys):
    from jaxserve.entrypoints.cli import build_parser, engine_config_from_args, main

    def config(*argv):
        return engine_config_from_args(build_parser().parse_args(["serve", "m", *argv]))

    c = config("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, '
                                       '"prompt_lookup_max": 3}').speculative
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == \
        ("ngram", 4, 3, 3)
    c = config("--speculative-model", "[ngram]", "--num-speculative-tokens", "2",
               "--ngram-prompt-lookup-max", "4", "--ngram-prompt-lookup-min", "1").speculative
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == \
        ("ngram", 2, 4, 1)
    assert config().speculative is None
    for bad in (["--speculative-config", "{nope"],
                ["--speculative-config", '{"method": "ngram"}'],
                ["--num-speculative-tokens", "2"]):
        with pytest.raises(ValueError, match="speculative_config"):
            config(*bad)
    assert main(["serve", "demo-random", "--speculative-config", '{"num_speculative_tokens": 0}']
                ) == 2
    err = capsys.readouterr().err
    assert "num_speculative_tokens" in err and "Traceback" not in err


@pytest.mark.slow
def test_greedy_identical_under_swap_preemption(llama_dir, engines):
    """Preemption by swap while a verify step is unread: the swapped pages hold only accepted
    tokens, the rest is recomputed on resume."""
    llm = _llm(llama_dir, True, True, preemption_mode="swap")
    prompts = _repeating_prompts(8, seed=8)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = _rows(engines[0].generate(prompts, params, use_tqdm=False))
    assert _rows(llm.generate(prompts, params, use_tqdm=False)) == want
    assert llm.llm_engine.scheduler.num_swap_outs_total > 0
    assert llm.llm_engine.spec_stats.num_accepted_tokens > 0


@pytest.mark.slow
@pytest.mark.parametrize("draft, async_scheduling", [("random", True), ("self", False)])
def test_draft_model_exact(tiny_model_factory, llama_dir, engines, draft, async_scheduling):
    """A random 1-layer draft (~0 acceptance) and the target as its own draft (every draft
    accepted unless the catch-up of the draft's K/V is wrong) give the plain greedy output,
    under preemption, with the draft's pages in the same pool."""
    draft_dir = tiny_model_factory("llama", layers=1, seed=7) if draft == "random" else llama_dir
    spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": K}
    kw = dict(dtype="float32", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=16,
              min_token_bucket=16, num_gpu_blocks_override=24, block_size=8)
    llm = LLM(str(llama_dir), async_scheduling=async_scheduling, speculative_config=spec, **kw)
    eng = llm.llm_engine
    c0 = eng.stats()["num_compiles"]
    rng = random.Random(9)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(5, 30))] for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = _rows(engines[0].generate(prompts, params, use_tqdm=False))
    assert _rows(llm.generate(prompts, params, use_tqdm=False)) == want
    assert eng.stats()["num_compiles"] == c0  # neither model compiles after warm-up
    st = eng.spec_stats
    assert st.num_drafts > 0
    if draft == "self":
        assert st.num_accepted_tokens >= 0.9 * st.num_draft_tokens
    else:
        assert eng.scheduler.num_preemptions_total > 0
    eng.block_manager.check_invariants()
    assert eng.block_manager.num_used_pages == 0
    # sampling stays seeded-reproducible with a model's drafts
    sp = SamplingParams(temperature=1.0, seed=5, max_tokens=20, ignore_eos=True)
    assert _rows(llm.generate(prompts[:3], sp, use_tqdm=False)) == \
        _rows(llm.generate(prompts[:3], sp, use_tqdm=False))


def test_draft_model_config_errors(llama_dir):
    with pytest.raises(ValueError, match="speculative_config.model"):
        SpeculativeConfig.from_dict({"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        SpeculativeConfig.from_dict({"method": "draft_model", "model": "x",
                                     "num_speculative_tokens": 2, "prompt_lookup_max": 2})


@pytest.mark.slow
def test_served_with_speculative_config(tmp_path, llama_dir, engines):
    """`jaxserve serve --speculative-config`: the engine core process speculates, the completion
    equals the offline greedy one, and /metrics shows the drafts; a request with
    disable_speculative_decoding gets none; the periodic log's spec-decode lines add up to
    the counters."""
    import re
    import time
    import os
    import subprocess
    import sys
    import httpx
    from server_process import free_port, stop, wait_healthy

    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    env.pop("JAXSERVE_API_KEY", None)
    env["JAXSERVE_LOG_STATS_INTERVAL"] = "0.5"
    port = free_port()
    log = tmp_path / "log.txt"
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", str(llama_dir), "--port",
         str(port), "--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "8",
         "--max-num-batched-tokens", "16", "--min-token-bucket", "16",
         "--num-gpu-blocks-override", "24", "--block-size", "8", "--uvicorn-log-level",
         "warning", "--speculative-config", json.dumps(SPEC)],
        stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(port, [proc], [log], timeout=300)
        prompt = _repeating_prompts(3, seed=1)[0]
        want = engines[0].generate([prompt], SamplingParams(temperature=0, max_tokens=30,
                                                            ignore_eos=True), use_tqdm=False)

        def counter(name):
            metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
            [v] = [float(ln.split()[-1]) for ln in metrics.splitlines()
                   if ln.startswith(f"jaxserve:spec_decode_{name}_total")]
            return v

        body = {"prompt": prompt, "max_tokens": 30, "temperature": 0, "ignore_eos": True}
        for opt_out in (True, False):
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                           json={**body, "disable_speculative_decoding": opt_out})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want[0].outputs[0].text
            time.sleep(0.3)  # the core process's stats ride along within 0.05 s
            assert (counter("num_drafts") == 0) == opt_out
        time.sleep(1.5)  # the last interval's log line
        totals = {k: counter(k) for k in ("num_draft_tokens", "num_accepted_tokens")}
        lines = re.findall(r"SpecDecoding metrics: Mean acceptance length: ([0-9.]+), .*"
                           r"Accepted: (\d+) tokens, Drafted: (\d+) tokens, Per-position "
                           r"acceptance rate: ([0-9., ]+), Avg", log.read_text())
        assert lines, log.read_text()[-3000:]
        assert sum(int(a) for _, a, _, _ in lines) == totals["num_accepted_tokens"]
        assert sum(int(d) for _, _, d, _ in lines) == totals["num_draft_tokens"]
        for mean, _, _, rates in lines:  # mean length = 1 + sum of per-position rates
            per_pos = [float(x) for x in rates.split(", ")]
            assert float(mean) == pytest.approx(1 + sum(per_pos), abs=0.02)
    finally:
        stop(proc, timeout=60)


@pytest.mark.slow
def test_latency_benchmark_speculative_mode(tmp_path, llama_dir):
    from benchmarks import latency

    out = latency.main(["--model", str(llama_dir), "--speculative-config", json.dumps(SPEC),
                        "--batch-sizes", "1,2", "--output-len", "12", "--num-iters", "1",
                        "--num-iters-warmup", "0", "--spec-prompt", "random", "--input-len",
                        "20", "--max-num-batched-tokens", "16", "--min-token-bucket", "16",
                        "--max-model-len", "64", "--dtype", "float32", "--result-dir",
                        str(tmp_path), "--disable-tqdm"])
    (f,) = tmp_path.glob("latency-spec-*.json")
    saved = json.loads(f.read_text())
    assert [r["batch_size"] for r in saved["results"]] == [1, 2]
    for r in saved["results"]:
        assert r["outputs_identical"] is True
        assert r["speedup"] == pytest.approx(r["base_latency_s"] / r["spec_latency_s"])
        assert r["num_accepted_tokens"] <= r["num_draft_tokens"]
    assert saved["compiles_after_warmup"] == {"base": 0, "spec": 0}
    assert out["speculative_config"] == SPEC and (tmp_path / Path(out["plot"]).name).exists()
