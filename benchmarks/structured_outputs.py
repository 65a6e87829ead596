"""Cost of structured outputs: tokens/s with a JSON-schema grammar against unconstrained decoding,
in the same run, at 1 and 32 concurrent requests, plus the grammar compile time.

    python benchmarks/structured_outputs.py --result-dir benchmarks/results/cpu-structured-2026-11-23

The model is a random-weight tiny Llama with SmolLM2's real tokenizer and vocabulary (49152):
the mask work is that of the default model (same vocabulary, same tokenizer trie) while the
model itself is small, so the grammar's share of a step is larger than with a real model (a
pessimistic measurement). Every request decodes exactly ``--max-tokens`` tokens (``ignore_eos``
and a schema whose answers are longer than that), so both modes count the same tokens.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import add_output_args, bar_plot, result_path, run_metadata, write_json  # noqa: E402

RECORD = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "tags", "active", "address"],
          "properties": {
              "name": {"type": "string", "maxLength": 12},
              "age": {"type": "integer", "minimum": 0, "maximum": 120},
              "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                       "minItems": 1, "maxItems": 3},
              "active": {"type": "boolean"},
              "address": {"type": "object", "additionalProperties": False,
                          "required": ["city", "zip"],
                          "properties": {"city": {"type": "string", "maxLength": 10},
                                         "zip": {"type": ["string", "null"],
                                                 "pattern": "^[0-9]{5}$"}}}}}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["records"],
          "properties": {"records": {"type": "array", "items": RECORD, "minItems": 64}}}


def build_model(out_dir: str) -> str:
    from jaxserve.loaders.gguf import default_model_path
    from jaxserve.loaders.model_loader import load_tokenizer
    from jaxserve.testing.tiny_model import make_tiny_model

    tok = load_tokenizer(default_model_path())
    d = make_tiny_model("llama", out_dir, vocab=len(tok), layers=4, hidden=256, heads=4,
                        kv_heads=2, intermediate=512, max_position=1024)
    tok.save_pretrained(d)
    return str(d)


def run(llm, n: int, constrained: bool, max_tokens: int, repeats: int) -> dict:
    from jaxserve import SamplingParams, StructuredOutputsParams

    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    rates, texts = [], None
    for r in range(repeats):
        params = [SamplingParams(temperature=1.0, seed=1000 * r + i, max_tokens=max_tokens,
                                 ignore_eos=True, structured_outputs=so) for i in range(n)]
        prompts = [f"Request {i}: list the records as JSON." for i in range(n)]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        toks = sum(len(o.outputs[0].token_ids) for o in outs)
        assert toks == n * max_tokens, (toks, n * max_tokens)
        rates.append(toks / dt)
        texts = [o.outputs[0].text for o in outs]
    if constrained:  # every answer is a prefix of a valid document: starts like one
        head = '{"records":[{"name":"'
        assert all(t[:len(head)] == head[:len(t)] for t in texts), texts
    return {"tokens_per_s": statistics.median(rates), "runs_tokens_per_s": rates,
            "sample_text": texts[0][:200]}


def compile_times(llm, n: int) -> dict:
    """Cold compile (validate + build the matcher) of ``n`` distinct schemas, and a cached one."""
    from jaxserve import StructuredOutputsParams

    mgr = llm.llm_engine.structured
    cold = []
    for i in range(n):
        schema = {**SCHEMA, "properties": {"records": {**SCHEMA["properties"]["records"],
                                                       "minItems": 64 + i + 1}}}
        spec = StructuredOutputsParams(json=schema)
        t0 = time.perf_counter()
        g = mgr.grammar_for(spec)
        g.matcher  # noqa: B018 - waits for the pool
        cold.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    mgr.grammar_for(spec).matcher  # noqa: B018
    cached = time.perf_counter() - t0
    return {"cold_ms_median": 1e3 * statistics.median(cold), "cold_ms_max": 1e3 * max(cold),
            "cached_ms": 1e3 * cached, "n": n}


def mask_time(llm, rows: int, steps: int) -> dict:
    """Host time to fill the bitmask of ``rows`` constrained rows, per step."""
    import numpy as np

    from jaxserve import StructuredOutputsParams

    mgr = llm.llm_engine.structured
    gs = [mgr.grammar_for(StructuredOutputsParams(json=SCHEMA)) for _ in range(rows)]
    rng = np.random.default_rng(0)
    times = []
    for _ in range(steps):
        bm = mgr.new_bitmask(rows)
        t0 = time.perf_counter()
        mgr.fill_bitmask(list(enumerate(gs)), bm)
        times.append(time.perf_counter() - t0)
        for i, g in enumerate(gs):  # advance each by a random allowed token
            bits = np.unpackbits(bm[i].view(np.uint8), bitorder="little")[: mgr.vocab_size]
            g.accept(int(rng.choice(np.flatnonzero(bits))))
    return {"rows": rows, "ms_per_step_median": 1e3 * statistics.median(times),
            "ms_per_step_p90": 1e3 * float(np.percentile(times, 90))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--repeats", type=int, default=2)
    add_output_args(ap)
    args = ap.parse_args()

    import llguidance

    from jaxserve import LLM

    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(os.path.join(tmp, "tiny-smollm2-vocab"))
        max_seqs = max(args.concurrency)
        llm = LLM(model, dtype="float32", max_model_len=512, max_num_seqs=max_seqs,
                  max_num_batched_tokens=256, min_token_bucket=32)
        result = {"benchmark": "structured_outputs", **run_metadata(),
                  "llguidance": llguidance.__version__, "schema": SCHEMA,
                  "model": "random tiny Llama (4 layers, hidden 256) with SmolLM2's tokenizer, "
                           "vocab 49152", "max_tokens": args.max_tokens,
                  "async_scheduling": llm.llm_engine.async_scheduling, "cases": []}
        run(llm, 2, True, 8, 1)  # first constrained step paths, off the clock
        compiles0 = llm.llm_engine.runner.num_compiles
        for n in args.concurrency:
            free = run(llm, n, False, args.max_tokens, args.repeats)
            json_ = run(llm, n, True, args.max_tokens, args.repeats)
            cost = 1 - json_["tokens_per_s"] / free["tokens_per_s"]
            case = {"concurrency": n, "unconstrained": free, "json_schema": json_,
                    "throughput_cost": cost}
            print(f"concurrency {n}: unconstrained {free['tokens_per_s']:.1f} tok/s, "
                  f"json schema {json_['tokens_per_s']:.1f} tok/s, cost {100 * cost:.1f} %",
                  flush=True)
            result["cases"].append(case)
        result["compile"] = compile_times(llm, 8)
        result["mask_fill"] = mask_time(llm, max_seqs, 16)
        result["compiles_during_runs"] = llm.llm_engine.runner.num_compiles - compiles0
        print("compile", result["compile"], "mask", result["mask_fill"], flush=True)
    path = result_path("structured_outputs", args)
    write_json(path, result)
    if not args.no_plot:
        groups = [f"{c['concurrency']} concurrent" for c in result["cases"]]
        bar_plot(path.replace(".json", ".png"), groups,
                 {"unconstrained": [c["unconstrained"]["tokens_per_s"] for c in result["cases"]],
                  "JSON schema": [c["json_schema"]["tokens_per_s"] for c in result["cases"]]},
                 ylabel="generated tokens / s",
                 title="Structured outputs (llguidance) vs unconstrained, CPU, same run")
    print("wrote", path)


if __name__ == "__main__":
    main()
