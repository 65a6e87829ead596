"""Multi-LoRA output throughput: 0, 1, 4 and 8 random rank-16 adapters mixed evenly in the
batch, against the base model (an engine without LoRA) in the same run.

Every adapter case runs on one LoRA engine (``max_loras`` = the largest count, so all its
adapters sit in device slots and the step graph is the same for every mix); requests are
spread round-robin over the case's adapters (0: the LoRA engine serving the base model). Each
case is timed ``--repeats`` times, interleaved with the base engine, and the best run is kept
(the CPU machines are shared). The ratio is adapter throughput / base throughput.
Because whole-generate timings swing with the machine's load, the same cases are also timed
one decode step at a time (``--step-iters`` steps of ``--num-prompts`` decoding rows per case,
interleaved; the fastest step is kept): ``step_ratio_to_base``.

    JAX_PLATFORMS=cpu python benchmarks/lora.py [--model M | --preset llama3-8b]
        [--counts 0 1 4 8] [--rank 16]
        [--targets q_proj v_proj] [--num-prompts 16 --input-len 32 --output-len 32]
        [--result-dir benchmarks/results/cpu-lora-2026-11-25]

The default model is SmolLM2-135M-Instruct (the engine's default); ``--targets`` defaults to
PEFT's own default for Llama models (q_proj, v_proj); ``--targets all`` adapts every projection.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (add_output_args, bar_plot, result_path, run_metadata,  # noqa: E402
                               write_json)

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--preset", default=None,
                   help="a real model shape with dummy weights (e.g. llama3-8b, on a GPU)")
    p.add_argument("--counts", type=int, nargs="+", default=[0, 1, 4, 8])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", nargs="+", default=["q_proj", "v_proj"])
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--min-token-bucket", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--step-iters", type=int, default=30, help="0: no step timing")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--load-format", default="auto")
    add_output_args(p)
    args = p.parse_args(argv)
    if args.targets == ["all"]:
        args.targets = ALL_TARGETS
    return args


def _engine_kw(args) -> dict:
    return dict(dtype=args.dtype, max_model_len=args.input_len + args.output_len + 16,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                min_token_bucket=args.min_token_bucket,
                tensor_parallel_size=args.tensor_parallel_size, load_format=args.load_format)


def _throughput(llm, prompts, sp, loras) -> dict:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, lora_request=loras, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(generated_tokens=n, seconds=elapsed, output_tok_per_s=n / elapsed)


def _step_times(base, lora, args, adapters) -> dict[str, list[float]]:
    """Seconds per decode step of ``num_prompts`` rows (one token each, at the prompt's end),
    adapters round-robin over the rows; the cases interleaved step by step."""
    from jaxserve.core.batch_diff import BatchDiff, NewRequestData
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.worker.input_batch import InputBatch

    rows_n = min(args.num_prompts, args.max_num_seqs)
    pages = -(-(args.input_len + 1) // lora.llm_engine.config.cache.block_size)

    def plan(runner, k):
        """Row i: its own pages, adapter id ``i % k + 1`` in device slot ``i % k``."""
        batch = InputBatch.for_runner(runner, seed=0)
        ids = [f"row-{i}" for i in range(rows_n)]
        batch.apply(BatchDiff(new_reqs=[
            NewRequestData(rid, [0] * args.input_len + [100 + i], args.input_len,
                           SamplingParams(temperature=0.0),
                           [list(range(1 + pages * i, 1 + pages * (i + 1)))],
                           lora_int_id=(i % k) + 1 if k else 0)
            for i, rid in enumerate(ids)]))
        return batch.prepare_inputs(BatchDiff(
            req_ids=ids, num_tokens=[1] * rows_n, token_ids=[100 + i for i in range(rows_n)],
            start_pos=[args.input_len] * rows_n, sample=[True] * rows_n,
            num_draft=[0] * rows_n, num_output=[0] * rows_n),
            ladder=runner.ladder, lora_slots={j + 1: j for j in range(k)})

    lora.llm_engine.lora_manager.prepare(adapters)  # every adapter in its slot: slot = index
    cases = {"base": (base.llm_engine.runner, 0)}
    cases.update({f"lora-{c}": (lora.llm_engine.runner, c) for c in args.counts})
    plans = {n: plan(r, k) for n, (r, k) in cases.items()}
    times: dict[str, list[float]] = {n: [] for n in cases}
    for n, (r, _) in cases.items():
        r.execute(plans[n])
    for _ in range(args.step_iters):
        for n, (r, _) in cases.items():
            t0 = time.perf_counter()
            r.execute(plans[n])
            times[n].append(time.perf_counter() - t0)
    return times


def main(argv=None) -> dict:
    args = parse_args(argv)
    import numpy as np

    from jaxserve import LLM, LoRARequest, SamplingParams
    from jaxserve.loaders.peft import lora_targets
    from jaxserve.testing.lora_adapters import write_random_adapter

    max_loras = max(1, max(args.counts))
    if args.preset and not args.model:  # an explicit --model wins (a CPU check of the stage)
        from benchmarks.baselines import resolve_model

        args.model, args.load_format = resolve_model(None, args.preset), "dummy"
    base = LLM(args.model, **_engine_kw(args))
    lora = LLM(args.model, enable_lora=True, max_loras=max_loras, max_lora_rank=args.rank,
               **_engine_kw(args))
    shapes = lora_targets(lora.llm_engine.model).shapes
    tmp = tempfile.mkdtemp(prefix="jaxserve-lora-bench-")
    adapters = [LoRARequest(f"bench-{i}", i + 1, str(write_random_adapter(
        os.path.join(tmp, f"a{i}"), shapes, r=args.rank, target_modules=args.targets, seed=i)))
        for i in range(max_loras)]
    rng = np.random.default_rng(0)
    vocab = lora.llm_engine.model_config.vocab_size
    prompts = [rng.integers(100, min(vocab, 40000), args.input_len).tolist()
               for _ in range(args.num_prompts)]
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    warm = SamplingParams(max_tokens=2, ignore_eos=True)
    base.generate(prompts[:2], warm, use_tqdm=False)
    for c in args.counts:  # every adapter into its slot once, so timing sees no disk read
        n = max(1, c)
        lora.generate([prompts[i % len(prompts)] for i in range(n)], warm, use_tqdm=False,
                      lora_request=[adapters[i % c] if c else None for i in range(n)])
    compiles = lora.llm_engine.runner.num_compiles
    runs: dict[str, list[dict]] = {"base": []}
    for _ in range(args.repeats):
        runs["base"].append(_throughput(base, prompts, sp, None))
        for c in args.counts:
            loras = [adapters[i % c] if c else None for i in range(len(prompts))]
            runs.setdefault(f"lora-{c}", []).append(_throughput(lora, prompts, sp, loras))
    steps = _step_times(base, lora, args, adapters) if args.step_iters else {}
    best = {k: max(v, key=lambda r: r["output_tok_per_s"]) for k, v in runs.items()}
    base_tps = best["base"]["output_tok_per_s"]
    cases = {k: dict(best=v, ratio_to_base=v["output_tok_per_s"] / base_tps,
                     all_runs=[r["output_tok_per_s"] for r in runs[k]]) for k, v in best.items()}
    for k, t in steps.items():
        cases[k].update(step_ms_min=1e3 * min(t), step_ms_median=1e3 * sorted(t)[len(t) // 2],
                        step_ratio_to_base=min(steps["base"]) / min(t))
    result = dict(
        benchmark="lora", meta=run_metadata(), model=args.model or "SmolLM2-135M-Instruct",
        preset=args.preset, rank=args.rank, targets=args.targets, counts=args.counts,
        max_loras=max_loras,
        num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        repeats=args.repeats, compiles_during_timing=lora.llm_engine.runner.num_compiles
        - compiles, cases=cases)
    path = write_json(result_path("lora", args), result)
    for k, v in cases.items():
        print(f"{k:>8}: {v['best']['output_tok_per_s']:8.1f} tok/s  x{v['ratio_to_base']:.3f}"
              + (f"  | decode step {v['step_ms_min']:.1f} ms x{v['step_ratio_to_base']:.3f}"
                 if "step_ms_min" in v else ""))
    if not args.no_plot:
        groups = list(cases)
        bar_plot(path[:-5] + ".png", groups,
                 {"output tok/s": [cases[g]["best"]["output_tok_per_s"] for g in groups]},
                 ylabel="output tokens/s",
                 title=f"{result['model']}: rank-{args.rank} adapters ({', '.join(args.targets)}) "
                       "vs base", hline=0.8 * base_tps, hline_label="0.8x base")
    print(path)
    return result


if __name__ == "__main__":
    main()
