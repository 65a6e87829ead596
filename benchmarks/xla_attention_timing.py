"""CPU timing of the XLA ragged paged attention against the jnp reference (one layer).

SmolLM2-135M shapes: 9 query / 3 KV heads, head_dim 64, page 16, block tables of width 128
(max_model_len 2048). Cases: single-sequence prefill, decode batches, a mixed step.

    JAX_PLATFORMS=cpu python benchmarks/xla_attention_timing.py [--out results/x.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import reference, xla_attention

HQ, HKV, D, PAGE, M = 9, 3, 64, 16, 128


def make_case(q_lens, ctx_lens, t_bucket, s_bucket, dtype, seed=0):
    rng = np.random.default_rng(seed)
    n_pages = 1 + sum(-(-c // PAGE) for c in ctx_lens)
    kp = jnp.asarray(rng.standard_normal((HKV, n_pages, PAGE, D)), dtype)
    vp = jnp.asarray(rng.standard_normal((HKV, n_pages, PAGE, D)), dtype)
    q = jnp.asarray(rng.standard_normal((t_bucket, HQ, D)), dtype)
    qs = np.zeros(s_bucket + 1, np.int32)
    qs[1:len(q_lens) + 1] = np.cumsum(q_lens)
    qs[len(q_lens) + 1:] = sum(q_lens)
    sl = np.zeros(s_bucket, np.int32)
    sl[:len(ctx_lens)] = ctx_lens
    bt = np.zeros((s_bucket, M), np.int32)
    perm = rng.permutation(np.arange(1, n_pages))
    k = 0
    for i, c in enumerate(ctx_lens):
        n = -(-c // PAGE)
        bt[i, :n] = perm[k:k + n]
        k += n
    return (q, kp, vp, jnp.asarray(qs), jnp.asarray(sl), jnp.asarray(bt), np.int32(len(q_lens)))


def bench(fn, args, reps):
    out = fn(*args)
    out.block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only", default="", help="run cases whose name contains this")
    ap.add_argument("--no-reference", action="store_true")
    args = ap.parse_args()
    sm = 1.0 / np.sqrt(D)
    cases = []
    for n in (128, 256, 512):  # single-sequence prefill; S bucket = min(T, 256)
        cases.append((f"prefill {n}", [n], [n], n, min(n, 256)))
    for n_seqs in (1, 8, 32):
        for ctx in (100, 500, 2000):
            t = max(16, n_seqs)
            cases.append((f"decode {n_seqs}x ctx{ctx}", [1] * n_seqs, [ctx] * n_seqs, t, t))
    cases.append(("mixed 31 decodes ctx500 + prefill 481", [1] * 31 + [481], [500] * 31 + [481],
                  512, 256))
    results = []
    for name, q_lens, ctx_lens, t, s in cases:
        if args.only not in name:
            continue
        case = make_case(q_lens, ctx_lens, t, s, jnp.float32)
        row = dict(case=name, T=t, S=s)
        for loop, short in (("auto", xla_attention.SHORT_QUERY), ("token", 10**9),
                            ("sequence", 0)):
            f = jax.jit(lambda *a, short=short: xla_attention.attention(
                *a, sm_scale=sm, short_query=short))
            row[f"xla_{loop}_ms"], out = bench(f, case, args.reps)
            row[f"xla_{loop}_ms"] *= 1e3
        # The reference materialises T x S x (M*PAGE) scores: skip it where that is > ~2 GB.
        if not args.no_reference and t * s * M * PAGE * HQ * 4 * 3 < 2e9:
            f = jax.jit(lambda *a: reference.ragged_paged_attention(*a, sm_scale=sm))
            row["reference_ms"], ref = bench(f, case, max(1, args.reps // 2))
            row["reference_ms"] *= 1e3
            row["max_abs_diff"] = float(jnp.max(jnp.abs(out - ref)))
        else:
            row["reference_ms"] = None
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=str(jax.devices()[0]), jax=jax.__version__,
                           machine=platform.processor() or platform.machine(),
                           date=time.strftime("%Y-%m-%d"), results=results), f, indent=1)


if __name__ == "__main__":
    main()
