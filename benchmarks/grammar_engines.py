"""Which grammar engine: llguidance vs xgrammar on our tokenizers (compile time, per-token mask).

Run: python benchmarks/grammar_engines.py [--xgrammar-path DIR] --out FILE.json
xgrammar is optional (it is not a dependency; install it with --target DIR to compare).
For each tokenizer and each grammar: compile time (cold, tokenizer already prepared), then a
walk over a valid answer's tokens computing the token mask before each token (mean/p99 us).
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bb", "ccc"]},
                 "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "zip": {"type": ["string", "null"]}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "tags", "address"],
}
ANSWER = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["a", "ccc"],
                     "address": {"city": "London", "zip": None}})


def tokenizers():
    from jaxserve.loaders.model_loader import load_tokenizer
    from jaxserve.testing.tiny_model import train_tokenizer
    out = {"tiny-bpe-512": train_tokenizer(512)}
    try:
        from jaxserve.loaders.gguf import default_model_path
        out["SmolLM2-135M-Instruct"] = load_tokenizer(default_model_path())
    except Exception as e:  # pragma: no cover
        print("no SmolLM2 tokenizer:", e, file=sys.stderr)
    return out


def bench_llguidance(tok, ids):
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lln
    t0 = time.perf_counter()
    lt = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    g = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    m = llguidance.LLMatcher(lt, g)
    t_compile = time.perf_counter() - t0
    assert not m.is_error(), m.get_error()
    mask = lln.allocate_token_bitmask(1, len(tok))
    times = []
    for t in ids:
        t0 = time.perf_counter()
        lln.fill_next_token_bitmask(m, mask, 0)
        times.append(time.perf_counter() - t0)
        assert (mask[0, t // 32] >> (t % 32)) & 1, "valid token masked out"
        assert m.consume_token(t), m.get_error()
    return t_tok, t_compile, times


def bench_xgrammar(tok, ids):
    import torch
    import xgrammar as xgr
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    comp = xgr.GrammarCompiler(info, cache_enabled=False)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    cg = comp.compile_json_schema(json.dumps(SCHEMA))
    m = xgr.GrammarMatcher(cg)
    t_compile = time.perf_counter() - t0
    mask = xgr.allocate_token_bitmask(1, len(tok))
    times = []
    for t in ids:
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(mask, 0)
        times.append(time.perf_counter() - t0)
        assert (int(mask[0, t // 32]) >> (t % 32)) & 1, "valid token masked out"
        assert m.accept_token(t)
    del torch
    return t_tok, t_compile, times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--xgrammar-path")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.xgrammar_path:
        sys.path.append(a.xgrammar_path)
    res = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
           "python": platform.python_version(), "machine": platform.processor() or platform.machine(),
           "schema": SCHEMA, "answer": ANSWER, "results": []}
    import llguidance
    res["llguidance"] = llguidance.__version__
    engines = {"llguidance": bench_llguidance}
    try:
        import xgrammar
        from importlib.metadata import version
        res["xgrammar"] = version("xgrammar")
        engines["xgrammar"] = bench_xgrammar
    except ImportError as e:
        print("xgrammar not importable:", e, file=sys.stderr)
    for tname, tok in tokenizers().items():
        ids = tok.encode(ANSWER, add_special_tokens=False)
        for ename, fn in engines.items():
            t_tok, t_comp, times = fn(tok, ids)
            us = np.array(times) * 1e6
            r = {"tokenizer": tname, "vocab": len(tok), "engine": ename,
                 "tokenizer_prep_s": round(t_tok, 4), "compile_ms": round(t_comp * 1e3, 2),
                 "mask_us_mean": round(float(us.mean()), 1),
                 "mask_us_p50": round(float(np.median(us)), 1),
                 "mask_us_p99": round(float(np.percentile(us, 99)), 1), "tokens": len(ids)}
            print(json.dumps(r))
            res["results"].append(r)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
