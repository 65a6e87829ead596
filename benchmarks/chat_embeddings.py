"""Embeddings under a concurrent chat load: one decoder, one engine, both at once.

The generative engine embeds (a decoder's final hidden state at each input's last token,
``engine/decoder_pooling.py``) in the same steps as it decodes chats. Three timed phases on the
same engine, each after a warm pass:

- chat alone: ``--chats`` requests (a ~40-token prompt, ``--max-tokens`` greedy tokens each)
- embeddings alone: ``--docs`` documents (mixed 8-200 words, seeded)
- both at once: the same chats and documents submitted together

Reported: chat output tokens/s and embedded documents/s in each phase, the mixed phase's rates
as a fraction of each alone (the baselines of the same run), per-request chat latency, and when
each kind finished: neither starves if both progress through the mixed phase (the embeddings
do not wait for the chats to end, nor the chats for the embeddings).

    python benchmarks/chat_embeddings.py --result-dir benchmarks/results/cpu-chat-embeddings-2026-11-28
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from common import add_output_args, bar_plot, result_path, run_metadata, write_json
from embeddings import WORDS


def documents(n: int, seed: int = 1) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.choice([8, 16, 32, 64, 120, 200])))
            for _ in range(n)]


def run_phase(engine, chats, docs, sp, pp) -> dict:
    """Submit everything, step until done; per kind: finish times (s since start) and tokens."""
    t0 = time.perf_counter()
    for i, c in enumerate(chats):
        engine.add_request(f"c{i}", c, sp)
    for i, d in enumerate(docs):
        engine.add_request(f"d{i}", d, pp)
    done, first_doc, chat_tokens = {}, None, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id.startswith("d") and first_doc is None:
                first_doc = time.perf_counter() - t0
            if o.finished:
                done[o.request_id] = time.perf_counter() - t0
                if o.request_id.startswith("c"):
                    chat_tokens += len(o.outputs[0].token_ids)
    chat_t = [v for k, v in done.items() if k.startswith("c")]
    doc_t = [v for k, v in done.items() if k.startswith("d")]
    out = dict(wall_s=time.perf_counter() - t0)
    if chat_t:
        out.update(chat_end_s=max(chat_t), chat_latency_p50_s=statistics.median(chat_t),
                   chat_tokens=chat_tokens, chat_tokens_per_s=chat_tokens / max(chat_t))
    if doc_t:
        out.update(docs_end_s=max(doc_t), first_doc_s=first_doc,
                   docs_per_s=len(doc_t) / max(doc_t))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a decoder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--chats", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--docs", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=1024)
    add_output_args(p)
    args = p.parse_args()

    from jaxserve import LLM
    from jaxserve.core.pooling_params import PoolingParams
    from jaxserve.core.sampling_params import SamplingParams

    llm = LLM(args.model, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len)
    engine = llm.llm_engine
    rng = random.Random(0)
    chats = [" ".join(rng.choice(WORDS) for _ in range(30)) + ". Tell me more."
             for _ in range(args.chats)]
    docs = documents(args.docs)
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    pp = PoolingParams(task="embed")
    run_phase(engine, chats[:4], docs[:8], sp, pp)  # warm: every bucket the phases touch
    phases = {}
    for name, c, d in (("chat alone", chats, []), ("embeddings alone", [], docs),
                       ("both at once", chats, docs)):
        engine.reset_prefix_cache()  # each phase computes its documents from scratch
        phases[name] = run_phase(engine, c, d, sp, pp)
        print(name, {k: round(v, 3) for k, v in phases[name].items()})
    mixed = phases["both at once"]
    chat_frac = mixed["chat_tokens_per_s"] / phases["chat alone"]["chat_tokens_per_s"]
    doc_frac = mixed["docs_per_s"] / phases["embeddings alone"]["docs_per_s"]
    stats = engine.stats()
    result = dict(
        benchmark="chat_embeddings", **run_metadata(), model=str(llm.config.model),
        chats=args.chats, max_tokens=args.max_tokens, docs=args.docs,
        max_num_seqs=args.max_num_seqs, phases=phases,
        mixed_chat_fraction_of_alone=chat_frac, mixed_docs_fraction_of_alone=doc_frac,
        # both kinds progress together: the first document ends before the chats end, the
        # chats end before the last document (or the reverse): neither waits for the other
        interleaved=bool(mixed["first_doc_s"] < mixed["chat_end_s"]),
        num_compiles=stats["num_compiles"],
        note="one in-process engine; the mixed phase's two rates add up to the step budget "
             "the scheduler shares between decode rows and prefill chunks (FCFS by arrival, "
             "chats submitted first); a 2-core CPU shared with other jobs",
    )
    path = result_path("chat_embeddings", args)
    write_json(path, result)
    if not args.no_plot:
        bar_plot(os.path.splitext(path)[0] + ".png",
                 ["chat output tokens / s", "documents embedded / s"],
                 {"alone": [phases["chat alone"]["chat_tokens_per_s"],
                            phases["embeddings alone"]["docs_per_s"]],
                  "both at once": [mixed["chat_tokens_per_s"], mixed["docs_per_s"]]},
                 ylabel="per second",
                 title=f"chat + embeddings on one engine ({result['device']}): "
                       f"{chat_frac:.2f}x / {doc_frac:.2f}x of alone")
    print(f"mixed: chat {chat_frac:.2f}x of alone, embeddings {doc_frac:.2f}x of alone; "
          f"first document at {mixed['first_doc_s']:.2f} s, chats done at "
          f"{mixed['chat_end_s']:.2f} s; {path}")


if __name__ == "__main__":
    main()
