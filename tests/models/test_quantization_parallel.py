"""Quantized weights under tensor parallelism (4 fake CPU devices): fp8 and GPTQ int4 params and
their scales are sharded with the Megatron specs (fp8's int8 tied embedding/LM head and its
per-row scales with the vocabulary), and greedy tokens at tp=2 equal tp=1.

The checks run in a child process started with ``--xla_force_host_platform_device_count=4``
(set before jax is imported); it prints one JSON document, the assertions are made here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 9, 13, 21, 34], [100, 200, 300], [42, 43, 44, 45, 46, 47, 48]]
ENGINE_KW = dict(dtype="float32", max_model_len=128, num_gpu_blocks_override=64,
                 max_num_seqs=4, max_num_batched_tokens=32, min_token_bucket=32)
WATCH = ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj",
         "model.layers.0.mlp.down_proj", "model.embed_tokens")


def _child(cases: dict) -> dict:
    import jax
    from flax import nnx

    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.entrypoints.llm import LLM

    assert len(jax.devices()) == 4
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    report = {}
    for name, (path, quant, lm_head) in cases.items():
        for tp in (1, 2):
            llm = LLM(path, quantization=quant, lm_head_quantized=lm_head,
                      tensor_parallel_size=tp, **ENGINE_KW)
            model = llm.llm_engine.model
            shards = {}
            for key, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
                dotted = ".".join(map(str, key))
                if dotted.rsplit(".", 1)[0] in WATCH:
                    arr = var.get_value()
                    shards[dotted] = dict(
                        shape=list(arr.shape), dtype=str(arr.dtype),
                        shard=sorted({tuple(s.data.shape) for s in arr.addressable_shards}))
            outs = llm.generate(PROMPTS, sp, use_tqdm=False)
            report[f"{name}-tp{tp}"] = dict(tokens=[list(o.outputs[0].token_ids) for o in outs],
                                            shards=shards)
            del llm, model
    return report


@pytest.fixture(scope="module")
def report(tiny_model_factory, tmp_path_factory):
    from jaxserve.testing.int4_checkpoint import write_int4_checkpoint

    src = tiny_model_factory("llama", init_std=0.1, heads=8, kv_heads=4)
    gptq = tmp_path_factory.mktemp("gptq") / "gptq"
    write_int4_checkpoint(src, gptq, "gptq", group_size=32)
    tied = tiny_model_factory("llama", init_std=0.1, heads=8, kv_heads=4, tie_embeddings=True)
    cases = {"fp8": (str(src), "fp8", False), "gptq": (str(gptq), None, False),
             "fp8-head": (str(tied), "fp8", True)}
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__, json.dumps(cases)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fp8", "gptq", "fp8-head"])
def test_tp2_greedy_equals_tp1(report, method):
    assert report[f"{method}-tp2"]["tokens"] == report[f"{method}-tp1"]["tokens"]


@pytest.mark.slow
def test_fp8_weights_and_scales_are_sharded(report):
    s = report["fp8-tp2"]["shards"]
    q, o = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj"
    out, inp = s[q + ".weight"]["shape"]
    assert s[q + ".weight"]["dtype"] == "float8_e4m3fn"
    assert s[q + ".weight"]["shard"] == [[out // 2, inp]]  # column parallel: rows split
    assert s[q + ".weight_scale"]["shard"] == [[out // 2]]  # ... and their scales with them
    out, inp = s[o + ".weight"]["shape"]
    assert s[o + ".weight"]["shard"] == [[out, inp // 2]]  # row parallel: input columns split
    assert s[o + ".weight_scale"]["shard"] == [[out]]  # per-output scales replicated
    assert report["fp8-tp1"]["shards"][q + ".weight"]["shard"] == [s[q + ".weight"]["shape"]]


@pytest.mark.slow
def test_quantized_tied_table_and_row_scales_shard_with_the_vocabulary(report):
    s = report["fp8-head-tp2"]["shards"]
    e = "model.embed_tokens"
    vocab, hidden = s[e + ".weight"]["shape"]
    assert s[e + ".weight"]["dtype"] == "int8"
    assert s[e + ".weight"]["shard"] == [[vocab // 2, hidden]]
    assert s[e + ".weight_scale"]["shard"] == [[vocab // 2]]
    assert report["fp8-tp2"]["shards"][e + ".weight"]["dtype"] == "float32"  # not asked


@pytest.mark.slow
def test_int4_packed_weights_and_scales_are_sharded(report):
    s = report["gptq-tp2"]["shards"]
    q, d = "model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"
    out, half = s[q + ".qweight"]["shape"]
    assert s[q + ".qweight"]["dtype"] == "uint8"
    assert s[q + ".qweight"]["shard"] == [[out // 2, half]]
    assert s[q + ".scales"]["shard"][0][0] == out // 2
    out, half = s[d + ".qweight"]["shape"]
    groups = s[d + ".scales"]["shape"][1]
    assert s[d + ".qweight"]["shard"] == [[out, half // 2]]  # row parallel: packed inputs split
    assert s[d + ".scales"]["shard"] == [[out, groups // 2]]  # ... with their groups


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))))
