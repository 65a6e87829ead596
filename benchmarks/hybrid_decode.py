"""Decode step time against context length: a Qwen3.6-27B-shaped hybrid (3 Gated DeltaNet
layers in 4, a fixed-size recurrent state each) against its all-attention twin (every layer
gated full attention, everything else equal).

Both models get dummy weights of the same shape and the same requests: at each context length
L, ``--batch`` prompts of L random tokens, greedy, ``ignore_eos``, ``--output-len`` tokens each;
the decode step time is (last token - first token) / (output_len - 1) over the batch. Reported
beside it: KV bytes per context token of each model (the page pools' sizes: the hybrid pages only
its attention layers, so 1/4 of the twin's), the hybrid's state bytes per request (constant in
L), and the slope of step time against context (a least-squares line over the contexts), whose
ratio hybrid / twin should be about the ratio of attention layers (1/4; the issue asks <= 1/3).

    python benchmarks/hybrid_decode.py                   # CPU: a scaled-down shape, 512 -> 4k
    python benchmarks/hybrid_decode.py --shape 27b --quantization fp8 \\
        --contexts 1024,2048,4096,8192,16384,32768       # one H100 (tools/gpu_run.sh "hybrid")

The 27B shape is Qwen3.6-27B's text stack as its config.json describes it (64 layers, hidden
5120, 24 query / 4 KV heads of 256 on the attention layers, 16 key / 48 value heads of 128 on the
GDN layers, MLP 17408, vocab 248320); the weights are random, only the shapes matter.
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

DEFAULT_DIR = os.path.join(C.RESULTS_DIR, "hybrid-decode")

_TEXT = dict(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text",
             hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False,
             attention_bias=False, linear_conv_kernel_dim=4, bos_token_id=1, eos_token_id=2,
             initializer_range=0.02, torch_dtype="bfloat16")
SHAPES = {
    "27b": dict(_TEXT, vocab_size=248320, hidden_size=5120, intermediate_size=17408,
                num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                linear_value_head_dim=128, max_position_embeddings=262144,
                rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                 "partial_rotary_factor": 0.25}),
    "cpu": dict(_TEXT, vocab_size=1024, hidden_size=256, intermediate_size=512,
                num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                linear_value_head_dim=32, max_position_embeddings=65536,
                rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                 "partial_rotary_factor": 0.25}),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="default: 27b on an accelerator, cpu otherwise")
    p.add_argument("--num-layers", type=int, default=None, help="cut the depth (a multiple of 4)")
    p.add_argument("--contexts", default=None, help="comma-separated context lengths "
                   "(default 1024..32768 for 27b, 512..4096 for cpu)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default=None, help="e.g. fp8 (weights)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--token-bucket-growth", type=int, default=None,
                   help="ladder ratio between token buckets (default on an accelerator: 128, "
                        "i.e. a decode bucket and the budget's: each bucket of a 64-layer "
                        "shape is a long compile)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    C.add_output_args(p)
    args = p.parse_args(argv)
    args.shape = args.shape or ("27b" if C.on_accelerator() else "cpu")
    default = "1024,2048,4096,8192,16384,32768" if args.shape == "27b" else "512,1024,2048,4096"
    args.contexts = [int(c) for c in (args.contexts or default).split(",")]
    if args.output_len < 2 or args.batch < 1 or len(args.contexts) < 2:
        p.error("--output-len >= 2, --batch >= 1 and at least two contexts")
    args.result_dir = args.result_dir or DEFAULT_DIR
    return args


def configs(args) -> dict[str, dict]:
    hybrid = json.loads(json.dumps(SHAPES[args.shape]))
    if args.num_layers:
        if args.num_layers % 4:
            raise SystemExit("--num-layers must be a multiple of 4 (3 GDN + 1 attention)")
        hybrid["num_hidden_layers"] = args.num_layers
    n = hybrid["num_hidden_layers"]
    hybrid["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                             for i in range(n)]
    twin = dict(hybrid, layer_types=["full_attention"] * n)
    return {"hybrid": hybrid, "twin": twin}


def write_shape(shape: str, mtp: bool = False, out_dir: str | None = None,
                num_layers: int | None = None) -> str:
    """A model directory (config + tokenizer, no weights: serve it with ``load_format
    dummy``) of the hybrid ``shape``; ``mtp``: with a one-layer MTP head (speculative decoding
    with method ``mtp``); ``num_layers``: cut the depth (a multiple of 4)."""
    from jaxserve.testing.presets import write_preset

    cfg = configs(argparse.Namespace(shape=shape, num_layers=num_layers))["hybrid"]
    if mtp:
        cfg["mtp_num_hidden_layers"] = 1
    depth = f"-{num_layers}l" if num_layers else ""
    out = out_dir or os.path.join(tempfile.mkdtemp(prefix="hybrid-shape-"),
                                  f"qwen3.6-{shape}{depth}{'-mtp' if mtp else ''}")
    return write_preset("qwen3.6", out, config=cfg)


def slope(xs, ys) -> float:
    """Least-squares slope of ys against xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def run_model(name: str, cfg: dict, args) -> dict:
    import numpy as np

    from jaxserve import LLM, SamplingParams
    from jaxserve.core.kv_cache_spec import state_bytes_per_slot
    from jaxserve.testing.presets import write_preset

    model_dir = write_preset(name, os.path.join(tempfile.mkdtemp(prefix="hybrid-bench-"), name),
                             config=cfg)
    block = 16
    max_len = -(-(max(args.contexts) + args.output_len) // block) * block
    kw = dict(load_format="dummy", dtype=args.dtype, max_model_len=max_len,
              max_num_seqs=args.batch, gpu_memory_utilization=args.gpu_memory_utilization,
              seed=args.seed, quantization=args.quantization, enable_prefix_caching=False,
              max_num_batched_tokens=args.max_num_batched_tokens,
              min_token_bucket=16 if not C.on_accelerator() else None,
              token_bucket_growth=args.token_bucket_growth or (
                  128 if C.on_accelerator() else None),
              enforce_eager=not C.on_accelerator(), block_size=block)
    t0 = time.perf_counter()
    llm = LLM(model_dir, **{k: v for k, v in kw.items() if v is not None})
    start_s = time.perf_counter() - t0
    print(f"{name:6s} engine up in {start_s:.1f} s", flush=True)
    runner = llm.llm_engine.runner
    page = runner.pools[0].page_bytes(block)
    rng = np.random.default_rng(args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    # one untimed round: every bucket the timed rounds use compiles here
    llm.generate([{"prompt_token_ids": rng.integers(10, 500, min(args.contexts)).tolist()}
                  for _ in range(args.batch)], params, use_tqdm=False)
    print(f"{name:6s} warm-up round done at {time.perf_counter() - t0:.1f} s", flush=True)
    rows = []
    for ctx in args.contexts:
        prompts = [{"prompt_token_ids": rng.integers(10, 500, ctx).tolist()}
                   for _ in range(args.batch)]
        outs = llm.generate(prompts, params, use_tqdm=False)
        first = max(o.metrics.first_token_time for o in outs)
        last = max(o.metrics.last_token_time for o in outs)
        step_ms = 1e3 * (last - first) / (args.output_len - 1)
        rows.append(dict(context=ctx, step_ms=step_ms))
        print(f"{name:6s} context {ctx:6d}: decode step {step_ms:8.2f} ms "
              f"(batch {args.batch})", flush=True)
    del llm
    return dict(start_s=start_s, kv_bytes_per_token=page / block,
                state_bytes_per_request=state_bytes_per_slot(runner.cache_groups),
                attention_layers=len(runner.pools[0].layers),
                slope_ms_per_1k_tokens=1e3 * slope([r["context"] for r in rows],
                                                   [r["step_ms"] for r in rows]),
                rows=rows)


def plot(path: str, result: dict) -> None:
    plt = C.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, m in result["models"].items():
        ax.plot([r["context"] for r in m["rows"]], [r["step_ms"] for r in m["rows"]], "o-",
                label=f"{name} ({m['attention_layers']} attention layers, "
                      f"{m['kv_bytes_per_token'] / 1024:.1f} KiB KV/token)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(f"decode step (ms), batch {result['config']['batch']}")
    ax.set_title(f"Qwen3.6 {result['config']['shape']} shape: hybrid vs all-attention twin "
                 f"({result['device']})", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    models = {name: run_model(name, cfg, args) for name, cfg in configs(args).items()}
    h, t = models["hybrid"], models["twin"]
    summary = dict(kv_bytes_per_token_ratio=h["kv_bytes_per_token"] / t["kv_bytes_per_token"],
                   slope_ratio=(h["slope_ms_per_1k_tokens"] / t["slope_ms_per_1k_tokens"]
                                if t["slope_ms_per_1k_tokens"] > 0 else None))
    meta = C.run_metadata()
    result = dict(benchmark="hybrid_decode", **meta,
                  config=dict(shape=args.shape, num_layers=configs(args)["hybrid"][
                      "num_hidden_layers"], contexts=args.contexts, batch=args.batch,
                      output_len=args.output_len, dtype=args.dtype,
                      quantization=args.quantization),
                  models=models, summary=summary)
    path = C.write_json(C.result_path("hybrid_decode", args), result)
    print(f"KV bytes per token, hybrid / twin: {summary['kv_bytes_per_token_ratio']:.3f}; "
          f"step-time slope, hybrid / twin: {summary['slope_ratio']}")
    if not args.no_plot:
        plot(path[:-len(".json")] + ".png", {**result, "device": meta.get("device", "")})
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
