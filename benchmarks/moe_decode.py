"""Decode throughput of a Mixtral-shaped MoE model against the dense model of its active size.

Both models get dummy weights of the preset's shapes (``--num-layers`` cuts the depth so the
MoE model fits one GPU: 8 layers of Mixtral-8x7B are 11.6B parameters, 23 GB in bf16) and the
same requests: at each batch size B, B prompts of ``--input-len`` random tokens, greedy,
``ignore_eos``, ``--output-len`` tokens each. The dense twin (``presets.dense_twin``) has the same
attention and an MLP ``top_k`` experts wide: a token costs the same FLOPs, and at batch 1 the
same weight bytes. Decode tokens/s come from the requests' token times (from the last first
token to the last token of the batch). The bound beside each number is the bytes a decode step
must read (weights, the experts the batch touches in expectation, KV) at the copy bandwidth
measured in the same run.

    python benchmarks/moe_decode.py                      # GPU: Mixtral-8x7B shape, 8 layers
    python benchmarks/moe_decode.py --overrides '{"hidden_size": 256, "intermediate_size": 512,
        "num_attention_heads": 4, "num_key_value_heads": 2}' --num-layers 2   # a CPU smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common as C  # noqa: E402

DEFAULT_DIR = os.path.join(C.RESULTS_DIR, "moe-decode")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", default="mixtral-8x7b")
    p.add_argument("--num-layers", type=int, default=8, help="decoder layers of both models")
    p.add_argument("--overrides", default="{}", help="JSON config fields for both models "
                   "(e.g. smaller widths for a CPU run)")
    p.add_argument("--batch-sizes", default="1,8,32,128")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--min-token-bucket", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    C.add_output_args(p)
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if min(args.batch_sizes) < 1 or args.output_len < 2 or args.input_len < 1:
        p.error("batch sizes and --input-len must be >= 1, --output-len >= 2")
    args.result_dir = args.result_dir or DEFAULT_DIR
    return args


def configs(args) -> dict[str, dict]:
    from jaxserve.testing.presets import dense_twin, preset_config

    moe = preset_config(args.preset)
    moe.update(json.loads(args.overrides), num_hidden_layers=args.num_layers)
    if not (moe.get("num_local_experts") or moe.get("num_experts")):
        raise SystemExit(f"preset {args.preset!r} is not a MoE model")
    return {"moe": moe, "dense": dense_twin(moe)}


def weight_bytes(cfg: dict, nbytes: int, experts_read: float | None = None) -> float:
    """Bytes of the weights a decode step reads: every non-expert weight, and ``experts_read``
    experts per layer (default: all of them)."""
    h, v, n = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    heads, kvh = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg[
        "num_attention_heads"]
    d = cfg.get("head_dim") or h // heads
    attn = 2 * h * heads * d + 2 * h * kvh * d
    e = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    if e:
        i = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
        mlp = (e if experts_read is None else experts_read) * 3 * h * i + h * e
    else:
        mlp = 3 * h * cfg["intermediate_size"]
    head = 0 if cfg.get("tie_word_embeddings") else v * h
    return nbytes * (n * (attn + mlp + 2 * h) + v * h + h + head)


def experts_touched(cfg: dict, batch: int) -> float:
    """Expected experts per layer a batch of ``batch`` tokens routes to, each picking ``top_k``
    of ``E`` uniformly (dummy weights route close to uniformly)."""
    e = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    k = cfg.get("num_experts_per_tok", 2)
    return e * (1.0 - (1.0 - k / e) ** batch)


def kv_bytes(cfg: dict, nbytes: int, tokens: float) -> float:
    heads = cfg["num_attention_heads"]
    kvh = cfg.get("num_key_value_heads") or heads
    d = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return 2 * cfg["num_hidden_layers"] * kvh * d * nbytes * tokens


def run_model(name: str, cfg: dict, args, bandwidth: float) -> dict:
    import numpy as np

    from jaxserve import LLM, SamplingParams
    from jaxserve.testing.presets import write_preset

    model_dir = write_preset(args.preset, os.path.join(tempfile.mkdtemp(prefix="moe-bench-"),
                                                       name), config=cfg)
    max_b = max(args.batch_sizes)
    block = 16
    max_len = -(-(args.input_len + args.output_len) // block) * block
    kw = dict(load_format="dummy", dtype=args.dtype, max_model_len=max_len, max_num_seqs=max_b,
              gpu_memory_utilization=args.gpu_memory_utilization, seed=args.seed,
              max_num_batched_tokens=args.max_num_batched_tokens,
              min_token_bucket=args.min_token_bucket,
              num_gpu_blocks_override=args.num_gpu_blocks_override)
    t0 = time.perf_counter()
    llm = LLM(model_dir, **{k: v for k, v in kw.items() if v is not None})
    start_s = time.perf_counter() - t0
    dtype = np.dtype(llm.llm_engine.dtype)
    nbytes = dtype.itemsize
    rng = np.random.default_rng(args.seed)
    vocab = cfg["vocab_size"]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    rows = []
    for b in args.batch_sizes:
        prompts = [{"prompt_token_ids": rng.integers(10, vocab, args.input_len).tolist()}
                   for _ in range(b)]
        outs = llm.generate(prompts, params, use_tqdm=False)
        first = max(o.metrics.first_token_time for o in outs)
        last = max(o.metrics.last_token_time for o in outs)
        tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
        if any(len(o.outputs[0].token_ids) != args.output_len for o in outs):
            raise RuntimeError(f"{name}: a request did not generate {args.output_len} tokens")
        tok_s = tokens / max(last - first, 1e-9)
        read = experts_touched(cfg, b) if name == "moe" else None
        step_bytes = weight_bytes(cfg, nbytes, read) + kv_bytes(
            cfg, nbytes, b * (args.input_len + args.output_len / 2))
        bound = b * bandwidth / step_bytes if bandwidth else None
        rows.append(dict(batch=b, decode_tok_s=tok_s, step_ms=1e3 * b / tok_s,
                         experts_per_layer=read, bytes_per_step=step_bytes,
                         bound_tok_s=bound, of_bound=(tok_s / bound) if bound else None))
        print(f"{name:5s} B={b:4d}: {tok_s:10.1f} decode tok/s"
              + (f" ({100 * tok_s / bound:.0f} % of the {bound:.0f} tok/s bound)" if bound
                 else ""), flush=True)
    del llm
    return dict(start_s=start_s, dtype=str(dtype), total_weight_bytes=weight_bytes(cfg, nbytes),
                active_weight_bytes=weight_bytes(
                    cfg, nbytes, cfg.get("num_experts_per_tok", 2) if name == "moe" else None),
                rows=rows)


def plot(path: str, result: dict) -> None:
    groups = [f"B={r['batch']}" for r in result["models"]["moe"]["rows"]]
    series = {name: [r["decode_tok_s"] for r in m["rows"]]
              for name, m in result["models"].items()}
    C.bar_plot(path, groups, series, ylabel="decode tokens/s",
               title=f"{result['config']['preset']} x{result['config']['num_layers']} layers vs "
                     f"dense twin ({result['device']})")


def main(argv=None) -> dict:
    args = parse_args(argv)
    cfgs = configs(args)
    bw = C.measure_copy_bandwidth()
    bandwidth = float(bw["bandwidth_bytes_per_s"])
    models = {name: run_model(name, cfg, args, bandwidth) for name, cfg in cfgs.items()}
    ratio = [m["decode_tok_s"] / d["decode_tok_s"]
             for m, d in zip(models["moe"]["rows"], models["dense"]["rows"])]
    result = dict(benchmark="moe_decode", **C.run_metadata(),
                  config=dict(preset=args.preset, num_layers=args.num_layers,
                              overrides=json.loads(args.overrides), batch_sizes=args.batch_sizes,
                              input_len=args.input_len, output_len=args.output_len),
                  copy_bandwidth=bw, models=models, configs=cfgs,
                  moe_vs_dense=dict(zip(map(str, args.batch_sizes), ratio)))
    for b, r in zip(args.batch_sizes, ratio):
        print(f"B={b}: MoE / dense decode = {r:.2f}x")
    path = C.write_json(C.result_path("moe_decode", args), result)
    if not args.no_plot:
        plot(path[:-5] + ".png", result)
    print(f"-> {path}")
    return result


if __name__ == "__main__":
    main()
