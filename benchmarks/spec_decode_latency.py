"""Speculative decoding against plain decoding, same model, same prompts, same run.

Run through ``benchmarks/latency.py --speculative-config JSON`` (see its docstring). Two engines
are built with identical settings but for ``speculative_config``; each batch size runs the same
greedy batch on both, timed alternately, and records the median latency, the speed-up, the mean
acceptance length (tokens per verify step) and whether every output is identical.
"""
from __future__ import annotations

import json
import os
import statistics
import time

from benchmarks import baselines as B

# Passages are slices of this file set (real source text, varied per request).
_SOURCES = ("jaxserve/core/spec_decode.py", "jaxserve/core/block_manager.py",
            "jaxserve/core/scheduler.py", "jaxserve/core/request.py")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _passages(n: int, lines: int = 14) -> list[str]:
    text = []
    for f in _SOURCES:
        with open(os.path.join(_ROOT, f)) as fh:
            src = [ln for ln in fh.read().splitlines() if ln.strip()]
        text += ["\n".join(src[i:i + lines]) for i in range(20, len(src) - lines, lines)]
    return [text[i % len(text)] for i in range(n)]


def _prompts(kind: str, n: int, tokenizer, vocab: int, input_len: int, seed: int) -> list:
    if kind == "random":
        reqs = B.random_requests(n, input_len, 1, vocab, seed=seed)
        return [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    from jaxserve.engine.tokenizer import apply_chat_template
    out = []
    for p in _passages(n):
        msg = ("Repeat the following Python code exactly, but rename the variable `req` to "
               f"`request`. Output only the code.\n\n```python\n{p}\n```")
        ids = apply_chat_template(tokenizer, [{"role": "user", "content": msg}], True, None)
        out.append({"prompt_token_ids": list(ids)})
    return out


def run_spec_comparison(args) -> dict:
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.entrypoints.llm import LLM

    spec = json.loads(args.speculative_config)
    sizes = [int(x) for x in (args.batch_sizes or str(args.batch_size)).split(",")]
    if args.model is None and args.preset is None:
        from jaxserve.loaders.gguf import default_model_path
        model = str(default_model_path())
    else:
        model = B.resolve_model(args.model, args.preset)
    kw = dict(dtype=args.dtype, seed=args.seed, max_num_seqs=args.max_num_seqs or max(sizes),
              max_model_len=args.max_model_len or 1024, block_size=args.block_size)
    for k in ("max_num_batched_tokens", "num_gpu_blocks_override", "min_token_bucket",
              "token_bucket_growth", "load_format"):
        if getattr(args, k, None) is not None:
            kw[k] = getattr(args, k)
    if args.preset and "load_format" not in kw:
        kw["load_format"] = "dummy"

    t0 = time.perf_counter()
    base = LLM(model, **kw)
    t_base = time.perf_counter() - t0
    t0 = time.perf_counter()
    fast = LLM(model, speculative_config=spec, **kw)
    t_spec = time.perf_counter() - t0
    tok = base.get_tokenizer()
    vocab = base.llm_engine.model_config.vocab_size
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                        detokenize=not args.disable_detokenize)
    compiles0 = {id(x): x.llm_engine.runner.num_compiles for x in (base, fast)}

    rows = []
    path = B.result_path("latency-spec", args, tag=f"-{args.spec_prompt}")

    def result() -> dict:
        return dict(benchmark="latency-speculative", **B.run_metadata(),
                    config=dict(vars(args), model=model, engine_kwargs=kw),
                    speculative_config=spec, engine_init_s=dict(base=t_base, spec=t_spec),
                    compiles_after_warmup={
                        n: x.llm_engine.runner.num_compiles - compiles0[id(x)]
                        for n, x in (("base", base), ("spec", fast))},
                    results=rows)

    for bs in sizes:
        prompts = _prompts(args.spec_prompt, bs, tok, vocab, args.input_len, args.seed)
        lat = {"base": [], "spec": []}
        dec = {"base": [], "spec": []}  # after the last prompt's first token: decode only
        outs = {}
        st = fast.llm_engine.spec_stats
        drafts0, acc0, dt0 = st.num_drafts, st.num_accepted_tokens, st.num_draft_tokens
        for it in range(args.num_iters_warmup + args.num_iters):
            for name, llm in (("base", base), ("spec", fast)):
                t = time.perf_counter()
                res = llm.generate(prompts, sp, use_tqdm=False)
                dt = time.perf_counter() - t
                outs[name] = [o.outputs[0].token_ids for o in res]
                if it >= args.num_iters_warmup:
                    lat[name].append(dt)
                    dec[name].append(max(o.metrics.last_token_time for o in res)
                                     - max(o.metrics.first_token_time for o in res))
        n_drafts = st.num_drafts - drafts0
        row = dict(
            batch_size=bs,
            prompt_tokens_mean=statistics.mean(len(p["prompt_token_ids"]) for p in prompts),
            base_latency_s=statistics.median(lat["base"]), spec_latency_s=statistics.median(
                lat["spec"]), base_latencies=lat["base"], spec_latencies=lat["spec"],
            base_decode_s=statistics.median(dec["base"]),
            spec_decode_s=statistics.median(dec["spec"]),
            outputs_identical=outs["base"] == outs["spec"],
            num_drafts=n_drafts, num_draft_tokens=st.num_draft_tokens - dt0,
            num_accepted_tokens=st.num_accepted_tokens - acc0,
            mean_acceptance_length=1 + (st.num_accepted_tokens - acc0) / max(1, n_drafts),
        )
        row["speedup"] = row["base_latency_s"] / row["spec_latency_s"]
        row["decode_speedup"] = row["base_decode_s"] / max(row["spec_decode_s"], 1e-9)
        row["spec_output_tokens_per_s"] = bs * args.output_len / row["spec_latency_s"]
        row["base_output_tokens_per_s"] = bs * args.output_len / row["base_latency_s"]
        rows.append(row)
        print(f"batch {bs}: plain {row['base_latency_s']:.2f} s, speculative "
              f"{row['spec_latency_s']:.2f} s, speed-up {row['speedup']:.2f}x (decode phase "
              f"{row['decode_speedup']:.2f}x), acceptance "
              f"length {row['mean_acceptance_length']:.2f}, identical {row['outputs_identical']}")
        B.write_result(path, result())  # partial results survive an interrupted run

    res = result()
    if not args.no_plot:
        res["plot"] = _plot(path[:-5] + ".png", rows, spec, args)
    B.write_result(path, res)
    print(f"wrote {path}")
    return res


def _plot(path, rows, spec, args) -> str:
    plt = B.plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [str(r["batch_size"]) for r in rows]
    w = 0.38
    idx = range(len(rows))
    a1.bar([i - w / 2 for i in idx], [r["speedup"] for r in rows], w, label="end to end")
    a1.bar([i + w / 2 for i in idx], [r["decode_speedup"] for r in rows], w,
           label="decode phase")
    a1.set_xticks(list(idx), xs)
    a1.axhline(1.0, color="gray", ls="--")
    a1.legend(loc="lower left", fontsize=8)
    for i, r in enumerate(rows):
        top = max(r["speedup"], r["decode_speedup"])
        a1.text(i, top, f"acc len {r['mean_acceptance_length']:.2f}", ha="center",
                va="bottom", fontsize=8)
    a1.set_xlabel("batch size")
    a1.set_ylabel("speed-up (plain / speculative latency)")
    a1.set_title(f"{spec.get('method')} k={spec.get('num_speculative_tokens')}, "
                 f"{args.spec_prompt} prompts")
    a2.bar([i - w / 2 for i in idx], [r["base_output_tokens_per_s"] for r in rows], w,
           label="plain")
    a2.bar([i + w / 2 for i in idx], [r["spec_output_tokens_per_s"] for r in rows], w,
           label="speculative")
    a2.set_xticks(list(idx), xs)
    a2.set_xlabel("batch size")
    a2.set_ylabel("output tokens/s")
    a2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
