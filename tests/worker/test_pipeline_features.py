"""Pipeline parallelism with the features and families beyond the dense/MoE core, on 4 fake CPU
devices: greedy tokens under pp 2 (and pp 2 x tp 2) equal one device for

* multi-LoRA: two PEFT adapters and the base mixed in one batch (each stage holds its own
  layers' adapter slots on its own devices);
* speculative decoding: n-gram and a draft model (on the last stage's first device), compared
  with one device *without* speculation, drafts accepted and counted;
* the Qwen3, Gemma 2, Gemma 3 (sliding and global layers) and Phi-3 families, the Qwen3.5
  hybrid (Gated DeltaNet state pool per stage, through recompute and swap preemption) and
  Gemma 4 dense and MoE (per-layer inputs handed on with the hidden states, KV-sharing layers
  in their producer's stage; a pool per cache group, through swap preemption);
* speculation on the Qwen3.5 hybrid: n-gram drafts (each stage rolls its state pool back to
  the last accepted token) and its MTP head (on the last stage), at pp 2 and pp 2 x tp 2;
* data parallel x pipeline parallel, and warm-up on a thread.

A split that separates a KV-sharing layer from its producer, and a family without stage pieces,
are start-up errors naming the flag. The engines run in a child process started with
``--xla_force_host_platform_device_count=4``; it prints one JSON document, asserted here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 10
ENGINE_KW = dict(max_num_batched_tokens=32, min_token_bucket=32, max_num_seqs=4,
                 max_model_len=128, dtype="float32", block_size=8)
# prompts that repeat themselves: n-gram lookups find drafts the target accepts
PROMPTS = [[20 + i, 40 + 3 * i, 7 + i, 90, 91, 92] * (2 + i % 3) for i in range(8)]
# 6 rows: 3 per micro-batch, room for adapter A, the base and adapter B in one step
LORA_KW = dict(enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=6)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
MTP = {"method": "mtp", "num_speculative_tokens": 2}
FAMILIES = {"qwen3": dict(layers=4), "gemma2": {}, "gemma3": {}, "phi3": {}}
# tiny Gemma 4: layers 4 and 5 read the pages of layers 3 and 2 (KV sharing): 2 + 4 layers
PARTITION = {"gemma4": "2,4", "gemma4_moe": "2,4"}


def _devices(arr) -> list[str]:
    return sorted(str(d) for d in arr.sharding.device_set)


def _generate(llm, lora=None):
    from jaxserve.core.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    eng = llm.llm_engine
    warm = eng.stats()["num_compiles"]
    res = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, lora_request=lora,
                       use_tqdm=False)
    stats = eng.stats()
    return dict(tokens=[list(r.outputs[0].token_ids) for r in res],
                compiles_after_warmup=stats["num_compiles"] - warm,
                max_in_flight=eng.max_in_flight,
                drafts=stats.get("spec_decode_num_draft_tokens"),
                accepted=stats.get("spec_decode_num_accepted_tokens"))


def _data_parallel(model: str) -> dict:
    import asyncio

    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.engine.data_parallel import DataParallelAsyncLLM
    from jaxserve.entrypoints.llm import engine_config_from_kwargs

    cfg = engine_config_from_kwargs(model, data_parallel_size=2, pipeline_parallel_size=2,
                                    **ENGINE_KW)
    llm = DataParallelAsyncLLM(cfg)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    async def one(i, prompt):
        last = None
        async for o in llm.generate(prompt, sp, f"req-{i}"):
            last = o
        return list(last.outputs[0].token_ids)

    async def main():
        res = await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))
        await llm.shutdown()
        return res

    tokens = asyncio.run(main())
    return dict(tokens=tokens, requests_per_replica=llm.requests_per_replica,
                stage_devices=[[sorted(str(d) for d in m.devices.flat)
                                for m in r.engine.runner.stages.stage_meshes] for r in llm.replicas],
                max_in_flight=[r.engine.max_in_flight for r in llm.replicas])


BG_KW = dict(ENGINE_KW, max_num_batched_tokens=64, min_token_bucket=8)  # 4 token buckets


def _background(model: str) -> dict:
    """Warm-up on a thread: the engine serves while the larger buckets compile."""
    import threading
    import time

    from jaxserve.config import engine_config_from_kwargs
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.engine.builder import build_engine
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.worker.warmup import BucketWarmup

    single = _generate(LLM(model, **BG_KW))["tokens"]
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def run(eng):
        for i, p in enumerate(PROMPTS):
            eng.add_request(f"r{i}-{time.monotonic()}", p, sp)
        done, progress = {}, None
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    done[int(o.request_id.split("-")[0][1:])] = list(o.outputs[0].token_ids)
                    progress = progress or list(eng.startup_progress())
        return [done[i] for i in range(len(PROMPTS))], progress

    # the buckets above the smallest wait until the first requests are served (a gate on the
    # warm-up thread, so the test does not race the compiles)
    gate, warm_bucket = threading.Event(), BucketWarmup._compile_bucket

    def gated(self, t):
        if t > self.runner.ladder[0]:
            gate.wait(600)
        warm_bucket(self, t)

    BucketWarmup._compile_bucket = gated
    try:
        eng = build_engine(engine_config_from_kwargs(model, pipeline_parallel_size=2, **BG_KW),
                           background_warmup=True)
        runner = eng.runner
        out = dict(single=single, at_start=list(eng.startup_progress()),
                   warm_at_start=runner.warmed_up)
        out["tokens"], out["progress_at_first_finish"] = run(eng)
    finally:
        gate.set()
        BucketWarmup._compile_bucket = warm_bucket
    deadline = time.monotonic() + 600
    while not runner.warmed_up and time.monotonic() < deadline:
        time.sleep(0.2)
    out["warm_later"] = runner.warmed_up
    compiles = runner.num_compiles
    out["tokens_after"] = run(eng)[0]
    out["compiles_after_warmup"] = runner.num_compiles - compiles
    runner.stop_warmup()
    return out


def _child(paths: dict) -> dict:
    import jax

    from jaxserve.core.sampling_params import SamplingParams

    from jaxserve import LoRARequest
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.errors import InvalidRequestError

    out = {"num_devices": len(jax.devices())}

    # multi-LoRA: adapter, base, other adapter, ... in every batch
    loras = [LoRARequest(n, i + 1, p) for i, (n, p) in enumerate(paths["adapters"].items())]
    per_prompt = [[loras[0], None, loras[1]][i % 3] for i in range(len(PROMPTS))]
    runs = {}
    for name, pp, tp in [("single", 1, 1), ("pp2", 2, 1), ("pp2xtp2", 2, 2)]:
        llm = LLM(paths["llama"], pipeline_parallel_size=pp, tensor_parallel_size=tp,
                  **dict(ENGINE_KW, **LORA_KW))
        sched, steps = llm.llm_engine.scheduler, []
        schedule = sched.schedule

        def spy(schedule=schedule, steps=steps):
            out = schedule()
            steps.append(sorted({s.request.lora_int_id for s in out.scheduled}))
            return out

        sched.schedule = spy
        runs[name] = _generate(llm, per_prompt)
        runs[name]["widest_mix"] = max(steps, key=len)
        if pp > 1:  # each stage's slots: its own layers, on its own devices
            slots = llm.llm_engine.runner.lora.stages
            runs[name]["slot_layers"] = [sorted({int(p.split(".")[2]) for p in s.paths})
                                         for s in slots]
            runs[name]["slot_devices"] = [
                sorted({d for x in jax.tree_util.tree_leaves(s.arrays) for d in _devices(x)})
                for s in slots]
            runs[name]["stage_devices"] = [sorted(str(d) for d in m.devices.flat)
                                           for m in llm.llm_engine.runner.stages.stage_meshes]
        del llm
    # adapters and n-gram speculation together: verify rows carry their adapter's slot
    runs["pp2-ngram"] = _generate(LLM(paths["llama"], pipeline_parallel_size=2,
                                      speculative_config=NGRAM, **dict(ENGINE_KW, **LORA_KW)),
                                  per_prompt)
    runs["base"] = _generate(LLM(paths["llama"], **ENGINE_KW))
    out["lora"] = runs

    # speculative decoding, against one device without it
    runs = {"single": _generate(LLM(paths["llama"], **ENGINE_KW))}
    for name, pp, tp, spec in [
            ("pp2-ngram", 2, 1, NGRAM), ("pp2xtp2-ngram", 2, 2, NGRAM),
            ("pp2-draft", 2, 1, {"method": "draft_model", "model": paths["draft"],
                                 "num_speculative_tokens": 3})]:
        llm = LLM(paths["llama"], pipeline_parallel_size=pp, tensor_parallel_size=tp,
                  speculative_config=spec, **ENGINE_KW)
        runs[name] = _generate(llm)
        if spec["method"] == "draft_model":
            eng = llm.llm_engine
            draft = eng.proposer.runner
            runs[name]["draft_devices"] = sorted(
                {d for k, v in draft.kv_pages for d in _devices(k)}
                | {d for x in draft._state_leaves for d in _devices(x)})
            runs[name]["last_stage_devices"] = sorted(
                str(d) for d in eng.runner.stages.stage_meshes[-1].devices.flat)
        del llm
    out["spec"] = runs

    # other families
    out["families"] = {}
    for family, path in paths["families"].items():
        runs = {"single": _generate(LLM(path, **ENGINE_KW))}
        if family in PARTITION:
            os.environ["JAXSERVE_PP_LAYER_PARTITION"] = PARTITION[family]
        runs["pp2"] = _generate(LLM(path, pipeline_parallel_size=2, **ENGINE_KW))
        if family in ("gemma3", "qwen3_5", "gemma4", "gemma4_moe"):
            runs["pp2xtp2"] = _generate(LLM(path, pipeline_parallel_size=2,
                                            tensor_parallel_size=2, **ENGINE_KW))
        if family == "gemma4":  # a pool per cache group (default), and one pool for all
            llm = LLM(path, pipeline_parallel_size=2, **ENGINE_KW)
            out["gemma4_pools"] = dict(
                single=list(LLM(path, **ENGINE_KW).llm_engine.runner.pool_pages),
                pp2=list(llm.llm_engine.runner.pool_pages),
                grouped=llm.llm_engine.runner.grouped)
            del llm
            runs["pp2-one-pool"] = _generate(LLM(path, pipeline_parallel_size=2,
                                                 disable_hybrid_kv_cache_manager=True,
                                                 **ENGINE_KW))
            # swap preemption under pp: each stage copies its layers' pages of each pool
            llm = LLM(path, pipeline_parallel_size=2, preemption_mode="swap",
                      num_gpu_blocks_override=10, **ENGINE_KW)
            sched, swaps = llm.llm_engine.scheduler, []
            schedule = sched.schedule

            def spy(schedule=schedule, swaps=swaps):
                out = schedule()
                swaps.extend([len(p) for p in pages] for _, pages in out.swap_out)
                return out

            sched.schedule = spy
            runs["pp2-swap"] = _generate(llm)
            runs["pp2-swap"].update(swap_pages=swaps, grouped=llm.llm_engine.runner.grouped,
                                    swap_outs=sched.num_swap_outs_total)
            del llm
        os.environ.pop("JAXSERVE_PP_LAYER_PARTITION", None)
        if family == "qwen3_5":  # a small pool: preemption drops (recompute) or swaps the state
            for mode in ("recompute", "swap"):
                llm = LLM(path, pipeline_parallel_size=2, preemption_mode=mode,
                          num_gpu_blocks_override=12, **ENGINE_KW)
                runs[f"pp2-{mode}"] = _generate(llm)
                stats = llm.llm_engine.stats()
                runs[f"pp2-{mode}"].update(
                    preemptions=stats["num_preemptions"],
                    swap_outs=llm.llm_engine.scheduler.num_swap_outs_total,
                    state_slots=llm.llm_engine.runner.num_state_slots,
                    stage_attention_layers=[
                        # (k, v) pages are [Hkv, pages, block, D]; a state's conv part is 3-D
                        sum(len(c) == 2 and c[0].ndim == 4 for c in pages) for pages in
                        llm.llm_engine.runner.stages.stage_pages])
                del llm
        out["families"][family] = runs

    # data parallel x pipeline parallel: two replicas of two stages each
    out["dp2xpp2"] = _data_parallel(paths["llama"])

    out["background"] = _background(paths["llama"])

    # n > 1: Qwen3.5's siblings fork from the first child (pages and state copied on every
    # stage), Llama's share its cached prompt pages
    out["n2"] = {}
    for family in ("qwen3_5", "llama"):
        path = paths["families"].get(family) or paths["llama"]
        for name, kw in [("single", {}), ("pp2", dict(pipeline_parallel_size=2))]:
            llm = LLM(path, **ENGINE_KW, **kw)
            runner, forks = llm.llm_engine.runner, []
            fork = runner.fork
            runner.fork = lambda pages, slots, fork=fork, forks=forks: (
                forks.append(len(pages) + len(slots)), fork(pages, slots))
            res = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], SamplingParams(
                n=2, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
            out["n2"][f"{family}-{name}"] = dict(
                forks=sum(forks), outputs=[[list(c.token_ids) for c in r.outputs] for r in res])
            del llm, runner

    # speculation on a state-pool model under pp: n-gram drafts (each stage rolls its state
    # back after the verifier) and the MTP head on the last stage
    out["hybrid_spec"] = {
        name: _generate(LLM(paths["families"]["qwen3_5"], pipeline_parallel_size=2,
                            speculative_config=spec, **ENGINE_KW))
        for name, spec in [("pp2-ngram", NGRAM), ("pp2-mtp", MTP)]}

    # Gemma 4's KV-sharing layers split from their producers by the even split
    try:
        LLM(paths["families"]["gemma4"], pipeline_parallel_size=2, **ENGINE_KW)
        out["kv_sharing_error"] = None
    except InvalidRequestError as e:
        out["kv_sharing_error"] = [e.param, str(e)]
    return out


def _child_hybrid_tp(paths: dict) -> dict:
    """Speculation on Qwen 3.5 at pp 2 x tp 2: n-gram drafts and the MTP head."""
    from jaxserve.entrypoints.llm import LLM

    return {name: _generate(LLM(paths["families"]["qwen3_5"], pipeline_parallel_size=2,
                                tensor_parallel_size=2, speculative_config=spec, **ENGINE_KW))
            for name, spec in [("pp2xtp2-ngram", NGRAM), ("pp2xtp2-mtp", MTP)]}


def _run_child(paths: dict, *mode: str) -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("JAXSERVE_PP_LAYER_PARTITION", None)
    env.pop("VLLM_PP_LAYER_PARTITION", None)
    proc = subprocess.run([sys.executable, __file__, json.dumps(paths), *mode], env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def report(pp_paths):
    return _run_child(pp_paths)


@pytest.fixture(scope="module")
def hybrid_tp_report(pp_paths):
    return _run_child(pp_paths, "hybrid_tp")


@pytest.fixture(scope="module")
def pp_paths(tiny_model_factory, tmp_path_factory):
    pytest.importorskip("peft")
    from jaxserve.testing.lora_adapters import make_peft_adapter
    from jaxserve.testing.qwen3_5 import make_tiny_qwen3_5
    from jaxserve.testing.tiny_gemma4 import make_tiny_gemma4

    root = tmp_path_factory.mktemp("pp-features")
    llama = tiny_model_factory("llama", layers=4)
    adapters = {  # both adapt layers of both stages
        "attn-qv": make_peft_adapter(llama, root / "attn-qv", r=8,
                                     target_modules=["q_proj", "v_proj"], seed=1),
        "all-r4": make_peft_adapter(llama, root / "all-r4", r=4, seed=2, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    }
    paths = dict(
        llama=str(llama), adapters={k: str(v) for k, v in adapters.items()},
        # the target as its own draft: the draft's argmax is the target's, so acceptance
        # shows that the draft really ran (on its device, with its own pages)
        draft=str(llama),
        families=dict({f: str(tiny_model_factory(f, **kw)) for f, kw in FAMILIES.items()},
                      qwen3_5=str(make_tiny_qwen3_5(root / "qwen3_5")),
                      gemma4=str(make_tiny_gemma4(root / "gemma4")),
                      gemma4_moe=str(make_tiny_gemma4(root / "gemma4-moe", moe=True))))
    return paths


def test_lora_mixed_with_base_equals_one_device(report):
    assert report["num_devices"] == 4
    runs = report["lora"]
    single = runs["single"]["tokens"]
    assert len(single) == len(PROMPTS) and all(len(t) == MAX_TOKENS for t in single)
    # base rows (every third) are the base model's, adapter rows differ from it
    base = runs["base"]["tokens"]
    assert [single[i] for i in range(1, len(PROMPTS), 3)] == \
        [base[i] for i in range(1, len(PROMPTS), 3)]
    assert all(single[i] != base[i] for i in range(len(PROMPTS)) if i % 3 != 1)
    for name in ("pp2", "pp2xtp2"):
        r = runs[name]
        assert r["tokens"] == single, name
        assert r["compiles_after_warmup"] == 0, name
        assert r["max_in_flight"] == 2, name
        assert r["widest_mix"] == [0, 1, 2], name  # base and both adapters in one step
        # stage 0 holds layers 0-1's adapter weights, stage 1 layers 2-3's, each on its devices
        assert r["slot_layers"] == [[0, 1], [2, 3]], name
        assert r["slot_devices"] == r["stage_devices"], name
    spec = runs["pp2-ngram"]  # with speculation: the same tokens, drafts kept
    assert spec["tokens"] == single and spec["compiles_after_warmup"] == 0
    assert spec["accepted"] > 0, spec


def test_speculative_decoding_equals_one_device_without_it(report):
    runs = report["spec"]
    single = runs["single"]["tokens"]
    assert runs["single"]["drafts"] is None  # no speculation there
    for name in ("pp2-ngram", "pp2xtp2-ngram", "pp2-draft"):
        r = runs[name]
        assert r["tokens"] == single, name
        assert r["compiles_after_warmup"] == 0, name
        # drafts were verified through the stages and some were kept
        assert r["drafts"] > 0 and 0 < r["accepted"] <= r["drafts"], (name, r)
    draft = runs["pp2-draft"]
    assert draft["draft_devices"] == draft["last_stage_devices"][:1]
    assert draft["accepted"] >= 0.9 * draft["drafts"], draft


def test_data_parallel_replicas_of_pipelines_equal_one_device(report):
    r = report["dp2xpp2"]
    assert r["tokens"] == report["spec"]["single"]["tokens"]
    assert r["requests_per_replica"] == [4, 4]
    # replica i: stages on devices 2i and 2i+1
    assert r["stage_devices"] == [[["cpu:0"], ["cpu:1"]],
                                  [["cpu:2"], ["cpu:3"]]]
    assert r["max_in_flight"] == [2, 2]


def test_background_warmup_serves_while_buckets_compile(report):
    r = report["background"]
    assert r["at_start"][2] == 4 and r["at_start"][1] < 4 and not r["warm_at_start"]
    # the requests were served on the smallest bucket alone (the others held back)
    assert r["progress_at_first_finish"] == [True, 1, 4]
    assert r["tokens"] == r["single"] == r["tokens_after"]
    assert r["warm_later"] and r["compiles_after_warmup"] == 0


@pytest.mark.parametrize("family", list(FAMILIES) + ["qwen3_5", "gemma4", "gemma4_moe"])
def test_families_equal_one_device(report, family):
    runs = report["families"][family]
    single = runs["single"]["tokens"]
    assert len(set(map(tuple, single))) > 1
    for name, r in runs.items():
        assert r["tokens"] == single, (family, name)
        assert r["compiles_after_warmup"] == 0, (family, name)


@pytest.mark.parametrize("family", ["qwen3_5", "llama"])
def test_n2_siblings_equal_one_device(report, family):
    """Greedy siblings agree with each other and with one device; Qwen3.5's fork from the
    first child's pages and state on every stage."""
    single, pp2 = report["n2"][f"{family}-single"], report["n2"][f"{family}-pp2"]
    assert pp2["outputs"] == single["outputs"]
    assert all(len(o) == 2 and o[0] == o[1] for o in pp2["outputs"])
    assert (single["forks"] > 0) == (pp2["forks"] > 0) == (family == "qwen3_5"), (single, pp2)


def test_hybrid_state_pool_per_stage_through_preemption(report):
    """Qwen3.5: each stage holds the state-pool arrays of its Gated DeltaNet layers (layers
    0-2 of 4; layer 3 is attention) under the same slot ids; preemption recomputes or swaps
    the state and the tokens do not change (test_families_equal_one_device)."""
    runs = report["families"]["qwen3_5"]
    for mode in ("recompute", "swap"):
        r = runs[f"pp2-{mode}"]
        assert r["preemptions"] > 0, mode
        assert (r["swap_outs"] > 0) == (mode == "swap"), mode
        assert r["state_slots"] == ENGINE_KW["max_num_seqs"]
        assert r["stage_attention_layers"] == [0, 1], r  # the rest hold state-pool arrays


def test_gemma4_pools_per_cache_group_under_pp(report):
    """Each stage holds its layers' part of the sliding and the global pool, sized as on one
    device (the sliding pool frees pages out of the window: fewer pages)."""
    pools = report["gemma4_pools"]
    assert pools["grouped"] and pools["pp2"] == pools["single"]
    assert len(pools["pp2"]) == 2 and pools["pp2"][0] < pools["pp2"][1]


def test_gemma4_swap_preemption_under_pp_copies_each_pool(report):
    """Swap preemption at pp 2 keeps a pool per cache group (each stage sized and allocated
    from the one KVCacheConfig over its layers): tokens equal one device, and each swap moves
    at most the window's sliding pages while the full pool moves every page."""
    runs = report["families"]["gemma4"]
    got = runs["pp2-swap"]
    assert got["grouped"] and got["swap_outs"] > 0
    assert got["tokens"] == runs["single"]["tokens"]
    window_pages = 16 // 8 + 1
    assert all(len(p) == 2 for p in got["swap_pages"])
    assert all(sliding <= window_pages for sliding, _ in got["swap_pages"])
    assert max(full for _, full in got["swap_pages"]) > window_pages


def test_kv_sharing_split_from_its_producer_is_a_start_up_error(report):
    param, msg = report["kv_sharing_error"]
    assert param == "pipeline_parallel_size"
    assert "layer 5 reads the KV pages of layer 2" in msg, msg
    assert "--pipeline-parallel-size 2" in msg and "JAXSERVE_PP_LAYER_PARTITION" in msg, msg


@pytest.mark.parametrize("name", ["pp2-ngram", "pp2-mtp"])
def test_speculation_on_a_state_pool_model_under_pp_equals_one_device(report, name):
    """Qwen 3.5 (Gated DeltaNet state pool) at pp 2 with n-gram drafts and with its MTP head
    (on the last stage): greedy tokens equal one device without speculation."""
    single = report["families"]["qwen3_5"]["single"]["tokens"]
    r = report["hybrid_spec"][name]
    assert r["tokens"] == single, name
    assert r["compiles_after_warmup"] == 0, name
    assert r["drafts"] > 0, r  # drafts were made and verified through the stages
    if name == "pp2-ngram":  # some kept: the rollback of rejected ones is what is tested
        assert 0 < r["accepted"] <= r["drafts"], r


@pytest.mark.slow  # a second child process: two more engines at pp 2 x tp 2
@pytest.mark.parametrize("name", ["pp2xtp2-ngram", "pp2xtp2-mtp"])
def test_speculation_on_a_state_pool_model_under_pp_and_tp_equals_one_device(
        report, hybrid_tp_report, name):
    """The same at pp 2 x tp 2 (each stage's state pool and pages split over its 2 devices,
    the rollback and the MTP head on sharded pools)."""
    single = report["families"]["qwen3_5"]["single"]["tokens"]
    r = hybrid_tp_report[name]
    assert r["tokens"] == single, name
    assert r["compiles_after_warmup"] == 0, name
    assert r["drafts"] > 0, r
    if name == "pp2xtp2-ngram":
        assert 0 < r["accepted"] <= r["drafts"], r


def test_a_family_without_stage_pieces_is_a_start_up_error():
    from jaxserve.errors import InvalidRequestError
    from jaxserve.models.contract import ModelBase
    from jaxserve.worker.stages import check_model

    class OtherForCausalLM(ModelBase):  # the contract's defaults: no stage pieces
        pass

    with pytest.raises(InvalidRequestError) as e:
        check_model(OtherForCausalLM())
    assert e.value.param == "pipeline_parallel_size"
    assert "OtherForCausalLM" in str(e.value) and "--pipeline-parallel-size" in str(e.value)


if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    print(json.dumps(_child_hybrid_tp(args) if sys.argv[2:] == ["hybrid_tp"] else _child(args)))
