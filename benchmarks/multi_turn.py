#!/usr/bin/env python
"""Multi-turn chat against a small device KV pool: the prefix cache's host tier
(``--kv-offloading-size``) on vs off, in one run.

vLLM's multi-turn benchmark shape (benchmarks/multi_turn in vLLM): C conversations of T turns,
each turn's prompt is the whole history so far (the previous prompt, the previous answer and a
new user message), served round-robin over the conversations (turn t of every conversation,
then turn t + 1), one request at a time (one client), greedy, EOS ignored. The device pool is
sized to ``--device-fraction`` of the working set (every conversation's final history), so
without the host tier a conversation's history is evicted before its next turn comes; with it,
the history comes back from host memory. Per turn: the prefix-cache hit rate (cached prompt
tokens / prompt tokens, device and host hits together) and TTFT p50 / p90 (arrival to first
token), for both engines; the run records the targets (hit rate >= 0.8 with the tier, TTFT p50
>= 2x better) and whether they were met.

    JAX_PLATFORMS=cpu python benchmarks/multi_turn.py                 # random llama, CPU
    python benchmarks/multi_turn.py --model PATH --conversations 32 --turns 10   # a GPU run

The default model is a random-weight llama (``--hidden``, ``--layers``: big enough that a
prompt's prefill costs more than one step's overhead on a CPU); outputs are compared between
the two engines (greedy: they must be equal).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from benchmarks.common import (RESULTS_DIR, pyplot, run_metadata,  # noqa: E402
                               write_json)


def conversations(n: int, first: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab, first).tolist() for _ in range(n)]


def run(llm, histories, turns: int, user: int, out_len: int, vocab: int, seed: int) -> dict:
    """Round-robin over the conversations, turn by turn; per request (turn, TTFT, prompt
    tokens, cached tokens, output ids)."""
    from jaxserve import SamplingParams

    rng = np.random.default_rng(seed + 1)
    sp = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    hist = [list(h) for h in histories]
    rows = []
    for t in range(turns):
        for c in range(len(hist)):
            t0 = time.perf_counter()
            o = llm.generate([hist[c]], sp, use_tqdm=False)[0]
            m = o.metrics
            ttft = (m.first_token_time - m.arrival_time) if m and m.first_token_time else None
            rows.append(dict(turn=t, conversation=c, prompt_tokens=len(hist[c]),
                             cached_tokens=o.num_cached_tokens, ttft_s=ttft,
                             latency_s=time.perf_counter() - t0,
                             output=list(o.outputs[0].token_ids)))
            hist[c] = hist[c] + list(o.outputs[0].token_ids) \
                + rng.integers(100, vocab, user).tolist()
    return rows


def per_turn(rows: list[dict], turns: int) -> list[dict]:
    out = []
    for t in range(turns):
        r = [x for x in rows if x["turn"] == t]
        ttft = np.asarray([x["ttft_s"] for x in r], float)
        out.append(dict(turn=t, hit_rate=sum(x["cached_tokens"] for x in r)
                        / sum(x["prompt_tokens"] for x in r),
                        ttft_p50_s=float(np.percentile(ttft, 50)),
                        ttft_p90_s=float(np.percentile(ttft, 90))))
    return out


def summary(rows: list[dict]) -> dict:
    later = [x for x in rows if x["turn"] > 0]
    ttft = np.asarray([x["ttft_s"] for x in rows], float)
    ttft_later = np.asarray([x["ttft_s"] for x in later], float)
    return dict(
        hit_rate=sum(x["cached_tokens"] for x in rows) / sum(x["prompt_tokens"] for x in rows),
        hit_rate_after_first_turn=(sum(x["cached_tokens"] for x in later)
                                   / max(1, sum(x["prompt_tokens"] for x in later))),
        ttft_p50_s=float(np.percentile(ttft, 50)), ttft_p90_s=float(np.percentile(ttft, 90)),
        ttft_p50_after_first_turn_s=float(np.percentile(ttft_later, 50)) if later else None,
        ttft_p90_after_first_turn_s=float(np.percentile(ttft_later, 90)) if later else None,
        total_s=sum(x["latency_s"] for x in rows))


def plot(path: str, result: dict) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, label in (("off", "device pool only"), ("on", "with host tier")):
        pt = result["modes"][name]["per_turn"]
        turns = [p["turn"] + 1 for p in pt]
        axes[0].plot(turns, [p["hit_rate"] for p in pt], marker="o", label=label)
        axes[1].plot(turns, [p["ttft_p50_s"] * 1e3 for p in pt], marker="o",
                     label=f"{label} p50")
        axes[1].plot(turns, [p["ttft_p90_s"] * 1e3 for p in pt], marker="x", linestyle="--",
                     label=f"{label} p90")
    axes[0].axhline(0.8, color="k", linestyle=":", linewidth=1, label="target 0.8")
    axes[0].set(xlabel="turn", ylabel="prefix-cache hit rate (device + host)", ylim=(0, 1.05))
    axes[1].set(xlabel="turn", ylabel="TTFT (ms)")
    for ax in axes:
        ax.legend(fontsize=8)
    s = result["speedup_ttft_p50"]
    fig.suptitle(f"multi-turn, device pool {result['device_fraction']:.0%} of the working set: "
                 f"TTFT p50 {s:.2f}x, hit rate {result['modes']['on']['summary']['hit_rate']:.2f}"
                 f" vs {result['modes']['off']['summary']['hit_rate']:.2f} "
                 f"({result['device']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: a random llama)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--first-tokens", type=int, default=256, help="the first prompt's length")
    p.add_argument("--user-tokens", type=int, default=32, help="each later user message")
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--device-fraction", type=float, default=0.25,
                   help="device pool / working set (every conversation's final history)")
    p.add_argument("--offload-gib", type=float, default=None,
                   help="host tier size (default: twice the working set)")
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=None,
                   help="default benchmarks/results/cpu-offload-<date> (gpu-... on a GPU)")
    args = p.parse_args(argv)

    import jax

    from jaxserve import LLM

    platform = jax.devices()[0].platform
    model = args.model
    vocab = 512
    if model is None:
        from jaxserve.testing.tiny_model import make_tiny_model
        model = str(make_tiny_model(
            "llama", os.path.join(tempfile.mkdtemp(), "llama"), hidden=args.hidden,
            layers=args.layers, heads=8, kv_heads=4, intermediate=3 * args.hidden,
            vocab=vocab, max_position=4096))
    else:
        import json
        with open(os.path.join(model, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
    bs = args.block_size
    final = args.first_tokens + (args.turns - 1) * (args.user_tokens + args.output_tokens) \
        + args.output_tokens
    pages_per_conv = -(-final // bs)
    working = pages_per_conv * args.conversations
    # a conversation's last turn must fit the pool whole (+1: page 0, the trash page)
    device_pages = max(int(args.device_fraction * working), pages_per_conv + 2) + 1
    max_len = -(-(final + 1) // bs) * bs
    histories = conversations(args.conversations, args.first_tokens, vocab, args.seed)
    modes = {}
    for name in ("off", "on"):
        kw = dict(dtype=args.dtype, max_model_len=max_len, max_num_seqs=4,
                  max_num_batched_tokens=args.max_num_batched_tokens, block_size=bs,
                  num_gpu_blocks_override=device_pages, seed=args.seed)
        llm = LLM(model, **kw)
        if name == "on":
            page_bytes = llm.llm_engine.runner.page_bytes
            gib = args.offload_gib or 2 * working * page_bytes / 2**30
            del llm
            llm = LLM(model, kv_offloading_size=gib, **kw)
        rows = run(llm, histories, args.turns, args.user_tokens, args.output_tokens, vocab,
                   args.seed)
        stats = llm.llm_engine.stats()
        modes[name] = dict(
            summary=summary(rows), per_turn=per_turn(rows, args.turns),
            engine_stats={k: stats.get(k) for k in (
                "prefix_cache_queries", "prefix_cache_hits", "external_prefix_cache_queries",
                "external_prefix_cache_hits", "kv_offload_usage_perc", "num_preemptions",
                "num_compiles")},
            outputs=[r["output"] for r in rows], rows=[{k: v for k, v in r.items()
                                                       if k != "output"} for r in rows])
        if name == "on":
            modes[name]["offload_gib"] = gib
        print(name, modes[name]["summary"], flush=True)
        del llm
    on, off = modes["on"]["summary"], modes["off"]["summary"]
    speedup = off["ttft_p50_s"] / on["ttft_p50_s"]
    meta = run_metadata()
    result = dict(
        **meta, benchmark="multi_turn", model=args.model or "random llama",
        shape=dict(conversations=args.conversations, turns=args.turns,
                   first_tokens=args.first_tokens, user_tokens=args.user_tokens,
                   output_tokens=args.output_tokens, block_size=bs, hidden=args.hidden,
                   layers=args.layers, dtype=args.dtype,
                   max_num_batched_tokens=args.max_num_batched_tokens),
        working_set_pages=working, device_pages=device_pages - 1,
        device_fraction=(device_pages - 1) / working,
        speedup_ttft_p50=speedup,
        speedup_ttft_p50_after_first_turn=(off["ttft_p50_after_first_turn_s"]
                                           / on["ttft_p50_after_first_turn_s"]),
        outputs_equal=modes["on"]["outputs"] == modes["off"]["outputs"],
        targets=dict(hit_rate_with_offload=0.8, ttft_p50_speedup=2.0,
                     hit_rate_met=on["hit_rate"] >= 0.8, ttft_met=speedup >= 2.0),
        modes=modes)
    for m in modes.values():
        m.pop("outputs")
    date = meta["date"][:10]
    out_dir = args.out_dir or os.path.join(
        RESULTS_DIR, f"{'cpu' if platform == 'cpu' else 'gpu'}-offload-{date}")
    os.makedirs(out_dir, exist_ok=True)
    path = write_json(os.path.join(out_dir, "multi_turn.json"), result)
    plot(os.path.join(out_dir, "multi_turn.png"), result)
    print(f"TTFT p50 {speedup:.2f}x (off {off['ttft_p50_s'] * 1e3:.1f} ms, on "
          f"{on['ttft_p50_s'] * 1e3:.1f} ms); hit rate on {on['hit_rate']:.3f} off "
          f"{off['hit_rate']:.3f}; outputs equal: {result['outputs_equal']}; {path}")
    return result


if __name__ == "__main__":
    main()
