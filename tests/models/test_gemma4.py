"""Gemma 4 (dense, MoE, and the vision-language checkpoint's text stack) against HF transformers
on tiny random checkpoints: global layers with another head_dim and KV-head count than the
sliding ones, k_eq_v, KV shared by the last two layers, per-layer embeddings, soft-capping.

The paged forward of a prompt longer than the sliding window (logits close to HF's forward),
chunked prefill through scattered pages, and greedy tokens equal to HF ``generate``.
"""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers.models.gemma4")

BLOCK = 8
NUM_PAGES = 48
MAX_PAGES = 10
PROMPT_LEN = 40  # > the sliding window (16)
NEW_TOKENS = 12
ATOL = 1e-4


@pytest.fixture(scope="session")
def gemma4_dirs(tmp_path_factory):
    """kind -> a tiny Gemma 4 checkpoint directory (built once per session)."""
    from jaxserve.testing.tiny_gemma4 import make_tiny_gemma4

    root = tmp_path_factory.mktemp("gemma4")
    cache: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in cache:
            cache[kind] = make_tiny_gemma4(root / kind, moe=kind == "moe",
                                           conditional=kind == "conditional")
        return cache[kind]

    return get


def hf_model(path):
    from transformers import AutoConfig, Gemma4ForCausalLM, Gemma4ForConditionalGeneration

    arch = AutoConfig.from_pretrained(str(path)).architectures[0]
    cls = Gemma4ForConditionalGeneration if "Conditional" in arch else Gemma4ForCausalLM
    return cls.from_pretrained(str(path), dtype=torch.float32,
                               attn_implementation="eager").eval()


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(input_ids=torch.tensor(np.asarray(ids))[None].long()).logits[0].numpy()


def hf_greedy(hf, prompt, n_new):
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(torch.tensor(np.asarray(prompt))[None].long(), max_new_tokens=n_new,
                          do_sample=False, attention_mask=torch.ones(1, len(prompt),
                                                                     dtype=torch.long))
    return out[0, len(prompt):].tolist()


class Driver:
    """A per-layer page pool (each layer at its own shape, shared layers none), scattered
    pages, one step plan per call."""

    def __init__(self, path, *, mesh=None, seed=0, **load_kw):
        import jax.numpy as jnp
        from flax import nnx

        from jaxserve import sharding
        from jaxserve.loaders.model_loader import load_model
        from jaxserve.worker.kv_cache import allocate_layer_pages

        self.model, self.cfg, _ = load_model(str(path), dtype="float32", mesh=mesh, **load_kw)
        self.graphdef, self.state = nnx.split(self.model)
        pool_sharding = sharding.kv_pool_sharding(mesh) if mesh is not None else None
        self.kv = allocate_layer_pages(self.model.cache_specs("float32"), NUM_PAGES, BLOCK,
                                       jnp.float32, sharding=pool_sharding,
                                       tp=sharding.tp_size(mesh))
        self.free = list(np.random.default_rng(seed).permutation(np.arange(1, NUM_PAGES)))
        self.pages: dict[int, list[int]] = {}

    def run(self, rows):
        import jax.numpy as jnp

        from jaxserve.core.step_plan import token_ladder
        from jaxserve.testing.paged import metadata, step_inputs

        sched = []
        for sid, ids, start in rows:
            pages = self.pages.setdefault(sid, [])
            while len(pages) * BLOCK < start + len(ids):
                pages.append(int(self.free.pop()))
            sched.append((ids, start, pages))
        plan = step_inputs(sched, block_size=BLOCK, max_pages=MAX_PAGES,
                           ladder=token_ladder(64, min_bucket=8), max_num_seqs=4)
        md = metadata(plan)
        logits, self.kv = _step(self.graphdef, self.state, jnp.asarray(plan.token_ids),
                                jnp.asarray(plan.positions), self.kv, md)
        logits = np.asarray(logits)
        qs = plan.query_start
        return [logits[qs[i]:qs[i + 1]] for i in range(len(rows))]

    def prefill_then_greedy(self, prompt, n_new):
        (lg,) = self.run([(0, prompt, 0)])
        out = [int(lg[-1].argmax())]
        while len(out) < n_new:
            (step,) = self.run([(0, np.array(out[-1:], np.int32), len(prompt) + len(out) - 1)])
            out.append(int(step[-1].argmax()))
        return lg, out


@functools.lru_cache(maxsize=None)
def _jit_step():
    import jax
    from flax import nnx

    @functools.partial(jax.jit, static_argnums=0)
    def step(graphdef, state, token_ids, positions, kv, md):
        model = nnx.merge(graphdef, state)
        hidden, kv = model(token_ids, positions, kv, md)
        return model.compute_logits(hidden), kv

    return step


def _step(*args):
    return _jit_step()(*args)


@pytest.fixture(scope="module")
def refs(gemma4_dirs):
    """kind -> (path, prompt, HF prompt logits, HF greedy tokens)."""
    from jaxserve.testing.tiny_gemma4 import prompt as make_prompt

    out = {}
    for kind in ("dense", "moe", "conditional"):
        path = gemma4_dirs(kind)
        hf = hf_model(path)
        prompt = make_prompt(PROMPT_LEN, seed=1)
        out[kind] = (path, prompt, hf_logits(hf, prompt), hf_greedy(hf, prompt, NEW_TOKENS))
    return out


def test_layer_shapes_and_cache_specs(gemma4_dirs):
    from jaxserve.core.kv_cache_spec import FullAttention, SharedKV, SlidingWindow
    from jaxserve.loaders.model_loader import load_model

    model, cfg, _ = load_model(str(gemma4_dirs("dense")), dtype="float32")
    specs = model.cache_specs("float32")
    local, glob = SlidingWindow(16, 2, 16, "float32"), FullAttention(1, 32, "float32")
    assert specs == [local, local, glob, local, SharedKV(3), SharedKV(2)]
    attn = model.model.layers[2].self_attn
    assert attn.v_proj is None and attn.k_proj.weight.shape == (32, 64)  # k_eq_v, 1 head of 32
    assert model.model.layers[5].self_attn.k_proj is None  # shares layer 2's KV
    # the transformers 4.x spelling (global_head_dim / num_global_key_value_heads)
    from jaxserve.models.gemma4 import layer_shapes

    hf = {k: v for k, v in cfg.hf.items() if k != "per_layer_config"}
    old = layer_shapes({**hf, "global_head_dim": 32, "num_global_key_value_heads": 1})
    assert [(s.head_dim, s.kv_heads, s.producer) for s in old] == [
        (16, 2, None), (16, 2, None), (32, 1, None), (16, 2, None), (16, 2, 3), (32, 1, 2)]


def test_unsupported_settings_are_clear_errors(gemma4_dirs):
    import json

    from flax import nnx

    from jaxserve.config import ModelConfig
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.models.gemma4 import Gemma4ForCausalLM, layer_shapes

    with pytest.raises(ValueError, match="calculate_kv_scales"):
        LLM(str(gemma4_dirs("dense")), dtype="float32", kv_cache_dtype="fp8",
            calculate_kv_scales=True, max_model_len=64, enforce_eager=True)
    hf = json.loads((gemma4_dirs("dense") / "config.json").read_text())
    bidirectional = ModelConfig.from_hf_config({**hf, "use_bidirectional_attention": "all"})
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        Gemma4ForCausalLM(bidirectional, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="num_kv_shared_layers"):
        layer_shapes({**hf, "num_kv_shared_layers": 6})


@pytest.mark.parametrize("kind", ["dense", "moe", "conditional"])
def test_forward_and_greedy_match_hf(refs, kind):
    path, prompt, ref_logits, ref_tokens = refs[kind]
    drv = Driver(path, seed=2)
    logits, tokens = drv.prefill_then_greedy(prompt, NEW_TOKENS)
    np.testing.assert_allclose(logits, ref_logits, atol=ATOL, rtol=0)
    assert tokens == ref_tokens


@pytest.mark.parametrize("kind", ["dense", pytest.param("moe", marks=pytest.mark.slow)])
def test_chunked_prefill_and_ragged_batch_match_hf(refs, kind):
    """Chunks that straddle the window, a second sequence in the same step, then decodes."""
    path, prompt, ref_logits, _ = refs[kind]
    drv = Driver(path, seed=3)
    got = [drv.run([(0, prompt[:13], 0)])[0]]
    a, b = drv.run([(0, prompt[13:30], 13), (1, prompt[:7], 0)])
    got.append(a)
    np.testing.assert_allclose(b, ref_logits[:7], atol=ATOL, rtol=0)
    for i in range(30, PROMPT_LEN):
        got.append(drv.run([(0, prompt[i:i + 1], i)])[0])
    np.testing.assert_allclose(np.concatenate(got), ref_logits, atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------- the engine

ENGINE_NEW = 10


def _engine_prompts():
    """Three prompts past the window (16) and the token budget (32), two sharing a 32-token
    prefix (prefix-cache hits)."""
    from jaxserve.testing.tiny_gemma4 import prompt as make_prompt

    shared = make_prompt(32, seed=7)
    return [np.concatenate([shared, make_prompt(18, seed=8)]),
            make_prompt(45, seed=9),
            np.concatenate([shared, make_prompt(27, seed=10)])]


@pytest.fixture(scope="module")
def engine_refs(gemma4_dirs):
    out = {}
    for kind in ("dense", "moe"):
        hf = hf_model(gemma4_dirs(kind))
        out[kind] = [hf_greedy(hf, p, ENGINE_NEW) for p in _engine_prompts()]
    return out


def _llm(path, **kw):
    from jaxserve.entrypoints.llm import LLM

    return LLM(str(path), dtype="float32", block_size=8, max_num_batched_tokens=32,
               min_token_bucket=8, max_num_seqs=3, max_model_len=128,
               enable_prefix_caching=True, **kw)


def _generate(llm, prompts):
    from jaxserve.core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=ENGINE_NEW, ignore_eos=True)
    res = llm.generate([{"prompt_token_ids": [int(t) for t in p]} for p in prompts], params,
                       use_tqdm=False)
    return [list(r.outputs[0].token_ids) for r in res]


@pytest.mark.parametrize("kind", ["dense", pytest.param("moe", marks=pytest.mark.slow)])
def test_engine_greedy_equals_hf_with_prefix_caching_and_chunked_prefill(gemma4_dirs,
                                                                         engine_refs, kind):
    """Prompts chunked over several steps, batched with each other; the third prompt's first
    32 tokens come from the prefix cache (pages the first request wrote, every layer's)."""
    prompts = _engine_prompts()
    llm = _llm(gemma4_dirs(kind))
    got = _generate(llm, prompts[:1]) + _generate(llm, prompts[1:])
    assert llm.llm_engine.scheduler.block_manager.prefix_cache_hits >= 32
    assert got == engine_refs[kind]


def test_sliding_group_returns_its_pages_during_a_long_generation(gemma4_dirs):
    """A pool per cache group: over 80 generated tokens the sliding group's pages in use stay
    flat (its window's) while the global group's grow with the context; the start-up figures
    are the grouped ones."""
    from jaxserve.core.kv_cache_coordinator import KVCacheCoordinator
    from jaxserve.core.sampling_params import SamplingParams

    llm = _llm(gemma4_dirs("dense"))
    eng = llm.llm_engine
    bm = eng.scheduler.block_manager
    assert isinstance(bm, KVCacheCoordinator) and len(bm.managers) == 2
    assert [m.sliding_window for m in bm.managers] == [16, None]
    eng.add_request("long", list(range(5, 45)), SamplingParams(temperature=0, max_tokens=80,
                                                                ignore_eos=True))
    used = []
    while eng.has_unfinished_requests():
        eng.step()
        used.append(bm.group_used_pages())
    sliding, full = zip(*used[1:-1])
    assert max(sliding) <= 16 // 8 + 2 and min(sliding) >= 2  # the window's pages only
    assert full[-1] >= (40 + 78) // 8 and full[-1] > full[0] + 8  # every page kept
    assert bm.group_used_pages() == [0, 0]


@pytest.mark.slow
def test_groups_serve_ngram_speculation_and_n_greater_than_one(gemma4_dirs, engine_refs):
    """Pools per group under speculative decoding (verify steps write k+1 positions per row)
    and n > 1 (children fork from the parent's cached prefix)."""
    from jaxserve.core.sampling_params import SamplingParams

    llm = _llm(gemma4_dirs("dense"), speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    assert llm.llm_engine.runner.grouped
    assert _generate(llm, _engine_prompts()) == engine_refs["dense"]
    res = llm.generate([{"prompt_token_ids": [int(t) for t in _engine_prompts()[1]]}],
                       SamplingParams(temperature=0.8, n=2, seed=1, max_tokens=ENGINE_NEW,
                                      ignore_eos=True), use_tqdm=False)
    assert [len(o.token_ids) for o in res[0].outputs] == [ENGINE_NEW] * 2
    assert llm.llm_engine.scheduler.block_manager.group_used_pages() == [0, 0]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_engine_greedy_equals_hf_under_preemption(gemma4_dirs, engine_refs, mode):
    """A pool of 14 pages for three requests of 6-8 pages each: requests are preempted and
    resumed (recomputed, or swapped out and back), tokens still equal HF's."""
    llm = _llm(gemma4_dirs("dense"), num_gpu_blocks_override=14, preemption_mode=mode)
    sched = llm.llm_engine.scheduler
    assert llm.llm_engine.runner.grouped  # a pool per group under either mode
    seen, schedule = [], sched.schedule

    def counting_schedule(*a, **k):  # pages in use per pool, and each swap's pages per pool
        out = schedule(*a, **k)
        seen.append((sched.block_manager.group_used_pages(),
                     [[len(p) for p in pages] for _, pages in out.swap_out]))
        return out
    sched.schedule = counting_schedule
    got = _generate(llm, _engine_prompts())
    assert sched.num_preemptions_total > 0
    assert got == engine_refs["dense"]
    window_pages = 16 // 8 + 1
    # the sliding pool holds each running request's window (plus a chunk's pages), however
    # long the contexts grow; the full pool holds every page
    sliding = [used[0] for used, _ in seen]
    assert max(sliding) <= 3 * (window_pages + 32 // 8)
    if mode == "swap":
        swaps = [p for _, outs in seen for p in outs]
        assert swaps and sched.num_swap_outs_total > 0
        assert all(s <= window_pages for s, _ in swaps)  # only the window's pages move
        assert max(f for _, f in swaps) > window_pages


# ----------------------------------------------------------------------------- tensor parallel

def _child(cases: dict) -> dict:
    """In a process with 2 CPU devices: prompt logits and greedy tokens of each case."""
    from jaxserve.sharding import make_mesh

    out = {}
    for name, (path, prompt) in cases.items():
        ep = name.endswith("-ep")
        drv = Driver(path, mesh=make_mesh(2), seed=4, enable_expert_parallel=ep)
        logits, tokens = drv.prefill_then_greedy(np.asarray(prompt, np.int32), NEW_TOKENS)
        q = drv.model.model.layers[0].self_attn.q_proj.weight.get_value()
        out[name] = dict(logits=logits.tolist(), tokens=tokens,
                         q_shard=list(q.addressable_shards[0].data.shape), q=list(q.shape))
        experts = drv.model.model.layers[0].experts
        if experts is not None:
            w = experts.gate_proj.get_value()
            out[name]["experts"] = [list(w.shape), list(w.addressable_shards[0].data.shape)]
        del drv
    llm = _llm(cases["dense"][0], tensor_parallel_size=2)
    out["llm-dense"] = _generate(llm, _engine_prompts())
    return out


@pytest.fixture(scope="module")
def tp2(refs):
    import json
    import os
    import subprocess
    import sys

    cases = {k: (str(refs[k][0]), refs[k][1].tolist()) for k in ("dense", "moe")}
    cases["moe-ep"] = cases["moe"]
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu", PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, __file__, json.dumps(cases)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a child process with two CPU devices
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_tp2_equals_hf(refs, tp2, kind):
    _, _, ref_logits, ref_tokens = refs[kind]
    got = tp2[kind]
    assert got["q_shard"] == [got["q"][0] // 2, got["q"][1]]  # really split
    np.testing.assert_allclose(np.asarray(got["logits"]), ref_logits, atol=ATOL, rtol=0)
    assert got["tokens"] == ref_tokens


@pytest.mark.slow
def test_expert_parallel_equals_hf(refs, tp2):
    """Experts split whole over the two devices (2 each) instead of each expert split."""
    _, _, ref_logits, ref_tokens = refs["moe"]
    (e, h, i), shard = tp2["moe-ep"]["experts"]
    assert shard == [e // 2, h, i] and tp2["moe"]["experts"][1] == [e, h, i // 2]
    np.testing.assert_allclose(np.asarray(tp2["moe-ep"]["logits"]), ref_logits, atol=ATOL,
                               rtol=0)
    assert tp2["moe-ep"]["tokens"] == ref_tokens


@pytest.mark.slow
def test_tp2_engine_equals_hf(tp2, engine_refs):
    assert tp2["llm-dense"] == engine_refs["dense"]


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(_child(json.loads(sys.argv[1]))))
