"""float8 KV cache scales end to end: a tiny Llama whose K and V lie far outside e4m3's range.

The checkpoint is the tiny random Llama with ``k_proj`` and ``v_proj`` multiplied by ``BIG``
and ``q_proj`` / ``o_proj`` by ``GAIN / BIG``: its K/V (~1e3) saturate float8 pages at 448
when stored with scale 1.0, and ``GAIN`` makes attention sharp enough for that to matter.
The measured quantity is the largest error of the prompt's log-probabilities against a float32
KV cache.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.entrypoints.llm import LLM
from jaxserve.models import kv_scales

BIG = 1.0e4
GAIN = 4.0  # sharper attention, a larger attention output: K/V errors show in the logits
PROMPT = "The quick brown fox jumps over the lazy dog while the small cat sleeps on the mat."
ENGINE_KW = dict(dtype="float32", attention_backend="xla", max_model_len=64,
                 num_gpu_blocks_override=16, max_num_seqs=2, max_num_batched_tokens=64,
                 min_token_bucket=64)


@pytest.fixture(scope="module")
def big_kv_dir(tiny_model_factory, tmp_path_factory):
    src = tiny_model_factory("llama", init_std=0.1)
    out = tmp_path_factory.mktemp("big_kv")
    for f in src.iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    [st] = list(out.glob("*.safetensors"))
    t = load_file(st)
    for name in list(t):
        for proj, factor in (("k_proj", BIG), ("v_proj", BIG), ("q_proj", GAIN / BIG),
                             ("o_proj", GAIN / BIG)):
            if f"self_attn.{proj}." in name:
                t[name] = (t[name] * factor).astype(t[name].dtype)
    save_file(t, st, metadata={"format": "pt"})
    return out


def _prompt_logprobs(llm):
    [out] = llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=0),
                         use_tqdm=False)
    ids = out.prompt_token_ids
    return np.asarray([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])


@pytest.fixture(scope="module")
def runs(big_kv_dir):
    """Prompt log-probs with a float32 cache, fp8 at scale 1.0, fp8 with calculated scales."""
    got = {}
    for key, kw in (("f32", {}), ("unit", dict(kv_cache_dtype="fp8")),
                    ("calc", dict(kv_cache_dtype="fp8", calculate_kv_scales=True))):
        llm = LLM(str(big_kv_dir), **ENGINE_KW, **kw)
        got[key] = _prompt_logprobs(llm)
        got[key + "_scales"] = kv_scales.get_kv_scales(llm.llm_engine.model)
        del llm
    return got


def test_calculated_scales_undo_fp8_saturation(runs):
    """Scale 1.0 saturates K/V (log-prob error of order 1); the calculated scales bring the
    error down by more than 8x (measured 17x), to float8 rounding."""
    err_unit = np.abs(runs["unit"] - runs["f32"]).max()
    err_calc = np.abs(runs["calc"] - runs["f32"]).max()
    assert runs["unit_scales"] is None
    scales = runs["calc_scales"]
    assert scales.shape == (2, 2, 2) and np.all(scales > 1.0)  # amax ~1e3 / 448
    print(f"max |prompt logprob error| vs float32 KV: scale 1.0 {err_unit:.4f}, "
          f"calculated {err_calc:.4f}")
    assert err_unit > 1.0, err_unit  # measured 2.31
    assert err_calc < err_unit / 8, (err_calc, err_unit)  # measured 0.13: float8 rounding


def test_checkpoint_scales_are_loaded_and_used(big_kv_dir, runs, tmp_path, caplog):
    """vLLM's tensor names: self_attn.k_scale (per layer) and v_proj.output_scale (per KV head),
    written with the calculated values, serve as well as calculating; with kv_cache_dtype auto
    they are ignored with a log line."""
    for f in big_kv_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    [st] = list(tmp_path.glob("*.safetensors"))
    t = load_file(st)
    calc = runs["calc_scales"]
    for layer in range(calc.shape[0]):
        t[f"model.layers.{layer}.self_attn.k_scale"] = np.asarray(calc[layer, :, 0].max(),
                                                                  np.float32)
        t[f"model.layers.{layer}.self_attn.v_proj.output_scale"] = calc[layer, :, 1].copy()
    save_file(t, st, metadata={"format": "pt"})

    llm = LLM(str(tmp_path), kv_cache_dtype="fp8", **ENGINE_KW)
    loaded = kv_scales.get_kv_scales(llm.llm_engine.model)
    np.testing.assert_allclose(loaded[:, :, 1], calc[:, :, 1])
    np.testing.assert_allclose(loaded[:, :, 0], calc[:, :, 0].max(axis=1, keepdims=True)
                               .repeat(2, axis=1))
    err = np.abs(_prompt_logprobs(llm) - runs["f32"]).max()
    err_unit = np.abs(runs["unit"] - runs["f32"]).max()
    assert err < err_unit / 8, (err, err_unit)
    del llm

    with caplog.at_level(logging.WARNING, logger="jaxserve.worker.kv_calibration"):
        llm = LLM(str(tmp_path), **ENGINE_KW)
    assert kv_scales.get_kv_scales(llm.llm_engine.model) is None
    assert "scales are not used" in caplog.text


def test_calculate_kv_scales_needs_an_fp8_cache(tiny_llama_dir):
    from jaxserve.entrypoints.cli import build_parser, engine_config_from_args

    with pytest.raises(ValueError, match="calculate_kv_scales needs a float8 kv_cache_dtype"):
        LLM(str(tiny_llama_dir), calculate_kv_scales=True, **ENGINE_KW)
    args = build_parser().parse_args(["serve", "demo-random", "--kv-cache-dtype", "fp8",
                                      "--calculate-kv-scales"])
    assert engine_config_from_args(args).cache.calculate_kv_scales is True


def test_checkpoint_scale_names_follow_vllm():
    ones = lambda v: (lambda: np.asarray(v, np.float32))  # noqa: E731
    names = {
        "model.layers.0.self_attn.k_scale": ones(2.0),
        "model.layers.0.self_attn.attn.v_scale": ones([3.0, 4.0]),
        "model.layers.1.self_attn.k_proj.k_scale": ones(5.0),
        "model.layers.1.self_attn.v_proj.v_scale": ones(6.0),
        "model.layers.2.self_attn.k_proj.output_scale": ones([7.0, 8.0]),
        "model.layers.3.self_attn.kv_scale": ones(9.0),
        "model.layers.0.self_attn.k_proj.weight": ones(0.0),
    }
    assert not kv_scales.is_scale_tensor("model.layers.0.self_attn.k_proj.weight")
    s = kv_scales.checkpoint_kv_scales(names, 4, 2)
    assert s[0].tolist() == [[2.0, 3.0], [2.0, 4.0]]
    assert s[1].tolist() == [[5.0, 6.0], [5.0, 6.0]]
    assert s[2].tolist() == [[7.0, 1.0], [8.0, 1.0]]
    assert s[3].tolist() == [[9.0, 9.0], [9.0, 9.0]]
    with pytest.raises(ValueError, match="one per KV head"):
        kv_scales.checkpoint_kv_scales({"model.layers.0.self_attn.k_scale": ones([1, 2, 3])},
                                       4, 2)
    assert kv_scales.checkpoint_kv_scales({}, 4, 2) is None


def _tp_child(model_dir: str) -> dict:
    """In a child with 4 fake CPU devices: prompt log-probs at tp 1, 2 and 4 (4 > 2 KV heads:
    the pool repeats heads) with per-head checkpoint scales, and at tp 1 with the two heads'
    K scales swapped."""
    st = next(Path(model_dir).glob("*.safetensors"))
    out = {}
    for key, tp, k0 in (("tp1", 1, [1e-3, 0.05]), ("tp2", 2, [1e-3, 0.05]),
                        ("tp4", 4, [1e-3, 0.05]), ("swapped", 1, [0.05, 1e-3])):
        t = load_file(st)
        t["model.layers.0.self_attn.k_scale"] = np.asarray(k0, np.float32)
        save_file(t, st, metadata={"format": "pt"})
        llm = LLM(model_dir, kv_cache_dtype="fp8", tensor_parallel_size=tp, **ENGINE_KW)
        out[key] = _prompt_logprobs(llm).tolist()
        del llm
    return out


@pytest.mark.slow
def test_per_head_scales_shard_with_tensor_parallel(tiny_model_factory, tmp_path):
    """Each shard reads its own KV heads' scales: tp 2 and 4 equal tp 1, while swapping two
    heads' scales (one saturates its K) changes the result, so the check is live."""
    src = tiny_model_factory("llama", heads=8, kv_heads=2, init_std=0.1)
    for f in src.iterdir():
        if f.is_file():
            shutil.copy(f, tmp_path / f.name)
    [st] = list(tmp_path.glob("*.safetensors"))
    t = load_file(st)
    for layer in range(2):  # head 0's K and head 1's V saturate, the others do not
        t[f"model.layers.{layer}.self_attn.k_scale"] = np.asarray([1e-3, 0.05], np.float32)
        t[f"model.layers.{layer}.self_attn.v_scale"] = np.asarray([0.05, 1e-3], np.float32)
    save_file(t, st, metadata={"format": "pt"})
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run([sys.executable, __file__, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = {k: np.asarray(v) for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}
    assert np.abs(r["tp2"] - r["tp1"]).max() < 1e-4
    assert np.abs(r["tp4"] - r["tp1"]).max() < 1e-4
    assert np.abs(r["swapped"] - r["tp1"]).max() > 0.1  # measured 0.59


if __name__ == "__main__":
    print(json.dumps(_tp_child(sys.argv[1])))
