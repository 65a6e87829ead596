"""Every cache kind in one model (jaxserve.testing.tiny_hybrid: Gated DeltaNet state slots,
a sliding-window pool and a full-attention pool): the engine's greedy tokens equal a dense
reference forward recomputed for every token, with chunked prefill, recompute and swap
preemption under a small pool, prefix caching asked for, and at tp 2."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxserve.testing import tiny_hybrid

ROOT = Path(__file__).resolve().parents[2]
NEW = 10
WINDOW, BLOCK = 16, 8


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return tiny_hybrid.make_tiny_hybrid(tmp_path_factory.mktemp("tiny_hybrid"), window=WINDOW)


def _prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(5, 500, n).tolist() for n in (45, 30, 52)]


def _engine(path, **kw):
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.models.registry import register_model

    register_model(tiny_hybrid.ARCHITECTURE, tiny_hybrid.TinyHybridForCausalLM)
    args = dict(dtype="float32", block_size=BLOCK, max_num_batched_tokens=32,
                min_token_bucket=8, max_num_seqs=3, max_model_len=128, enforce_eager=True,
                enable_prefix_caching=True)
    args.update(kw)
    return LLM(str(path), **args)


def _greedy(llm, prompts):
    from jaxserve.core.sampling_params import SamplingParams

    res = llm.generate([{"prompt_token_ids": p} for p in prompts],
                       SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True),
                       use_tqdm=False)
    return [list(r.outputs[0].token_ids) for r in res]


@pytest.fixture(scope="module")
def reference(hybrid_dir):
    """The dense reference's greedy tokens (the engine's own weights, no pages)."""
    llm = _engine(hybrid_dir)
    model = llm.llm_engine.model
    return [tiny_hybrid.reference_greedy(model, p, NEW) for p in _prompts()]


def _check_pools(llm):
    eng = llm.llm_engine
    c = eng.runner.kv_config
    assert [p.name for p in c.pools] == [f"sliding_{WINDOW}", "full"]
    assert c.num_state_slots is not None and c.pool_of_layer[0] is None  # GDN: a slot
    bm = eng.scheduler.block_manager
    assert [m.sliding_window for m in bm.managers] == [WINDOW, None]
    return bm


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_equals_the_dense_reference_under_preemption(hybrid_dir, reference, mode):
    """Three requests of 4-8 pages in pools of 12: chunked prefills (32-token budget),
    requests preempted and resumed; prefix caching is asked for and turned off (a cached
    attention prefix does not restore the recurrent state)."""
    llm = _engine(hybrid_dir, num_gpu_blocks_override=12, preemption_mode=mode)
    bm = _check_pools(llm)
    assert not bm.enable_prefix_caching
    sched = llm.llm_engine.scheduler
    peak, schedule = [], sched.schedule

    def counting_schedule(*a, **k):
        out = schedule(*a, **k)
        peak.append(bm.group_used_pages())
        return out
    sched.schedule = counting_schedule
    assert _greedy(llm, _prompts()) == reference
    assert sched.num_preemptions_total > 0
    if mode == "swap":
        assert sched.num_swap_outs_total > 0
    # the sliding pool keeps each running request's window (and a chunk), the full pool all
    assert max(s for s, _ in peak) <= 3 * (WINDOW // BLOCK + 1 + 32 // BLOCK)
    if mode == "recompute":  # n > 1: with several pools each child computes its own prompt
        from jaxserve.core.sampling_params import SamplingParams

        res = llm.generate([{"prompt_token_ids": _prompts()[0]}],
                           SamplingParams(n=2, temperature=0.0, max_tokens=NEW,
                                          ignore_eos=True), use_tqdm=False)[0]
        assert [list(c.token_ids) for c in res.outputs] == [reference[0]] * 2
    assert bm.group_used_pages() == [0, 0]
    assert bm.state_slots.num_free == bm.state_slots.num_slots
    bm.check_invariants()


def _tp2_child(path: str) -> list:
    llm = _engine(Path(path), tensor_parallel_size=2, num_gpu_blocks_override=12,
                  preemption_mode="swap")
    _check_pools(llm)
    return _greedy(llm, _prompts())


@pytest.mark.slow  # a child process with 2 CPU devices
def test_tp2_equals_the_dense_reference(hybrid_dir, reference):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__, json.dumps(str(hybrid_dir))], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == reference


if __name__ == "__main__":
    print(json.dumps(_tp2_child(json.loads(sys.argv[1]))))
