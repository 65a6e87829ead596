"""Pipeline parallelism on 4 fake CPU devices: greedy tokens with pp 2 and pp 2 x tp 2 equal one
device, for a dense model and an MoE, with more requests than one micro-batch holds, prefix
caching and preemption (recompute, and swap) under a small pool, an uneven layer partition,
expert parallelism within a stage and fp8 KV pages; the stages really own their layers' weights
and KV pages; bad sizes are start-up errors naming the flags.

The engines run in a child process started with ``--xla_force_host_platform_device_count=4``
(set before jax is imported); the child prints one JSON document, the assertions are made here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHARED = list(range(3, 19))  # 16 tokens: two full pages shared by every prompt (prefix cache)
PROMPTS = [SHARED + [20 + i, 40 + 3 * i, 7 + i] * (1 + i % 4) for i in range(10)]
MAX_TOKENS = 12
# 10 requests, 4 per micro-batch at most; 12 pages of 8 tokens cannot hold 4 long requests
# (up to 8 pages each) next to the cached prefix: requests are preempted and recomputed
ENGINE_KW = dict(max_num_batched_tokens=32, min_token_bucket=32, max_num_seqs=4,
                 max_model_len=128, dtype="float32", block_size=8, num_gpu_blocks_override=12)
MODELS = {"llama": dict(layers=4, heads=4, kv_heads=2),
          "qwen3_moe": dict(layers=4, heads=4, kv_heads=2, tie_embeddings=True)}  # head copied
# (name, pp, tp, layer partition env, more engine kwargs)
RUNS = [("single", 1, 1, None, {}), ("pp2", 2, 1, None, {}), ("pp2xtp2", 2, 2, None, {})]
FP8 = dict(kv_cache_dtype="fp8")  # fp8 pages: compared with the one-device fp8 run
EXTRA = {"llama": [("pp2-partition-1,3", 2, 1, "1,3", {}),
                   ("pp2-swap", 2, 1, None, dict(preemption_mode="swap")),
                   ("single-fp8", 1, 1, None, FP8), ("pp2xtp2-fp8", 2, 2, None, FP8)],
         "qwen3_moe": [("pp2xep2", 2, 2, None, dict(enable_expert_parallel=True))]}


def _devices(arr) -> list[str]:
    return sorted(str(d) for d in arr.sharding.device_set)


def _child(models: dict) -> dict:
    import jax

    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.errors import InvalidRequestError

    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = {"num_devices": len(jax.devices()), "runs": []}
    for family, path in models.items():
        for name, pp, tp, partition, more in RUNS + EXTRA.get(family, []):
            if partition:
                os.environ["JAXSERVE_PP_LAYER_PARTITION"] = partition
            try:
                llm = LLM(path, pipeline_parallel_size=pp, tensor_parallel_size=tp,
                          **ENGINE_KW, **more)
            finally:
                os.environ.pop("JAXSERVE_PP_LAYER_PARTITION", None)
            eng = llm.llm_engine
            runner = eng.runner
            warm = runner.num_compiles
            res = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
            stats = eng.stats()
            run = dict(family=family, name=name, pp=pp, tp=tp,
                       tokens=[list(r.outputs[0].token_ids) for r in res],
                       preemptions=stats["num_preemptions"],
                       swap_outs=eng.scheduler.num_swap_outs_total,
                       prefix_hits=stats["prefix_cache_hits"],
                       compiles_after_warmup=runner.num_compiles - warm,
                       max_in_flight=eng.max_in_flight)
            if pp > 1:
                run["partition"] = runner.stages.partition
                run["stage_devices"] = [sorted(str(d) for d in m.devices.flat)
                                        for m in runner.stages.stage_meshes]
                # each stage's layer weights and KV pages live on that stage's devices only
                run["weight_devices"] = [
                    sorted({d for leaf in leaves for d in _devices(leaf)})
                    for leaves in runner.stages.stage_leaves]
                run["kv_devices"] = [sorted({d for k, v in pages for d in _devices(k)})
                                     for pages in runner.stages.stage_pages]
                run["kv_layers"] = [len(pages) for pages in runner.stages.stage_pages]
                # the loaded copy of the last stage's layers (on stage 0) is freed, stage 0's
                # own weights (the embedding) are kept
                m = eng.model.model
                run["freed"] = [m.layers[-1].self_attn.q_proj.weight.get_value().is_deleted(),
                                m.embed_tokens.weight.get_value().is_deleted()]
                run["kv_shard_heads"] = sorted({s.data.shape[0] for s in
                                                runner.stages.stage_pages[0][0][0]
                                                .addressable_shards})
            out["runs"].append(run)
            del llm, eng, runner
    path = next(iter(models.values()))
    errors = {}
    for label, kw, env in [("indivisible", dict(pipeline_parallel_size=3), None),
                           ("bad_partition", dict(pipeline_parallel_size=2), "3,2"),
                           ("too_many_devices", dict(pipeline_parallel_size=2,
                                                     tensor_parallel_size=4), None)]:
        if env:
            os.environ["JAXSERVE_PP_LAYER_PARTITION"] = env
        try:
            LLM(path, **kw, **ENGINE_KW)
            errors[label] = None
        except InvalidRequestError as e:
            errors[label] = [e.param, str(e)]
        finally:
            os.environ.pop("JAXSERVE_PP_LAYER_PARTITION", None)
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def report(tiny_model_factory):
    models = {f: str(tiny_model_factory(f, **kw)) for f, kw in MODELS.items()}
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("JAXSERVE_PP_LAYER_PARTITION", None)
    env.pop("VLLM_PP_LAYER_PARTITION", None)
    proc = subprocess.run([sys.executable, __file__, json.dumps(models)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _runs(report, family):
    return {r["name"]: r for r in report["runs"] if r["family"] == family}


@pytest.mark.parametrize("family", list(MODELS))
def test_greedy_tokens_equal_one_device(report, family):
    assert report["num_devices"] == 4
    runs = _runs(report, family)
    base = runs["single"]["tokens"]
    assert len(base) == len(PROMPTS) and all(len(t) == MAX_TOKENS for t in base)
    assert len(set(map(tuple, base))) > 1  # the prompts give different continuations
    assert set(runs) == {r[0] for r in RUNS + EXTRA.get(family, [])}
    if "single-fp8" in runs:  # fp8 pages change some tokens: those runs have their own base
        assert runs["single-fp8"]["tokens"] != base
    for name, r in runs.items():
        assert r["tokens"] == (runs["single-fp8"]["tokens"] if "fp8" in name else base), name
        assert r["compiles_after_warmup"] == 0, name
        # the small pool preempts, the shared prefix is served from the cache
        assert r["preemptions"] > 0 and r["prefix_hits"] > 0, (name, r["preemptions"])
        assert (r["swap_outs"] > 0) == ("swap" in name), name  # pages to the host and back


@pytest.mark.parametrize("family", list(MODELS))
def test_stages_own_their_layers_weights_and_pages(report, family):
    for name, r in _runs(report, family).items():
        if r["pp"] == 1:
            continue
        stages = r["stage_devices"]
        assert len(stages) == 2 and all(len(s) == r["tp"] for s in stages)
        assert not set(stages[0]) & set(stages[1])
        assert r["weight_devices"] == stages and r["kv_devices"] == stages
        lo_hi = [tuple(x) for x in r["partition"]]
        assert lo_hi == ([(0, 1), (1, 4)] if "partition" in name else [(0, 2), (2, 4)])
        assert r["kv_layers"] == [hi - lo for lo, hi in lo_hi]
        assert r["freed"] == [True, False]
        assert r["kv_shard_heads"] == [2 // r["tp"]]  # KV heads split within a stage
        # a micro-batch per stage: two plans were in flight at once
        assert r["max_in_flight"] == 2


def test_bad_sizes_are_start_up_errors_naming_the_flags(report):
    e = report["errors"]
    assert e["indivisible"][0] == "pipeline_parallel_size"
    assert "--pipeline-parallel-size 3" in e["indivisible"][1] and "4 layers" in e["indivisible"][1]
    assert e["bad_partition"][0] == "pipeline_parallel_size"
    assert "JAXSERVE_PP_LAYER_PARTITION='3,2'" in e["bad_partition"][1]
    msg = e["too_many_devices"][1]
    assert "--pipeline-parallel-size 2" in msg and "--tensor-parallel-size 4" in msg
    assert "4 available" in msg


@pytest.mark.parametrize("feature,hosts", [
    (dict(data_parallel_size=2), 2),
    (dict(speculative_config={"method": "draft_model", "model": "DRAFT",
                              "num_speculative_tokens": 2}), 2)])
def test_features_pipelining_lacks_are_start_up_errors(tiny_llama_dir, feature, hosts):
    """Refused before any weight is read, naming the flag (not silently run without them):
    data parallelism and a draft model with pipelining across hosts."""
    import dataclasses

    from jaxserve.config import engine_config_from_kwargs
    from jaxserve.errors import InvalidRequestError
    from jaxserve.worker.stages import check_config

    if "speculative_config" in feature:
        feature = dict(speculative_config=dict(feature["speculative_config"],
                                               model=str(tiny_llama_dir)))
    config = engine_config_from_kwargs(str(tiny_llama_dir), pipeline_parallel_size=2, **feature)
    config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel,
                                                                      num_hosts=hosts))
    with pytest.raises(InvalidRequestError) as e:
        check_config(config)
    assert e.value.param == "pipeline_parallel_size" and "--pipeline-parallel-size" in str(e.value)


def test_layer_partition():
    from jaxserve.errors import InvalidRequestError
    from jaxserve.worker.stages import layer_partition

    assert layer_partition(8, 4, env={}) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert layer_partition(8, 2, env={"VLLM_PP_LAYER_PARTITION": "3,5"}) == [(0, 3), (3, 8)]
    # jaxserve's own variable wins over vLLM's
    assert layer_partition(8, 2, env={"JAXSERVE_PP_LAYER_PARTITION": "6,2",
                                      "VLLM_PP_LAYER_PARTITION": "3,5"}) == [(0, 6), (6, 8)]
    for n, pp, env in [(6, 4, {}), (8, 2, {"VLLM_PP_LAYER_PARTITION": "8,0"}),
                       (8, 2, {"VLLM_PP_LAYER_PARTITION": "a,b"})]:
        with pytest.raises(InvalidRequestError) as e:
            layer_partition(n, pp, env=env)
        assert e.value.param == "pipeline_parallel_size"


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))))
