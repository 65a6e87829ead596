"""Probes of the Qwen 3.5 recurrent-state pool under faults (issue #49): n = 3 requests aborted
mid-stream beside others, preemption with a pool too small for the batch, and a long mixed
workload with aborts, stops and n > 1. At temperature 0 every request that finishes equals
the same prompt run alone on the same engine, and once idle every state slot and page is free
(a leaked or shared slot would change a neighbour's tokens or leave the pool short).
"""
from __future__ import annotations

import numpy as np
import pytest

NEW = 8


def _engine(path, **kw):
    from jaxserve.entrypoints.llm import LLM

    args = dict(dtype="float32", max_num_batched_tokens=32, min_token_bucket=32,
                max_num_seqs=4, max_model_len=256, enforce_eager=True, block_size=8)
    args.update(kw)
    return LLM(str(path), **args)


def _params(n=1, max_tokens=NEW, **kw):
    from jaxserve.core.sampling_params import SamplingParams

    return SamplingParams(n=n, temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _prompts(lengths, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(5, 500, n).tolist() for n in lengths]


def _assert_idle_and_free(eng):
    assert not eng.has_unfinished_requests()
    bm = eng.scheduler.block_manager
    assert bm.state_slots.num_free == bm.state_slots.num_slots
    assert bm.num_used_pages == 0
    bm.check_invariants()
    assert not eng._swapped and not eng._swapped_state


def _alone(llm, prompt, max_tokens=NEW) -> list[int]:
    res = llm.generate([{"prompt_token_ids": prompt}], _params(max_tokens=max_tokens),
                       use_tqdm=False)
    return list(res[0].outputs[0].token_ids)


def _run(eng, aborts: dict[int, list[str]] | None = None, check=True) -> dict:
    """Step until idle, aborting ``aborts[step]`` at those steps; -> request id -> the token
    ids of each finished sequence (by index)."""
    done: dict[str, list[list[int]]] = {}
    step = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = [list(c.token_ids) for c in
                                        sorted(out.outputs, key=lambda c: c.index)]
        step += 1
        if check:
            eng.scheduler.block_manager.check_invariants(list(eng.scheduler.requests.values()))
        for rid in (aborts or {}).get(step, []):
            eng.abort_request([rid])
    return done


def test_n3_aborted_mid_stream_beside_others(qwen35):
    llm = _engine(qwen35("dense"), max_num_seqs=6)
    eng = llm.llm_engine
    prompts = _prompts([40, 23, 37], seed=11)
    alone = [_alone(llm, p) for p in prompts]
    eng.add_request("gone", prompts[0], _params(n=3, max_tokens=40))
    eng.add_request("kept", prompts[1], _params(n=3))
    eng.add_request("one", prompts[2], _params())
    done = _run(eng, aborts={4: ["gone"]})  # mid-stream: its children are decoding
    assert "gone" not in done
    assert done["kept"] == [alone[1]] * 3
    assert done["one"] == [alone[2]]
    _assert_idle_and_free(eng)
    assert _alone(llm, prompts[0]) == alone[0]  # the freed slots serve a new request rightly


def test_preemption_with_a_tiny_pool_keeps_every_state(qwen35):
    llm = _engine(qwen35("dense"), num_gpu_blocks_override=14)
    eng = llm.llm_engine
    prompts = _prompts([50, 41, 33, 47], seed=12)
    alone = [_alone(llm, p) for p in prompts]
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, _params(n=3 if i % 2 == 0 else 1))
    done = _run(eng, aborts={9: ["r3"]})
    assert eng.scheduler.num_preemptions_total > 0
    for i in range(3):
        assert done[f"r{i}"] == [alone[i]] * (3 if i % 2 == 0 else 1), i
    _assert_idle_and_free(eng)


@pytest.mark.slow  # 200 requests through the CPU engine
def test_200_mixed_requests_with_aborts_and_stops(qwen35):
    llm = _engine(qwen35("dense"), num_gpu_blocks_override=24)
    eng = llm.llm_engine
    rng = np.random.default_rng(13)
    prompts = _prompts(rng.integers(3, 60, size=10).tolist(), seed=14)
    alone = [_alone(llm, p, 12) for p in prompts]
    _assert_idle_and_free(eng)
    aborts: dict[int, list[str]] = {}
    want: dict[str, tuple[int, int, int]] = {}  # rid -> (prompt, n, max_tokens)
    for i in range(200):
        k = int(rng.integers(len(prompts)))
        n = int(rng.choice([1, 1, 2, 3]))
        m = int(rng.integers(1, 13))
        rid = f"q{i}"
        eng.add_request(rid, prompts[k], _params(n=n, max_tokens=m))
        if rng.random() < 0.15:
            aborts.setdefault(int(rng.integers(1, 300)), []).append(rid)
        else:
            want[rid] = (k, n, m)
    done = _run(eng, aborts, check=False)
    assert eng.scheduler.num_preemptions_total > 0
    for rid, (k, n, m) in want.items():
        assert done[rid] == [alone[k][:m]] * n, rid
    _assert_idle_and_free(eng)
