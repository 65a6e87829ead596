"""Tensor parallelism on 8 fake CPU devices: greedy outputs equal tp=1, and the params and the KV
pool are really sharded.

The checks run in a child process started with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (set before jax is imported), so the rest
of the suite keeps its single device. The child prints one JSON document; the assertions are
made here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["The capital of France is", "Hello world, my name",
           "one two three four five six seven eight nine ten eleven twelve thirteen"]
MAX_TOKENS = 10
ENGINE_KW = dict(max_num_batched_tokens=32, min_token_bucket=32, max_num_seqs=4,
                 max_model_len=128, dtype="float32")
# family -> tiny model overrides (8 query heads so tp=4 and tp=8 split them) and the tp sizes
CASES = {
    "llama": (dict(heads=8, kv_heads=4), [1, 2, 4]),
    "mistral": (dict(heads=8, kv_heads=2), [1, 2, 4]),
    "qwen2": (dict(heads=8, kv_heads=4), [1, 2, 4]),
    "qwen3": (dict(heads=8, kv_heads=2, head_dim=16), [1, 2, 4, 8]),  # tp=8 > 2 KV heads
}
# (backend, tp) runs beyond "xla" at every tp: the jnp reference, and the Pallas kernel
# (interpret mode on CPU, head_dim 16) per shard, incl. repeated KV heads at tp=8
EXTRA_RUNS = {"llama": [("reference", 2)], "qwen3": [("pallas", 8)]}


def _shard_shapes(arr) -> list:
    return sorted({tuple(s.data.shape) for s in arr.addressable_shards})


def _spec(arr) -> list:
    return [a if a is None or isinstance(a, str) else list(a) for a in arr.sharding.spec]


def _orbax_vs_safetensors(src: str, orbax_dir: str) -> dict:
    """Both loads on a tp=2 mesh: every param bit-equal, with the same sharding."""
    import numpy as np
    from flax import nnx

    from jaxserve.loaders.model_loader import load_model
    from jaxserve.sharding import make_mesh

    mesh = make_mesh(2)
    flat = lambda m: {".".join(map(str, k)): v.get_value()  # noqa: E731
                      for k, v in nnx.to_flat_state(nnx.split(m)[1])}
    a = flat(load_model(src, dtype="float32", mesh=mesh)[0])
    b = flat(load_model(orbax_dir, dtype="float32", mesh=mesh, load_format="orbax")[0])
    return dict(
        same_names=sorted(a) == sorted(b),
        unequal=[k for k in a if not np.array_equal(np.asarray(a[k]), np.asarray(b[k]))],
        sharding_differs=[k for k in a if a[k].sharding != b[k].sharding
                          or _shard_shapes(a[k]) != _shard_shapes(b[k])],
        sharded=sum(len(_shard_shapes(v)) == 1 and list(_shard_shapes(v)[0]) != list(v.shape)
                    for v in b.values()))


def _child(cases: dict, orbax_dir: str | None = None) -> dict:
    """Run every (family, tp, backend) case; report tokens, shardings and compile counts."""
    import jax

    from jaxserve.entrypoints.llm import LLM
    from jaxserve.errors import InvalidRequestError
    from jaxserve.core.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = {"num_devices": len(jax.devices()), "runs": []}
    for family, (path, runs) in cases.items():
        for backend, tp in runs:
            llm = LLM(path, tensor_parallel_size=tp, attention_backend=backend, **ENGINE_KW)
            eng = llm.llm_engine
            runner = eng.runner
            warmup_compiles = runner.num_compiles
            res = llm.generate(PROMPTS, sp, use_tqdm=False)
            layer = eng.model.model.layers[0]
            attn = layer.self_attn
            params = {
                "q_proj": attn.q_proj.weight.get_value(),
                "k_proj": attn.k_proj.weight.get_value(),
                "o_proj": attn.o_proj.weight.get_value(),
                "up_proj": layer.mlp.up_proj.weight.get_value(),
                "down_proj": layer.mlp.down_proj.weight.get_value(),
                "embed": eng.model.model.embed_tokens.weight.get_value(),
                "norm": eng.model.model.norm.weight.get_value(),
            }
            k_pages = runner.kv_pages[0][0]
            out["runs"].append(dict(
                family=family, tp=tp, backend=backend,
                tokens=[list(r.outputs[0].token_ids) for r in res],
                mesh_devices=len(eng.mesh.devices.flat) if eng.mesh is not None else 1,
                params={k: dict(shape=list(v.shape), spec=_spec(v),
                                shards=_shard_shapes(v), n=len(v.addressable_shards))
                        for k, v in params.items()},
                kv=dict(shape=list(k_pages.shape), spec=_spec(k_pages),
                        shards=_shard_shapes(k_pages), n=len(k_pages.addressable_shards)),
                compiles_after_warmup=runner.num_compiles - warmup_compiles,
            ))
            del llm, eng, runner
    if orbax_dir:
        out["orbax"] = _orbax_vs_safetensors(next(iter(cases.values()))[0], orbax_dir)
    errors = {}
    path = next(iter(cases.values()))[0]
    for tp in (3, 16):  # 3 does not divide 8 heads; 16 > 8 devices
        try:
            LLM(path, tensor_parallel_size=tp, **ENGINE_KW)
            errors[tp] = None
        except InvalidRequestError as e:
            errors[tp] = [e.param, str(e)]
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def report(tiny_model_factory, tmp_path_factory):
    from jaxserve.entrypoints.cli import main

    cases = {}
    for family, (overrides, tps) in CASES.items():
        path = str(tiny_model_factory(family, init_std=0.1, **overrides))
        cases[family] = (path, [("xla", tp) for tp in tps] + EXTRA_RUNS.get(family, []))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    orbax_dir = tmp_path_factory.mktemp("orbax") / "llama"
    assert main(["convert", cases["llama"][0], str(orbax_dir), "--dtype", "float32"]) == 0
    proc = subprocess.run([sys.executable, __file__, json.dumps(cases), str(orbax_dir)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _runs(report, **where):
    return [r for r in report["runs"] if all(r[k] == v for k, v in where.items())]


@pytest.mark.parametrize("family", list(CASES))
def test_greedy_outputs_equal_tp1(report, family):
    assert report["num_devices"] == 8
    runs = _runs(report, family=family)
    base = _runs(report, family=family, tp=1, backend="xla")[0]["tokens"]
    assert all(len(t) == MAX_TOKENS for t in base)
    assert len(set(map(tuple, base))) > 1  # the prompts give different continuations
    assert {(r["backend"], r["tp"]) for r in runs} == (
        {("xla", tp) for tp in CASES[family][1]} | set(EXTRA_RUNS.get(family, [])))
    for r in runs:
        assert r["mesh_devices"] == r["tp"]
        assert r["tokens"] == base, (r["tp"], r["backend"])


@pytest.mark.parametrize("family", list(CASES))
def test_params_and_kv_pool_are_sharded(report, family):
    overrides = CASES[family][0]
    hkv = overrides["kv_heads"]
    for r in _runs(report, family=family):
        tp, p, kv = r["tp"], r["params"], r["kv"]
        if tp == 1:
            continue
        q, k, o = p["q_proj"], p["k_proj"], p["o_proj"]
        assert q["spec"] == ["tp", None] and q["n"] == tp
        assert q["shards"] == [[q["shape"][0] // tp, q["shape"][1]]]  # column parallel
        assert p["up_proj"]["shards"] == [[p["up_proj"]["shape"][0] // tp,
                                           p["up_proj"]["shape"][1]]]
        assert o["spec"] == [None, "tp"]  # row parallel
        assert o["shards"] == [[o["shape"][0], o["shape"][1] // tp]]
        assert p["down_proj"]["spec"] == [None, "tp"]
        emb = p["embed"]  # vocab parallel
        assert emb["spec"] == ["tp", None] and emb["shards"] == [[emb["shape"][0] // tp,
                                                                 emb["shape"][1]]]
        assert p["norm"]["spec"] == [] and p["norm"]["shards"] == [p["norm"]["shape"]]
        pool_heads = max(hkv, tp)  # tp > KV heads: each KV head repeated onto its devices
        assert kv["shape"][0] == pool_heads and kv["spec"] == ["tp"] and kv["n"] == tp
        assert kv["shards"] == [[pool_heads // tp] + kv["shape"][1:]]
        if tp <= hkv:
            assert k["spec"] == ["tp", None] and k["shards"] == [[k["shape"][0] // tp,
                                                                 k["shape"][1]]]
        else:
            assert k["spec"] == [] and k["shards"] == [k["shape"]]
        assert r["compiles_after_warmup"] == 0  # the pool keeps its sharding step to step


def test_orbax_restores_into_the_tp_mesh_bit_for_bit(report):
    o = report["orbax"]
    assert o["same_names"] and o["unequal"] == [] and o["sharding_differs"] == []
    assert o["sharded"] >= 7  # q/k/v/o/gate/up/down of each layer, embedding, head


def test_bad_tensor_parallel_sizes_name_the_field(report):
    for tp in ("3", "16"):
        param, msg = report["errors"][tp]
        assert param == "tensor_parallel_size" and f"tensor_parallel_size={tp}" in msg


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None)))
