"""Weights updated in place and sleep / wake on the tiny Llama: after ``update_weights`` greedy
equals a fresh ``LLM`` of the new weights (arrays used as they are, a safetensors path, fp8
re-quantized, a LoRA base, tp 2, pp 2), with no compile; bad sources change nothing; requests in
flight finish on the old weights or are aborted; ``sleep(2)`` releases the engine's device
bytes and ``wake_up`` restores identical outputs."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams

ENGINE = dict(dtype="float32", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32,
              min_token_bucket=8)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300], list(range(10, 40))]


def _greedy(llm, prompts=PROMPTS, **kw):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, **kw)]


def perturbed(names, leaves, seed=0, scale=0.05) -> dict:
    """New weights: the old ones plus noise, as host arrays keyed by HF name."""
    rng = np.random.default_rng(seed)
    return {n: np.asarray(x, np.float32) + rng.normal(0, scale, x.shape).astype(np.float32)
            for n, x in zip(names, leaves)}


def write_checkpoint(src: Path, dst: Path, tensors: dict) -> Path:
    """``src``'s config and tokenizer with ``tensors`` as its weights."""
    from safetensors.numpy import save_file

    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors*"))
    save_file({n: np.ascontiguousarray(v) for n, v in tensors.items()},
              str(dst / "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def base(tiny_llama_dir):
    return tiny_llama_dir


@pytest.fixture(scope="module")
def llm(base):
    return LLM(str(base), **ENGINE)


@pytest.fixture(scope="module")
def new_weights(llm, base, tmp_path_factory):
    r = llm.llm_engine.runner
    new = perturbed(r.param_names(), r._state_leaves)
    d = write_checkpoint(base, tmp_path_factory.mktemp("new") / "ckpt", new)
    return new, d, _greedy(LLM(str(d), **ENGINE))


def test_update_from_placed_arrays_uses_them_without_copy_or_compile(llm, base, new_weights):
    new, _, want = new_weights
    r = llm.llm_engine.runner
    before = _greedy(llm)
    compiles = r.num_compiles
    placed = {n: jax.device_put(new[n], x.sharding) for n, x in zip(r.param_names(),
                                                                     r._state_leaves)}
    assert llm.update_weights(placed) is True
    assert all(a is placed[n] for n, a in zip(r.param_names(), r._state_leaves))
    assert _greedy(llm) == want != before
    # back to the start from the checkpoint path, then from host arrays (cast and placed)
    llm.update_weights(str(base))
    assert _greedy(llm) == before
    llm.update_weights(new)
    assert _greedy(llm) == want
    llm.update_weights(str(base / "model.safetensors"))  # one file
    assert _greedy(llm) == before
    assert r.num_compiles == compiles


def test_update_from_an_orbax_checkpoint(llm, base, new_weights, tmp_path):
    from jaxserve.loaders.model_loader import convert_to_orbax

    _, d, want = new_weights
    llm.update_weights(str(convert_to_orbax(str(d), tmp_path / "orbax", dtype="float32")))
    assert _greedy(llm) == want
    llm.update_weights(str(base))


def test_update_resets_the_prefix_cache(llm, new_weights):
    new, _, want = new_weights
    _greedy(llm)  # the prompts' pages cached under the old weights
    llm.update_weights(new)
    assert _greedy(llm) == want  # a stale cached prefix would give the old continuation
    assert llm.llm_engine.block_manager.num_free_pages == llm.llm_engine.runner.num_pages - 1


@pytest.mark.parametrize("bad, message", [
    (lambda w: {**w, "model.norm.weight": w["model.norm.weight"][:10]}, "'model.norm.weight' has shape"),
    (lambda w: {**w, "model.layers.0.mlp.up_proj.weight":
                w["model.layers.0.mlp.up_proj.weight"].astype(np.int32)},
     "'model.layers.0.mlp.up_proj.weight' has dtype int32"),
    (lambda w: {k: v for k, v in w.items() if k != "model.layers.1.self_attn.k_proj.weight"},
     "missing tensor 'model.layers.1.self_attn.k_proj.weight'"),
    (lambda w: {**w, "model.layers.9.mlp.up_proj.weight": w["model.norm.weight"]},
     "unexpected tensor 'model.layers.9.mlp.up_proj.weight'"),
])
def test_bad_weights_are_refused_and_the_engine_keeps_its_own(llm, base, new_weights, bad,
                                                              message):
    new, _, _ = new_weights
    llm.update_weights(str(base))
    before = _greedy(llm)
    leaves = list(llm.llm_engine.runner._state_leaves)
    with pytest.raises(ValueError, match=message):
        llm.update_weights(bad(new))
    assert all(a is b for a, b in zip(leaves, llm.llm_engine.runner._state_leaves))
    assert _greedy(llm) == before


def _run_engine(engine, outs):
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o


def test_in_flight_requests_finish_on_old_weights_or_abort(llm, base, new_weights):
    new, _, want = new_weights
    llm.update_weights(str(base))
    old = _greedy(llm)
    engine = llm.llm_engine
    # wait: "a" runs on the old weights to its end; "b" arrives meanwhile and waits
    engine.add_request("a", PROMPTS[0], GREEDY)
    for _ in range(3):
        engine.step()
    assert engine.update_weights(new, in_flight="wait") is False
    engine.add_request("b", PROMPTS[0], GREEDY)
    outs = {}
    _run_engine(engine, outs)
    assert outs["a"].outputs[0].token_ids == old[0]
    assert outs["b"].outputs[0].token_ids == want[0]
    # abort: "c" ends at once with finish reason abort; the swap is immediate
    llm.update_weights(str(base))
    engine.add_request("c", PROMPTS[1], GREEDY)
    for _ in range(3):
        engine.step()
    assert engine.update_weights(new, in_flight="abort") is True
    outs = {}
    _run_engine(engine, outs)
    assert outs["c"].outputs[0].finish_reason == "abort"
    assert len(outs["c"].outputs[0].token_ids) < GREEDY.max_tokens
    assert _greedy(llm) == want
    with pytest.raises(ValueError, match="in_flight"):
        llm.update_weights(new, in_flight="later")
    llm.update_weights(str(base))


def _live_bytes() -> int:
    return sum(x.nbytes for x in jax.live_arrays())


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_releases_device_memory_and_wake_restores_outputs(llm, base, level):
    llm.update_weights(str(base))
    before = _greedy(llm)
    r = llm.llm_engine.runner
    engine_bytes = (sum(x.nbytes for x in r._state_leaves)
                    + sum(x.nbytes for x in jax.tree_util.tree_leaves(r.kv_pages)))
    compiles = r.num_compiles
    live = _live_bytes()
    llm.sleep(level=level)
    assert llm.is_sleeping()
    assert live - _live_bytes() >= 0.95 * engine_bytes  # <= 5 % of the engine's bytes stay
    with pytest.raises(ValueError, match="sleeping") as e:
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert e.value.status_code == 503
    llm.wake_up(tags=["kv_cache"])
    assert llm.is_sleeping()
    llm.wake_up(tags=["weights"])
    assert not llm.is_sleeping()
    assert _greedy(llm) == before
    assert r.num_compiles == compiles


def test_sleep_then_new_weights_then_wake(llm, base, new_weights):
    """The RL pattern: sleep(2) while training, push the new weights, wake the KV cache."""
    new, _, want = new_weights
    llm.sleep(2)
    llm.update_weights(new)
    llm.wake_up(["kv_cache"])
    assert not llm.is_sleeping()
    assert _greedy(llm) == want
    with pytest.raises(ValueError, match="tags"):
        llm.wake_up(["everything"])
    with pytest.raises(ValueError, match="level"):
        llm.sleep(3)
    llm.update_weights(str(base))


def test_sleep_refused_while_requests_run(llm):
    engine = llm.llm_engine
    engine.add_request("busy", PROMPTS[0], GREEDY)
    with pytest.raises(ValueError, match="in flight"):
        llm.sleep(1)
    _run_engine(engine, {})


@pytest.mark.parametrize("method", ["fp8", "int8"])
def test_quantized_engine_requantizes_float_weights_and_reloads_after_sleep(base, new_weights,
                                                                            method):
    new, d, _ = new_weights
    llm = LLM(str(base), quantization=method, **ENGINE)
    fresh = _greedy(LLM(str(d), quantization=method, **ENGINE))
    compiles = llm.llm_engine.runner.num_compiles
    before = _greedy(llm)
    llm.sleep(2)  # no update yet: the wake reloads (and re-quantizes) the model it started with
    llm.wake_up()
    assert _greedy(llm) == before
    llm.update_weights(new)
    assert _greedy(llm) == fresh
    assert llm.llm_engine.runner.num_compiles == compiles
    want = "float8_e4m3fn" if method == "fp8" else "int8"
    assert any(str(x.dtype) == want for x in llm.llm_engine.runner._state_leaves)


def test_lora_base_weights_update(base, new_weights, tmp_path):
    pytest.importorskip("peft")
    from jaxserve.lora.request import LoRARequest
    from jaxserve.testing.lora_adapters import make_peft_adapter

    new, d, _ = new_weights
    adapter = make_peft_adapter(base, tmp_path / "adapter", r=4,
                                target_modules=["q_proj", "v_proj", "down_proj"], seed=3)
    lora = dict(ENGINE, enable_lora=True, max_loras=1, max_lora_rank=8)
    req = [None, LoRARequest("a", 1, str(adapter)), None]
    llm = LLM(str(base), **lora)
    llm.update_weights(new)
    assert _greedy(llm, lora_request=req) == _greedy(LLM(str(d), **lora), lora_request=req)


TP_CHILD = r"""
import json, sys
import jax, numpy as np
from jaxserve import LLM, SamplingParams
sys.path.insert(0, sys.argv[3])
from test_weight_update import ENGINE, PROMPTS, GREEDY, _greedy
llm = LLM(sys.argv[1], tensor_parallel_size=2, **ENGINE)
r = llm.llm_engine.runner
new = {n: np.asarray(v) for n, v in np.load(sys.argv[2]).items()}
placed = {n: jax.device_put(new[n], x.sharding) for n, x in zip(r.param_names(), r._state_leaves)}
c = r.num_compiles
llm.update_weights(placed)
same = all(a is placed[n] for n, a in zip(r.param_names(), r._state_leaves))
res = dict(out=_greedy(llm), same=same, compiles=r.num_compiles - c,
           sharded=len(r._state_leaves[3].sharding.device_set))
pp = LLM(sys.argv[1], pipeline_parallel_size=2, **ENGINE)
c = pp.llm_engine.runner.num_compiles
pp.update_weights(new)
res.update(pp_out=_greedy(pp), pp_compiles=pp.llm_engine.runner.num_compiles - c)
try:
    pp.sleep(1)
except ValueError as e:
    res["pp_sleep"] = str(e)
print(json.dumps(res))
"""


@pytest.mark.slow  # a child process with two CPU devices
def test_tp2_and_pp2_updates_equal_fresh(base, new_weights, tmp_path):
    new, _, want = new_weights
    np.savez(tmp_path / "new.npz", **new)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", TP_CHILD, str(base), str(tmp_path / "new.npz"),
                           str(Path(__file__).parent)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["same"] and res["compiles"] == 0 and res["sharded"] == 2
    assert res["out"] == want  # tp 2 after the update equals tp 1 of the new checkpoint
    assert res["pp_out"] == want and res["pp_compiles"] == 0  # pp 2: each stage's leaves
    assert "pipeline parallelism" in res["pp_sleep"]
