"""Qwen 3.5 / 3.6 (hybrid Gated DeltaNet + gated attention) against HF transformers.

Tiny random checkpoints of ``qwen3_5`` and ``qwen3_5_moe`` in both class layouts (text-only
``*ForCausalLM``; vision-language ``*ForConditionalGeneration``, whose ``model.language_model.*``
is loaded, its vision tower tested in test_qwen3_5_vision.py): logits of a prompt (one step,
and two steps with the recurrent state carried between them) within float32 tolerance of HF's, and greedy tokens of
the engine equal to HF ``generate`` on prompts longer than ``max_num_batched_tokens``, with
preemption under a tiny page pool, and at tp 2.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
ATOL = 2e-4
NEW_TOKENS = 10
def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(5, 500, n).tolist() for n in lengths]


def _hf(path: Path):
    import transformers as tf

    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    return getattr(tf, arch).from_pretrained(path, dtype=torch.float32).eval()


def _hf_greedy(path: Path, prompts, n: int):
    hf = _hf(path)
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
            out.append(ids[0, len(p):].tolist())
    return out


def _forward_steps(path: Path, prompt, cuts):
    """Our model's logits of every prompt position, the prompt run in steps ending at
    ``cuts`` (one row, its pages and its state slot carried between the steps)."""
    import jax.numpy as jnp

    from jaxserve.core.kv_cache_spec import group_layers
    from jaxserve.loaders.model_loader import load_model
    from jaxserve.models.layers import AttentionMetadata
    from jaxserve.worker.kv_cache import allocate_hybrid_caches

    model, cfg, _ = load_model(str(path), dtype="float32")
    block, slot = 8, 1
    n_pages = len(prompt) // block + 2
    groups = group_layers(model.cache_specs("float32"))
    caches = allocate_hybrid_caches(cfg, groups, n_pages, 2, block, jnp.float32)
    table = jnp.arange(1, n_pages, dtype=jnp.int32)[None, :]
    logits, start = [], 0
    for end in cuts:
        pos = np.arange(start, end, dtype=np.int32)
        md = AttentionMetadata(
            slot_mapping=jnp.asarray(table[0, pos // block] * block + pos % block),
            query_start=jnp.asarray([0, end - start], jnp.int32),
            seq_lens=jnp.asarray([end], jnp.int32), block_tables=table,
            num_seqs=jnp.int32(1), state_slots=jnp.asarray([slot], jnp.int32))
        hidden, caches = model(jnp.asarray(prompt[start:end], jnp.int32), jnp.asarray(pos),
                               caches, md)
        logits.append(np.asarray(model.compute_logits(hidden)))
        start = end
    return np.concatenate(logits)


@pytest.mark.parametrize("variant", ["dense", "moe-vl",
                                     pytest.param("dense-vl", marks=pytest.mark.slow),
                                     pytest.param("moe", marks=pytest.mark.slow)])
def test_logits_match_hf_in_one_step_and_with_the_state_carried(qwen35, variant):
    path = qwen35(variant)
    prompt, = _prompts([100])
    with torch.no_grad():
        ref = _hf(path)(torch.tensor([prompt])).logits[0].numpy()
    np.testing.assert_allclose(_forward_steps(path, prompt, [100]), ref, atol=ATOL, rtol=0)
    # a chunk of 70 (one full WY chunk and a ragged one), a decode, then the rest
    np.testing.assert_allclose(_forward_steps(path, prompt, [70, 71, 100]), ref, atol=ATOL,
                               rtol=0)


def _engine(path: Path, **kw):
    from jaxserve.entrypoints.llm import LLM

    args = dict(dtype="float32", max_num_batched_tokens=32, min_token_bucket=32,
                max_num_seqs=4, max_model_len=256, enforce_eager=True)
    args.update(kw)
    return LLM(str(path), **args)


def _greedy(llm, prompts, n=NEW_TOKENS):
    from jaxserve.core.sampling_params import SamplingParams

    res = llm.generate([{"prompt_token_ids": p} for p in prompts],
                       SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                       use_tqdm=False)
    return [list(r.outputs[0].token_ids) for r in res]


def _assert_pools_free(llm):
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.state_slots.num_free == bm.state_slots.num_slots
    assert bm.num_used_pages == 0
    bm.check_invariants()


@pytest.mark.parametrize("variant", ["dense", pytest.param("moe-vl", marks=pytest.mark.slow)])
def test_greedy_equals_hf_generate_with_chunked_prefill_and_preemption(qwen35, variant):
    """Prompts of 70-90 tokens through a 32-token budget (the state crosses 3 chunks), a pool
    of 20 pages of 8 tokens for 4 such requests (they preempt each other and recompute)."""
    path = qwen35(variant)
    prompts = _prompts([90, 70, 81, 75], seed=1)
    ref = _hf_greedy(path, prompts, NEW_TOKENS)
    llm = _engine(path, block_size=8, num_gpu_blocks_override=20)
    runner = llm.llm_engine.runner
    assert runner.num_state_slots == 4 and runner.state_layers == (0, 1, 2)
    assert not llm.llm_engine.scheduler.block_manager.enable_prefix_caching
    assert _greedy(llm, prompts) == ref
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    _assert_pools_free(llm)


def test_swap_preemption_moves_the_state_with_the_pages(qwen35):
    """``--preemption-mode swap``: a preempted request's pages and its recurrent state go to
    host memory and come back into a fresh slot (usually another one); greedy still equals
    HF, and nothing is left held."""
    path = qwen35("dense")
    prompts = _prompts([90, 70, 81, 75], seed=1)
    ref = _hf_greedy(path, prompts, NEW_TOKENS)
    llm = _engine(path, block_size=8, num_gpu_blocks_override=20, preemption_mode="swap")
    eng = llm.llm_engine
    assert _greedy(llm, prompts) == ref
    assert eng.scheduler.num_swap_outs_total > 0
    assert not eng._swapped and not eng._swapped_state
    _assert_pools_free(llm)


def test_state_pool_is_all_free_after_aborts_stops_and_preemption(qwen35):
    """A mixed workload on a tiny pool: requests aborted mid-prefill and mid-decode, stopped by
    a stop token, and preempted; afterwards every state slot and page is free, and a request
    that reuses a freed slot still equals HF."""
    from jaxserve.core.sampling_params import SamplingParams

    path = qwen35("dense")
    llm = _engine(path, block_size=8, num_gpu_blocks_override=20)
    eng = llm.llm_engine
    prompts = _prompts([60, 40, 75, 30, 50, 66], seed=2)
    for i, p in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                stop_token_ids=list(range(5, 500, 8)) if i == 3
                                else None)
        eng.add_request(f"r{i}", p, params)
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
        bm = eng.scheduler.block_manager
        bm.check_invariants(list(eng.scheduler.requests.values()))
        if steps == 2:
            eng.abort_request(["r0"])  # mid-prefill
        if steps == 12:
            eng.abort_request(["r2"])
    assert eng.scheduler.num_preemptions_total > 0
    _assert_pools_free(llm)
    # n > 1: the siblings fork from the first child's prompt, each into its own slot
    prompt = _prompts([45], seed=3)
    res = llm.generate([{"prompt_token_ids": prompt[0]}],
                       SamplingParams(n=2, temperature=0.0, max_tokens=NEW_TOKENS,
                                      ignore_eos=True), use_tqdm=False)
    ref = _hf_greedy(path, prompt, NEW_TOKENS)[0]
    assert [list(c.token_ids) for c in res[0].outputs] == [ref, ref]
    _assert_pools_free(llm)


def test_n_siblings_fork_the_first_childs_pages_and_state(qwen35):
    """n > 1 without a prefix cache: the first child computes the prompt but its last token,
    the siblings copy its pages and state slot there and compute that token themselves. Their
    tokens equal the recompute path's (greedy and seeded), and every slot and page is free
    afterwards."""
    from jaxserve.core.sampling_params import SamplingParams

    path = qwen35("dense")
    prompt = _prompts([45], seed=3)[0]  # two chunks of the 32-token budget
    runs = {}
    for fork in (True, False):
        llm = _engine(path, block_size=8)
        eng = llm.llm_engine
        assert eng.scheduler.siblings.fork_prompts
        eng.scheduler.siblings.fork_prompts = fork
        got = []
        for params in (SamplingParams(n=3, temperature=0.0, max_tokens=NEW_TOKENS,
                                      ignore_eos=True),
                       SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=NEW_TOKENS,
                                      ignore_eos=True)):
            eng.add_request("r", prompt, params)
            kids = sorted(eng.scheduler.requests.values(), key=lambda r: r.request_id)
            outs = []
            while eng.has_unfinished_requests():
                outs += eng.step()
            got.append([list(c.token_ids) for c in outs[-1].outputs])
            # the siblings reused the first 44 prompt tokens, or recomputed them
            assert [k.num_cached_tokens for k in kids] == ([0, 44, 44] if fork else [0, 0, 0])
            _assert_pools_free(llm)
        runs[fork] = got
    ref = _hf_greedy(path, [prompt], NEW_TOKENS)[0]
    assert runs[True][0] == [ref] * 3
    assert runs[True] == runs[False]
    assert len({tuple(t) for t in runs[True][1]}) > 1  # seeded choices differ from each other


@pytest.mark.slow  # fp8 quantization of every projection at start-up
def test_fp8_weights_and_fp8_kv_cache_keep_the_state_float32(qwen35):
    """``--quantization fp8 --kv-cache-dtype fp8``: float8 pages for the attention layers, the
    GDN state pool stays float32; greedy decoding runs and frees everything."""
    import jax.numpy as jnp

    llm = _engine(qwen35("dense"), quantization="fp8", kv_cache_dtype="fp8")
    runner = llm.llm_engine.runner
    k_pages, _ = runner.kv_pages[3]
    conv, rec = runner.kv_pages[0]
    assert k_pages.dtype == jnp.float8_e4m3fn
    assert conv.dtype == rec.dtype == jnp.float32 and rec.shape == (4 + 1, 4, 16, 16)
    out = _greedy(llm, _prompts([50], seed=5))
    assert len(out[0]) == NEW_TOKENS
    _assert_pools_free(llm)


@pytest.mark.slow  # a calibration pass, then fp8 serving
def test_calculate_kv_scales_calibrates_the_attention_layers(qwen35):
    """``--calculate-kv-scales``: one calibration pass over pages and a one-slot state pool;
    the attention layers get their measured scales, the GDN layers an unused 1.0, and greedy
    decoding with the scaled fp8 pages stays on HF's first tokens."""
    from jaxserve.models.kv_scales import get_kv_scales

    path = qwen35("dense")
    llm = _engine(path, kv_cache_dtype="fp8", calculate_kv_scales=True)
    scales = get_kv_scales(llm.llm_engine.model)
    assert scales.shape == (4, 2, 2)
    assert np.all(scales[:3] == 1.0) and np.all(scales[3] != 1.0)
    prompt = _prompts([60], seed=6)
    assert _greedy(llm, prompt, n=4) == _hf_greedy(path, prompt, 4)
    _assert_pools_free(llm)


def test_what_the_state_pool_cannot_do_is_a_start_up_error_naming_the_flag():
    from jaxserve.config import engine_config_from_kwargs
    from jaxserve.core.kv_cache_spec import FullAttention, LinearState
    from jaxserve.engine.builder import check_state_pool_support
    from jaxserve.errors import InvalidRequestError

    check_state_pool_support(engine_config_from_kwargs("m", preemption_mode="swap"))
    # every method verifies with the state rolled back (tests/models/test_qwen3_5_mtp.py)
    for spec in ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
                 {"method": "mtp", "num_speculative_tokens": 2},
                 {"method": "draft_model", "model": "d", "num_speculative_tokens": 2}):
        check_state_pool_support(engine_config_from_kwargs("m", speculative_config=spec))
    check_state_pool_support(engine_config_from_kwargs("m"))

    class StateDraft:  # a draft model with Gated DeltaNet layers of its own
        def cache_specs(self, dtype):
            return [FullAttention(2, 16, dtype), LinearState(((4, 8),), dtype)]

    spec = {"method": "draft_model", "model": "d", "num_speculative_tokens": 2}
    with pytest.raises(InvalidRequestError, match="draft model with LinearState") as e:
        check_state_pool_support(engine_config_from_kwargs("m", speculative_config=spec),
                                 StateDraft())
    assert e.value.param == "speculative_config"


def test_tensor_parallel_must_divide_the_gdn_heads():
    from types import SimpleNamespace

    from jaxserve.errors import InvalidRequestError
    from jaxserve.sharding import check_model

    cfg = SimpleNamespace(num_heads=8, num_kv_heads=4,
                          hf={"linear_num_key_heads": 2, "linear_num_value_heads": 6})
    check_model(cfg, 2)
    with pytest.raises(InvalidRequestError, match="linear_num_key_heads=2") as e:
        check_model(cfg, 4)
    assert e.value.param == "tensor_parallel_size"


def _tp2_child(path: str, prompts) -> list:
    llm = _engine(Path(path), tensor_parallel_size=2)
    q = llm.llm_engine.model.model.layers[3].self_attn.q_proj.weight.get_value()
    assert q.addressable_shards[0].data.shape[0] == q.shape[0] // 2  # heads split
    gdn = llm.llm_engine.model.model.layers[0].linear_attn
    for w in (gdn.in_proj_q.weight, gdn.in_proj_v.weight, gdn.conv1d_k.weight, gdn.A_log):
        w = w.get_value()
        assert w.addressable_shards[0].data.shape[0] == w.shape[0] // 2  # GDN heads split
    runner = llm.llm_engine.runner
    for arr in runner.kv_pages[0]:  # layer 0's conv and delta-rule state pools
        assert arr.addressable_shards[0].data.shape[1] == arr.shape[1] // 2
    got = _greedy(llm, prompts)
    for arr in runner.kv_pages[0]:  # still split after the steps: the step's output keeps it
        assert arr.addressable_shards[0].data.shape[1] == arr.shape[1] // 2
    # n > 1 forks: the split pages and state slot are copied shard by shard
    from jaxserve.core.sampling_params import SamplingParams

    forked = llm.generate([{"prompt_token_ids": prompts[0]}],
                          SamplingParams(n=2, temperature=0.0, max_tokens=NEW_TOKENS,
                                         ignore_eos=True), use_tqdm=False)[0]
    forked = [list(c.token_ids) for c in forked.outputs]
    _assert_pools_free(llm)
    # swap preemption moves the split state out and back into the split pool
    llm = _engine(Path(path), tensor_parallel_size=2, block_size=8, num_gpu_blocks_override=20,
                  preemption_mode="swap")
    swapped = _greedy(llm, prompts + prompts)
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    _assert_pools_free(llm)
    return [got, swapped, forked]


@pytest.mark.slow  # a child process with 2 CPU devices
@pytest.mark.parametrize("variant", ["dense", "moe-vl"])
def test_tp2_equals_hf(qwen35, variant):
    path = qwen35(variant)
    prompts = _prompts([90, 70], seed=4)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__, json.dumps([str(path), prompts])],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got, swapped, forked = json.loads(proc.stdout.strip().splitlines()[-1])
    ref = _hf_greedy(path, prompts, NEW_TOKENS)
    assert got == ref and swapped == ref + ref and forked == [ref[0], ref[0]]


if __name__ == "__main__":
    print(json.dumps(_tp2_child(*json.loads(sys.argv[1]))))
