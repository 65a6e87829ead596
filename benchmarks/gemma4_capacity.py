#!/usr/bin/env python
"""How many 32k-token Gemma 4 requests fit in a device's memory: KV cache groups (a pool per
group, sliding groups holding only their window) against one uniform pool (every layer at the
global shape, nothing freed early) and against one pool indexing every layer by the same page
ids (this engine's fallback), for the 31B and 26B-A4B shapes, fp8 weights and fp8 KV.

    python benchmarks/gemma4_capacity.py                       # arithmetic, 80 GB and 96 GB
    python benchmarks/gemma4_capacity.py --engine --preset gemma4-31b   # start the engine
    python benchmarks/gemma4_capacity.py --engine --tiny       # the same on CPU, tiny shape

Arithmetic: the weights' bytes come from the model built abstractly (dummy weights: shapes
only) with ``--quantization fp8``; the KV budget is ``0.95 * budget - weights - the runner's
activation reserve``; a sliding group also keeps one step's chunk headroom. ``--engine`` starts
``LLM(load_format="dummy", quantization="fp8", kv_cache_dtype="fp8", max_model_len=32768)`` and
reports the runner's own pools and "Maximum concurrency".
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (add_output_args, bar_plot, result_path,  # noqa: E402
                               run_metadata, write_json)

PRESETS = ("gemma4-31b", "gemma4-26b-a4b")
BUDGETS_GB = (80, 96)
MAX_MODEL_LEN = 32768
BLOCK = 16
MAX_NUM_SEQS = 8
MAX_BATCHED = 8192
UTILIZATION = 0.95


def weight_bytes(hf: dict) -> dict:
    """Parameter bytes of the model built abstractly, fp8-quantized linears (dummy weights)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxserve.config import ModelConfig
    from jaxserve.loaders.model_loader import _abstract_model, _quant_plan

    cfg = ModelConfig.from_hf_config(hf)
    model = _abstract_model(cfg, jnp.bfloat16, "xla", _quant_plan("fp8", cfg))
    _, state = nnx.split(model)
    leaves = jax.tree_util.tree_leaves(state)
    total = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves)
    params = sum(int(np.prod(x.shape)) for x in leaves)
    return dict(bytes=total, params=params)


def activation_reserve(hf: dict) -> int:
    """The runner's reserve beside the KV cache (``worker.kv_cache_config.activation_reserve``)."""
    act = 4 * MAX_BATCHED * (4 * hf["hidden_size"] + 3 * hf["intermediate_size"])
    act += 4 * 3 * min(MAX_BATCHED, MAX_NUM_SEQS) * hf["vocab_size"]
    return 2 * act + (256 << 20)


def capacity(name: str) -> dict:
    from jaxserve.core.kv_cache_spec import (group_layers, group_pools, kv_bytes_per_token,
                                             pooled_kv_bytes_per_token,
                                             uniform_kv_bytes_per_token)
    from jaxserve.models.gemma4 import cache_specs_of
    from jaxserve.testing.presets import preset_config

    hf = preset_config(name)
    groups = group_layers(cache_specs_of(hf, "float8_e4m3fn"))
    kw = dict(block_size=BLOCK, max_model_len=MAX_MODEL_LEN)
    per_token = dict(groups=kv_bytes_per_token(groups, **kw),
                     uniform=uniform_kv_bytes_per_token(groups),
                     one_pool=pooled_kv_bytes_per_token(groups, **kw))
    headroom = sum((-(-MAX_BATCHED // BLOCK) + MAX_NUM_SEQS) * p.page_bytes(BLOCK)
                   for p in group_pools(groups) if p.window is not None)
    w = weight_bytes(hf)
    out = dict(preset=name, weight_bytes=w["bytes"], params=w["params"],
               kv_bytes_per_token=per_token,
               groups=[dict(spec=repr(g.spec), layers=len(g.layers)) for g in groups],
               ratio_groups_to_uniform=per_token["groups"] / per_token["uniform"], budgets={})
    for gb in BUDGETS_GB:
        kv = UTILIZATION * gb * 1e9 - w["bytes"] - activation_reserve(hf)
        req = MAX_MODEL_LEN
        out["budgets"][f"{gb}GB"] = dict(
            kv_budget_bytes=kv,
            max_concurrency=dict(
                groups=max(0.0, (kv - headroom) / (per_token["groups"] * req)),
                uniform=max(0.0, kv / (per_token["uniform"] * req)),
                one_pool=max(0.0, kv / (per_token["one_pool"] * req))))
    return out


def engine(preset: str, tiny: bool) -> dict:
    """Start the engine (dummy weights) and read its pools and concurrency figure."""
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.testing.presets import preset_config, write_preset

    hf = preset_config(preset)
    if tiny:  # the same layer pattern at a CPU-sized shape
        hf.update(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                  num_global_key_value_heads=1, sliding_window=64,
                  layer_types=hf["layer_types"][:5] + ["full_attention"])
        if hf.get("enable_moe_block"):
            hf.update(num_experts=4, top_k_experts=2, moe_intermediate_size=32)
    d = write_preset(preset, tempfile.mkdtemp(prefix="gemma4-"), hf)
    llm = LLM(d, load_format="dummy", dtype="bfloat16", quantization="fp8",
              kv_cache_dtype="fp8", max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
              enable_prefix_caching=True, gpu_memory_utilization=UTILIZATION,
              enforce_eager=True)
    r = llm.llm_engine.runner
    return dict(preset=preset, tiny=tiny, grouped=r.grouped, pool_pages=list(r.pool_pages),
                kv_bytes_per_token=r.kv_bytes_per_token, max_concurrency=r.max_concurrency,
                pools=[dict(window=p.window, page_bytes=p.page_bytes(BLOCK)) for p in r.pools])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", action="store_true", help="start the engine, read its pools")
    ap.add_argument("--preset", default="gemma4-31b", choices=PRESETS)
    ap.add_argument("--tiny", action="store_true", help="--engine at a CPU-sized shape")
    add_output_args(ap)
    args = ap.parse_args(argv)
    if args.engine:
        res = dict(kind="gemma4_capacity_engine", **run_metadata(),
                   result=engine(args.preset, args.tiny))
        print(res["result"])
        print(write_json(result_path("gemma4_capacity_engine", args), res))
        return 0
    rows = [capacity(n) for n in PRESETS]
    for r in rows:
        t = r["kv_bytes_per_token"]
        print(f"{r['preset']}: weights {r['weight_bytes'] / 1e9:.1f} GB; KV bytes/token at "
              f"{MAX_MODEL_LEN}: groups {t['groups']:.0f}, uniform {t['uniform']:.0f}, "
              f"one pool {t['one_pool']:.0f} (groups/uniform {r['ratio_groups_to_uniform']:.1%})")
        for b, v in r["budgets"].items():
            c = v["max_concurrency"]
            print(f"  {b}: max concurrent {MAX_MODEL_LEN}-token requests: groups "
                  f"{c['groups']:.1f}, uniform {c['uniform']:.1f}, one pool {c['one_pool']:.1f}")
    res = dict(kind="gemma4_capacity", **run_metadata(), max_model_len=MAX_MODEL_LEN,
               block_size=BLOCK, utilization=UTILIZATION, weights="fp8", kv_cache_dtype="fp8",
               note="shapes as assumed in jaxserve/testing/presets.py; --quantization fp8 "
                    "covers the Linear layers only: the MoE experts stay bf16",
               results=rows)
    path = write_json(result_path("gemma4_capacity", args), res)
    print(path)
    if not args.no_plot:
        cases = [f"{r['preset']}\n{b}" for r in rows for b in r["budgets"]]
        series = {k: [r["budgets"][b]["max_concurrency"][k] for r in rows for b in r["budgets"]]
                  for k in ("groups", "uniform", "one_pool")}
        print(bar_plot(path[:-5] + ".png", cases, series,
                       ylabel=f"max concurrent {MAX_MODEL_LEN}-token requests",
                       title="Gemma 4, fp8 weights + fp8 KV: cache groups vs one pool"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
