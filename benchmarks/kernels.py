"""Attention kernel benchmark: jaxserve's Pallas ragged paged attention vs JAX's own GPU ops.

Cases (GPU defaults; issue "Pallas ragged paged attention" / "GPU: attention kernel performance"):
  decode  B 64, 32 query / 8 KV heads, head_dim 128, page 16, bf16, ctx 512 / 2048 / 8192:
          time, KV bytes moved per second against the device copy bandwidth measured in the same
          run; baselines JAX `pallas.ops.gpu.paged_attention` (same page pool) and
          `decode_attention.gqa` (contiguous, unpaged KV: what a dense layout would give).
  mixed   4 prefill chunks of 512 tokens ending at a 2048 context (earlier context in pages)
          + 32 decodes at 2048, one call; bound = a dense attention with the chunks' FLOPs
          (`jax.nn.dot_product_attention`, cuDNN when available) + the decodes' KV bytes at copy
          bandwidth.
  gdn     Gated DeltaNet (Qwen3.5/3.6 linear layers; 16 key / 32 value heads of 128, bf16 q/k/v,
          float32 state pool): B decodes, prefill chunks continuing from a state, and a mix;
          the Pallas kernels and the XLA path, against the state-traffic bound (each real
          row's state read and written once + q/k/v/o at copy bandwidth).
  lora    multi-LoRA delta on a 4096x4096 projection (8 adapters of rank 16, bf16): scattered
          decode tokens (BGMV), prefill runs (SGMV) and a mix; base matmul alone vs base + the
          Pallas delta vs base + the XLA delta (throughput ratio to the base).
Every case checks the kernel against pallas_kernels/reference.py first (sub-batch when the
reference would not fit). ``--sweep`` times a grid of tile parameters per case and reports the
fastest (issue 11). On CPU (or ``--tiny``) it runs tiny shapes in interpret mode.

    python benchmarks/kernels.py                      # GPU, full sizes
    python benchmarks/kernels.py --tiny               # CPU smoke run (CI)
    python benchmarks/kernels.py --sweep --cases decode --ctx 2048
    python benchmarks/kernels.py --cases gdn,lora    # state-pool and LoRA kernels
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402

# Peak dense bf16 tensor FLOP/s (no sparsity) for the theoretical bound, by device_kind prefix.
PEAK_BF16_FLOPS = {"NVIDIA H100": 989e12, "NVIDIA H200": 989e12, "NVIDIA A100": 312e12}
TOL = {"float32": 1e-5, "bfloat16": 2e-2}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tiny", action="store_true",
                   help="tiny shapes in interpret mode (default when no accelerator)")
    p.add_argument("--cases", default="decode,mixed",
                   help="comma list of decode, mixed, gdn, lora")
    p.add_argument("--batch", type=int, default=64, help="decode sequences")
    p.add_argument("--ctx", default="512,2048,8192", help="decode context lengths")
    p.add_argument("--num-q-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3",
                                                                "fp8_e5m2"],
                   help="pages in --dtype (auto) or float8 with per-KV-head scales (vLLM's "
                        "flag); JAX's own baselines take no float8 pages and are skipped")
    p.add_argument("--mixed-chunks", type=int, default=4, help="prefill chunks in the mixed case")
    p.add_argument("--mixed-chunk-len", type=int, default=512)
    p.add_argument("--mixed-ctx", type=int, default=2048, help="context at the end of each chunk")
    p.add_argument("--mixed-decodes", type=int, default=32, help="decodes in the mixed case")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-baseline", action="store_true", help="skip JAX's ops and the dense bound")
    p.add_argument("--no-check", action="store_true", help="skip the reference check")
    p.add_argument("--tiles", default=None,
                   help='JSON dict of TileConfig overrides, e.g. \'{"decode_block_kv": 128}\'')
    p.add_argument("--backends", default=None,
                   help="comma list of pallas, mosaic, triton, timed side by side (default: all "
                        "three on a GPU, pallas on CPU); the fastest checked one is reported as "
                        "the default")
    p.add_argument("--gdn-key-heads", type=int, default=16)
    p.add_argument("--gdn-value-heads", type=int, default=32)
    p.add_argument("--gdn-head-dim", type=int, default=128)
    p.add_argument("--gdn-decodes", type=int, default=64, help="decode rows of the gdn cases")
    p.add_argument("--gdn-prefill", default="4x1024", help="prefill rows x tokens (gdn)")
    p.add_argument("--gdn-tiles", default=None,
                   help='JSON dict of GDNConfig overrides, e.g. \'{"block_v": 32}\'')
    p.add_argument("--lora-in", type=int, default=4096)
    p.add_argument("--lora-out", type=int, default=4096)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lora-adapters", type=int, default=8)
    p.add_argument("--lora-decodes", type=int, default=64)
    p.add_argument("--lora-prefill", default="4x512", help="prefill runs x tokens (lora)")
    p.add_argument("--sweep", action="store_true", help="time a grid of tile parameters per case")
    p.add_argument("--sweep-budget-s", type=float, default=300.0,
                   help="wall-clock budget of the whole sweep")
    common.add_output_args(p)
    args = p.parse_args(argv)
    return args


# ------------------------------------------------------------------------------------------
# cases
# ------------------------------------------------------------------------------------------
def decode_case(args, ctx):
    return dict(name=f"decode_ctx{ctx}", kind="decode", q_lens=[1] * args.batch,
                ctx_lens=[ctx] * args.batch)


def mixed_case(args):
    n, c, L, nd = args.mixed_chunks, args.mixed_chunk_len, args.mixed_ctx, args.mixed_decodes
    return dict(name=f"mixed_{n}x{c}@{L}+{nd}dec", kind="mixed", q_lens=[c] * n + [1] * nd,
                ctx_lens=[L] * (n + nd))


def build(case, args, seed=0):
    """Device arrays of a case; block tables as wide as the longest context needs."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.ragged_batch import make_ragged_batch

    ps = args.page_size
    q_lens, ctx = case["q_lens"], case["ctx_lens"]
    max_pages = -(-max(ctx) // ps)
    num_pages = 1 + sum(-(-c // ps) for c in ctx)
    batch = make_ragged_batch(
        np.random.default_rng(seed), q_lens, ctx, num_tokens=sum(q_lens), num_seqs=len(q_lens),
        max_pages=max_pages, num_pages=num_pages, num_q_heads=args.num_q_heads,
        num_kv_heads=args.num_kv_heads, head_dim=args.head_dim, page_size=ps, fill=False,
    )
    dt = jnp.dtype(args.dtype)
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)  # on device: GBs at long contexts
    pool = (args.num_kv_heads, num_pages, ps, args.head_dim)
    dev = dict(
        q=jax.random.normal(kq, (sum(q_lens), args.num_q_heads, args.head_dim), dt),
        k_pages=jax.random.normal(kk, pool, dt), v_pages=jax.random.normal(kv, pool, dt),
        query_start=jnp.asarray(batch.query_start),
        seq_lens=jnp.asarray(batch.seq_lens), block_tables=jnp.asarray(batch.block_tables),
        num_seqs=jnp.int32(batch.num_seqs),
    )
    if fp8_pages(args):
        dev["k_pages"], dev["v_pages"], dev["kv_scale"] = to_fp8_pages(
            dev["k_pages"], dev["v_pages"], page_dtype(args))
    return batch, dev


def fp8_pages(args) -> bool:
    return args.kv_cache_dtype != "auto"


def page_dtype(args):
    import jax.numpy as jnp

    if not fp8_pages(args):
        return jnp.dtype(args.dtype)
    return jnp.dtype(jnp.float8_e5m2 if args.kv_cache_dtype == "fp8_e5m2" else jnp.float8_e4m3fn)


def to_fp8_pages(k_pages, v_pages, dtype):
    """float8 pages holding K / scale and V / scale, one scale per KV head (the engine's
    calibration rule, ``scales_from_amax``), as ``--kv-cache-dtype fp8`` with calculated
    scales."""
    import jax.numpy as jnp

    from jaxserve.worker.kv_calibration import scales_from_amax
    from pallas_kernels import reference

    def scales(pages):
        return jnp.asarray(scales_from_amax(
            np.asarray(jnp.max(jnp.abs(pages.astype(jnp.float32)), axis=(1, 2, 3))), dtype))

    ks, vs = scales(k_pages), scales(v_pages)
    return (reference.to_page_dtype(k_pages, dtype, ks[:, None, None, None]),
            reference.to_page_dtype(v_pages, dtype, vs[:, None, None, None]),
            jnp.stack([ks, vs], axis=1))


def kv_bytes(case, args):
    """Bytes a perfect kernel reads from the pool: every context token's K and V, once."""
    item = page_dtype(args).itemsize
    return sum(case["ctx_lens"]) * args.num_kv_heads * args.head_dim * 2 * item


def io_bytes(case, args):
    item = 4 if args.dtype == "float32" else 2
    tokens = sum(case["q_lens"])
    return 2 * tokens * args.num_q_heads * args.head_dim * item  # q in, out


def attention_flops(q_lens, ctx_lens, args):
    """QK^T and PV FLOPs of causal attention (each token attends to its position + 1 keys)."""
    keys = 0
    for ql, c in zip(q_lens, ctx_lens):
        first = c - ql  # position of the first new token
        keys += ql * first + ql * (ql + 1) // 2
    return 4 * keys * args.num_q_heads * args.head_dim


# ------------------------------------------------------------------------------------------
# implementations
# ------------------------------------------------------------------------------------------
def ours_fn(args, tiles, backend="pallas"):
    """One of jaxserve's attention backends: "pallas" (Pallas-Triton), "mosaic" (Pallas Mosaic
    GPU) or "triton" (Triton language via jax_triton). ``tiles`` apply to pallas and triton."""
    import jax

    sm_scale = args.head_dim ** -0.5
    if backend == "pallas":
        from pallas_kernels.ragged_paged_attention import ragged_paged_attention

        kw = dict(tiles, interpret=args.interpret)
    elif backend == "mosaic":
        from pallas_kernels.mosaic_gpu_attention import ragged_paged_attention

        kw = {}
    elif backend == "triton":
        from pallas_kernels.triton_attention import ragged_paged_attention

        kw = dict(tiles)
    else:
        raise ValueError(f"unknown backend {backend!r}")

    @jax.jit
    def run(q, k_pages, v_pages, query_start, seq_lens, block_tables, num_seqs, kv_scale=None):
        scaled = {} if kv_scale is None else dict(kv_scale=kv_scale)
        return ragged_paged_attention(q, k_pages, v_pages, query_start, seq_lens, block_tables,
                                      num_seqs, sm_scale=sm_scale, **kw, **scaled)

    return run


def jax_paged_fn(args, pages_per_seq):
    """JAX's Pallas GPU paged_attention (decode only; it applies no sm_scale itself)."""
    import jax

    from jax.experimental.pallas.ops.gpu import paged_attention as pa

    k_splits = max(s for s in (16, 8, 4, 2, 1) if pages_per_seq % s == 0)
    sm_scale = args.head_dim ** -0.5

    @jax.jit
    def run(q, k_pages, v_pages, block_tables, lengths):
        return pa.paged_attention((q * sm_scale).astype(q.dtype), k_pages, v_pages, block_tables,
                                  lengths, k_splits=k_splits, interpret=args.interpret)

    return run, dict(k_splits=k_splits)


def jax_dense_decode_fn(args, ctx):
    """JAX's Pallas decode_attention.gqa over contiguous [B, ctx, Hkv, D] K/V (not paged)."""
    import jax

    from jax.experimental.pallas.ops.gpu import decode_attention as da

    sm_scale = args.head_dim ** -0.5
    k_splits = max(s for s in (16, 8, 4, 2, 1) if ctx % s == 0 and (ctx // s >= 16 or s == 1))
    block_k = min(128, ctx // k_splits)

    @jax.jit
    def run(q, k, v, lengths):
        return da.gqa(q, k, v, kv_seq_len=lengths, sm_scale=sm_scale, k_splits=k_splits,
                      block_k=block_k, interpret=args.interpret)

    return run, dict(k_splits=k_splits, block_k=block_k)


def dense_attention_fn():
    """jax.nn.dot_product_attention, cuDNN flash when the backend has it, else XLA."""
    import jax

    def make(impl):
        return jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation=impl))

    return make


# ------------------------------------------------------------------------------------------
# checks and timing
# ------------------------------------------------------------------------------------------
def rel_err(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    if not np.all(np.isfinite(a)):
        return float("inf")
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def check_vs_reference(case, args, tiles, budget_bytes=1 << 28, backend="pallas"):
    """Kernel == reference on the case, or on a sub-batch when the reference would be too big."""
    import jax

    from pallas_kernels import reference

    q_lens, ctx = list(case["q_lens"]), list(case["ctx_lens"])

    def ref_bytes(ql, cl):
        return 4 * sum(ql) * args.num_q_heads * len(cl) * max(cl) * 3

    sub = dict(case)
    if ref_bytes(q_lens, ctx) > budget_bytes:  # keep one row of each kind, drop the rest
        keep = [0] + ([q_lens.index(1)] if 1 in q_lens and q_lens[0] != 1 else [])
        sub = dict(case, q_lens=[q_lens[i] for i in keep], ctx_lens=[ctx[i] for i in keep])
    _, dev = build(sub, args, seed=1)
    out = ours_fn(args, tiles, backend)(*dev.values())
    ref = jax.jit(functools.partial(reference.ragged_paged_attention,
                                    sm_scale=args.head_dim ** -0.5))(
        dev["q"], dev["k_pages"], dev["v_pages"], dev["query_start"], dev["seq_lens"],
        dev["block_tables"], kv_scale=dev.get("kv_scale"))
    err = rel_err(out, ref)
    return dict(rel_err=err, tol=TOL[args.dtype], ok=err <= TOL[args.dtype],
                rows_checked=len(sub["q_lens"]), tokens_checked=sum(sub["q_lens"]))


def timed(fn, *a, args):
    t = common.time_fn(fn, *a, warmup=args.warmup, iters=args.iters)
    return t


def run_case(case, args, tiles, copy_bw):
    """Time ours (+ baselines) on one case; returns the case's result dict."""
    batch, dev = build(case, args)
    res = dict(case=case["name"], kind=case["kind"], num_seqs=len(case["q_lens"]),
               num_tokens=sum(case["q_lens"]), ctx=max(case["ctx_lens"]), tiles=tiles)
    if not args.no_check:
        res["check"] = check_vs_reference(case, args, tiles)
    kvb, iob = kv_bytes(case, args), io_bytes(case, args)
    res["kv_bytes"] = kvb
    flops = attention_flops(case["q_lens"], case["ctx_lens"], args)
    res["flops"] = flops
    ours = ours_fn(args, tiles)
    t = timed(ours, *dev.values(), args=args)
    res["ours"] = dict(t, bytes_per_s=(kvb + iob) / t["median_s"],
                       frac_copy_bw=(kvb + iob) / t["median_s"] / copy_bw,
                       tflops=flops / t["median_s"] / 1e12)
    res["backends"] = {"pallas": dict(res["ours"], check=res.get("check"))}
    for backend in args.backend_list:
        if backend == "pallas":
            continue
        try:
            entry = {}
            if not args.no_check:
                entry["check"] = check_vs_reference(case, args, tiles, backend=backend)
            t = timed(ours_fn(args, tiles, backend), *dev.values(), args=args)
            entry.update(t, bytes_per_s=(kvb + iob) / t["median_s"],
                         frac_copy_bw=(kvb + iob) / t["median_s"] / copy_bw,
                         tflops=flops / t["median_s"] / 1e12)
        except Exception as e:  # one backend failing must not lose the others' numbers
            entry = dict(error=f"{type(e).__name__}: {e}"[:500])
        res["backends"][backend] = entry
    if args.no_baseline:
        return res
    if fp8_pages(args) and case["kind"] == "decode":
        res["jax_paged_attention"] = dict(skipped="float8 pages (JAX's ops take none)")
        return res
    out_ours = np.asarray(ours(*dev.values()), np.float32)
    if case["kind"] == "decode":
        bsz = len(case["q_lens"])
        lengths = dev["seq_lens"]
        try:
            fn, info = jax_paged_fn(args, dev["block_tables"].shape[1])
            a = (dev["q"], dev["k_pages"], dev["v_pages"], dev["block_tables"], lengths)
            t = timed(fn, *a, args=args)
            res["jax_paged_attention"] = dict(
                t, **info, bytes_per_s=(kvb + iob) / t["median_s"],
                frac_copy_bw=(kvb + iob) / t["median_s"] / copy_bw,
                rel_err_vs_ours=rel_err(fn(*a), out_ours))
        except Exception as e:  # a baseline failing must not lose our numbers
            res["jax_paged_attention"] = dict(error=f"{type(e).__name__}: {e}"[:500])
        try:
            hkv, _, ps, d = dev["k_pages"].shape
            ctx = max(case["ctx_lens"])
            # Contiguous [B, ctx, Hkv, D] copies of each sequence's pages (not timed).
            bt = dev["block_tables"][:bsz]
            k = dev["k_pages"][:, bt].reshape(hkv, bsz, -1, d)[:, :, :ctx].transpose(1, 2, 0, 3)
            v = dev["v_pages"][:, bt].reshape(hkv, bsz, -1, d)[:, :, :ctx].transpose(1, 2, 0, 3)
            fn, info = jax_dense_decode_fn(args, ctx)
            a = (dev["q"], k, v, lengths)
            t = timed(fn, *a, args=args)
            res["jax_decode_attention_dense"] = dict(
                t, **info, bytes_per_s=(kvb + iob) / t["median_s"],
                frac_copy_bw=(kvb + iob) / t["median_s"] / copy_bw,
                rel_err_vs_ours=rel_err(fn(*a), out_ours))
            del k, v
        except Exception as e:
            res["jax_decode_attention_dense"] = dict(error=f"{type(e).__name__}: {e}"[:500])
    else:
        res["bound"] = mixed_bound(case, args, copy_bw)
        if res["bound"].get("bound_s"):
            for entry in [res["ours"], *res["backends"].values()]:
                if entry.get("median_s"):
                    entry["x_of_bound"] = entry["median_s"] / res["bound"]["bound_s"]
    return res


def mixed_bound(case, args, copy_bw):
    """Dense attention with the chunks' FLOPs + the decodes' KV at copy bandwidth."""
    import jax
    import jax.numpy as jnp

    chunks = [(ql, c) for ql, c in zip(case["q_lens"], case["ctx_lens"]) if ql > 1]
    decs = [(ql, c) for ql, c in zip(case["q_lens"], case["ctx_lens"]) if ql == 1]
    out = {}
    chunk_flops = attention_flops([c[0] for c in chunks], [c[1] for c in chunks], args)
    dec_bytes = kv_bytes(dict(ctx_lens=[c[1] for c in decs]), args)
    out["chunk_flops"] = chunk_flops
    out["decode_kv_bytes"] = dec_bytes
    dec_s = dec_bytes / copy_bw
    if chunks:
        n, ql = len(chunks), chunks[0][0]
        # Same FLOPs, no mask: every chunk token against `keys` keys.
        keys = chunk_flops // (4 * n * ql * args.num_q_heads * args.head_dim)
        keys = max(16, int(round(keys / 16)) * 16)
        rng = np.random.default_rng(2)
        dt = jnp.dtype(args.dtype)
        q = jnp.asarray(rng.standard_normal((n, ql, args.num_q_heads, args.head_dim)), dt)
        k = jnp.asarray(rng.standard_normal((n, keys, args.num_kv_heads, args.head_dim)), dt)
        make = dense_attention_fn()
        for impl in ("cudnn", None):
            try:
                t = timed(make(impl), q, k, k, args=args)
                out.update(dense_impl=impl or "xla", dense_keys=keys, dense_s=t["median_s"],
                           dense_tflops=chunk_flops / t["median_s"] / 1e12)
                break
            except Exception as e:
                out[f"dense_{impl or 'xla'}_error"] = f"{type(e).__name__}: {e}"[:300]
    kind = jax.devices()[0].device_kind
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if kind.startswith(k)), None)
    if peak:
        out["peak_flops"] = peak
        out["peak_flops_s"] = chunk_flops / peak + dec_s
    if "dense_s" in out:
        out["bound_s"] = out["dense_s"] + dec_s
    return out


# ------------------------------------------------------------------------------------------
# sweep (issue 11): fastest tile parameters per case
# ------------------------------------------------------------------------------------------
def sweep_grid(kind, tiny):
    if kind == "decode":
        if tiny:
            return [dict(decode_block_kv=kv, decode_num_splits=s, decode_min_kv_per_split=kv)
                    for kv in (16, 32) for s in (1, 2)]
        grid = []
        # Most impactful first (the budget may end the sweep early): KV tile x splits, then
        # warps and stages.
        for w, st, kv, s in itertools.product((4, 8), (2, 3), (32, 64, 128, 256), (1, 2, 4, 8, 16)):
            grid.append(dict(decode_block_kv=kv, decode_num_splits=s, decode_min_kv_per_split=kv,
                             decode_num_warps=w, decode_num_stages=st))
        return grid
    if tiny:
        return [dict(prefill_block_m=m, prefill_block_kv=kv) for m in (16, 32) for kv in (16, 32)]
    return [dict(prefill_block_m=m, prefill_block_kv=kv, prefill_num_warps=w, prefill_num_stages=st)
            for w, st, m, kv in itertools.product((4, 8), (2, 3), (32, 64, 128), (32, 64, 128))]


def run_sweep(case, args, base_tiles, deadline):
    _, dev = build(case, args)
    rows = []
    for cfg in common.progress(sweep_grid(case["kind"], args.tiny), disable=args.disable_tqdm,
                               desc=f"sweep {case['name']}", leave=False):
        if time.time() > deadline:
            break
        tiles = dict(base_tiles, **cfg)
        try:
            t = timed(ours_fn(args, tiles), *dev.values(), args=args)
            rows.append(dict(tiles=cfg, median_s=t["median_s"]))
        except Exception as e:  # e.g. shared memory overflow for a large tile
            rows.append(dict(tiles=cfg, error=f"{type(e).__name__}: {e}"[:200]))
    ok = [r for r in rows if "median_s" in r]
    best = min(ok, key=lambda r: r["median_s"]) if ok else None
    return dict(case=case["name"], tried=len(rows), best=best, rows=rows)


# ------------------------------------------------------------------------------------------
def apply_tiny(args):
    args.batch, args.num_q_heads, args.num_kv_heads, args.head_dim = 4, 4, 2, 64
    if args.ctx == "512,2048,8192":
        args.ctx = "64,128"
    args.mixed_chunks, args.mixed_chunk_len, args.mixed_ctx, args.mixed_decodes = 2, 32, 96, 2
    args.iters, args.warmup = min(args.iters, 2), 1
    args.sweep_budget_s = min(args.sweep_budget_s, 60)
    args.gdn_key_heads, args.gdn_value_heads, args.gdn_head_dim = 2, 4, 16
    args.gdn_decodes, args.gdn_prefill = 4, "2x40"
    args.lora_in, args.lora_out, args.lora_rank, args.lora_adapters = 64, 48, 8, 3
    args.lora_decodes, args.lora_prefill = 8, "2x24"


def plot(results, path, copy_bw):
    plt = common.pyplot()
    dec = [r for r in results["cases"] if r["kind"] == "decode"]
    mix = [r for r in results["cases"] if r["kind"] == "mixed"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.3), gridspec_kw=dict(width_ratios=[2, 1]))
    ax = axes[0]
    names = ["ours", "jax_paged_attention", "jax_decode_attention_dense"]
    width = 0.27
    for i, name in enumerate(names):
        xs, ys = [], []
        for j, r in enumerate(dec):
            v = r.get(name, {}).get("frac_copy_bw")
            if v is not None:
                xs.append(j + (i - 1) * width)
                ys.append(100 * v)
        if xs:
            bars = ax.bar(xs, ys, width, label=name)
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.axhline(80, color="k", linestyle="--", linewidth=1, label="80% target")
    ax.set_xticks(range(len(dec)), [f"ctx {r['ctx']}" for r in dec])
    ax.set_ylabel("% of copy bandwidth")
    ax.set_title(f"decode, B={dec[0]['num_seqs'] if dec else '?'}; copy bw "
                 f"{copy_bw / 1e9:.0f} GB/s", fontsize=10)
    ax.legend(fontsize=8)
    ax = axes[1]
    for j, r in enumerate(mix):
        vals = {"ours": r["ours"]["median_s"] * 1e3}
        if r.get("bound", {}).get("bound_s"):
            vals["dense bound"] = r["bound"]["bound_s"] * 1e3
        if r.get("bound", {}).get("peak_flops_s"):
            vals["peak-FLOP bound"] = r["bound"]["peak_flops_s"] * 1e3
        bars = ax.bar(list(vals), list(vals.values()),
                      color=["C0", "C3", "C7"][: len(vals)])
        ax.bar_label(bars, fmt="%.3g", fontsize=7)
        ax.set_title(r["case"], fontsize=10)
    ax.set_ylabel("ms")
    fig.suptitle(f"{results['meta']['device']}  {results['meta']['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def choose_backend(cases):
    """The backend with the least total time over the cases, among those that ran every case
    and matched the reference on each (None when no backend qualifies)."""
    totals = {}
    for name in {n for c in cases for n in c.get("backends", {})}:
        entries = [c.get("backends", {}).get(name, {}) for c in cases]
        if all(e.get("median_s") and (e.get("check") or {}).get("ok", True) for e in entries):
            totals[name] = sum(e["median_s"] for e in entries)
    best = min(totals, key=totals.get) if totals else None
    return dict(backend=best, total_s=totals, rule="least total median time over all cases, "
                "reference check passed")


def backend_table(results):
    names = sorted({n for c in results["cases"] for n in c.get("backends", {})})
    lines = [f"{'case':<28}" + "".join(f"{n + ' ms':>14}{'%bw/xb':>8}" for n in names)]
    for r in results["cases"]:
        row = f"{r['case']:<28}"
        for n in names:
            e = r.get("backends", {}).get(n, {})
            if not e.get("median_s"):
                row += f"{'error' if e.get('error') else '-':>14}{'':>8}"
                continue
            ok = (e.get("check") or {}).get("ok", True)
            extra = (f"x{e['x_of_bound']:.2f}" if r["kind"] == "mixed" and e.get("x_of_bound")
                     else f"{100 * e['frac_copy_bw']:.0f}%")
            row += f"{e['median_s'] * 1e3:>13.3f}{'' if ok else '!'}{extra:>8}"
        lines.append(row)
    lines.append(f"default backend: {results.get('default_backend', {}).get('backend')}")
    return "\n".join(lines)


def summary_table(results):
    lines = [f"{'case':<28}{'ours ms':>10}{'%bw':>7}{'jax paged ms':>14}{'%bw':>7}"
             f"{'dense ms':>10}{'check':>10}"]
    for r in results["cases"]:
        o = r["ours"]
        jp = r.get("jax_paged_attention", {})
        dn = r.get("jax_decode_attention_dense", {})
        chk = r.get("check", {})
        extra = ""
        if r["kind"] == "mixed":
            b = r.get("bound", {})
            jp = {}
            dn = {"median_s": b.get("bound_s")}
            extra = f"  (x bound {o.get('x_of_bound', float('nan')):.2f})"

        def ms(d):
            return f"{d['median_s'] * 1e3:.3f}" if d.get("median_s") else "-"

        def pct(d):
            return f"{100 * d['frac_copy_bw']:.0f}" if d.get("frac_copy_bw") else "-"

        ok = ("ok" if chk.get("ok") else "FAIL") + f" {chk.get('rel_err', float('nan')):.0e}" \
            if chk else "-"
        lines.append(f"{r['case']:<28}{ms(o):>10}{pct(o):>7}{ms(jp):>14}{pct(jp):>7}{ms(dn):>10}"
                     f"{ok:>10}{extra}")
    for s in results.get("sweep", []):
        if s.get("best"):
            lines.append(f"sweep {s['case']}: best {s['best']['median_s'] * 1e3:.3f} ms "
                         f"{json.dumps(s['best']['tiles'])} ({s['tried']} tried)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------
# Gated DeltaNet and multi-LoRA kernels
# ------------------------------------------------------------------------------------------
def gdn_cases(args):
    n, length = (int(v) for v in args.gdn_prefill.split("x"))
    nd = args.gdn_decodes
    return [
        dict(name=f"gdn_decode_B{nd}", kind="gdn", q_lens=[1] * nd),
        dict(name=f"gdn_prefill_{n}x{length}", kind="gdn", q_lens=[length] * n),
        dict(name=f"gdn_mixed_{max(1, n // 2)}x{length}+{nd // 2}dec", kind="gdn",
             q_lens=[length] * max(1, n // 2) + [1] * max(1, nd // 2)),
    ]


def gdn_build(q_lens, args, seed=0):
    """Device inputs of a GDN step: every row continues from a state (ctx = q_len + 100), one
    pool slot per row plus slot 0, gates as the model makes them."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.ragged_batch import make_state_rows

    t, s = sum(q_lens), len(q_lens)
    rows = make_state_rows(np.random.default_rng(seed), q_lens, [q + 100 for q in q_lens],
                           num_tokens=t, num_seqs=s, num_slots=s + 1)
    hk, hv, d = args.gdn_key_heads, args.gdn_value_heads, args.gdn_head_dim
    dt = jnp.dtype(args.dtype)
    ks = jax.random.split(jax.random.key(seed), 6)
    return dict(
        q=jax.random.normal(ks[0], (t, hk, d), dt), k=jax.random.normal(ks[1], (t, hk, d), dt),
        v=jax.random.normal(ks[2], (t, hv, d), dt),
        g=-jax.nn.softplus(jax.random.normal(ks[3], (t, hv), jnp.float32)),
        beta=jax.nn.sigmoid(jax.random.normal(ks[4], (t, hv), jnp.float32)),
        state=jax.random.normal(ks[5], (s + 1, hv, d, d), jnp.float32) * 0.1,
        query_start=jnp.asarray(rows.query_start), seq_lens=jnp.asarray(rows.seq_lens),
        state_slots=jnp.asarray(rows.state_slots),
    )


def gdn_fn(args, backend, tiles=None):
    """jit of one GDN backend with the state pool donated (as the engine runs it)."""
    import jax

    if backend == "pallas":
        from pallas_kernels.gated_delta_rule_pallas import gated_delta_rule

        kw = dict(tiles or {}, interpret=args.interpret)
    elif backend == "xla":
        from pallas_kernels.gated_delta_rule import gated_delta_rule

        kw = {}
    else:
        from pallas_kernels.reference import gated_delta_rule

        kw = {}
    return jax.jit(lambda *a: gated_delta_rule(*a, **kw), donate_argnums=(5,))


def timed_stateful(fn, dev, args):
    """Median time of ``fn`` over the step's inputs, the donated pool fed back each call."""
    keys = ("q", "k", "v", "g", "beta", "state", "query_start", "seq_lens", "state_slots")
    a = [dev[k] for k in keys]
    a[5] = a[5].copy()
    box = {"state": a[5]}

    def call():
        out, box["state"] = fn(*a[:5], box["state"], *a[6:])
        return out

    return timed(call, args=args)


def gdn_bytes_flops(q_lens, args):
    item = 4 if args.dtype == "float32" else 2
    hk, hv, d = args.gdn_key_heads, args.gdn_value_heads, args.gdn_head_dim
    t, s = sum(q_lens), len(q_lens)
    state = 2 * s * hv * d * d * 4  # each row's state read and written once
    io = t * (2 * hk * d + 2 * hv * d) * item + t * hv * 8
    c = 64  # chunk: A, u/w, w@S, q@S, qk, attn@v', state update (per token, per head)
    per_tok = 2 * (c * d + 2 * c * d + d * d + d * d + c * d + c * d + d * d)
    flops = sum(hv * (per_tok * q if q > 1 else 8 * d * d) for q in q_lens)
    return state, io, flops


def run_gdn_case(case, args, copy_bw, tiles):
    q_lens = case["q_lens"]
    res = dict(case=case["name"], kind="gdn", num_seqs=len(q_lens), num_tokens=sum(q_lens),
               tiles=tiles)
    state_b, io_b, flops = gdn_bytes_flops(q_lens, args)
    res.update(state_bytes=state_b, io_bytes=io_b, flops=flops,
               bound_s=(state_b + io_b) / copy_bw)
    if not args.no_check:  # one row of each kind, prefill rows cut to 192 tokens
        sub = sorted({min(q, 192) for q in q_lens})
        dev = gdn_build(sub, args, seed=1)
        keys = ("q", "k", "v", "g", "beta", "state", "query_start", "seq_lens", "state_slots")
        ref = gdn_fn(args, "reference")(*[dev[k].copy() if k == "state" else dev[k]
                                          for k in keys])
        for backend in ("pallas", "xla"):
            out = gdn_fn(args, backend, tiles)(*[dev[k].copy() if k == "state" else dev[k]
                                                 for k in keys])
            err = max(rel_err(out[0], ref[0]), rel_err(out[1], ref[1]))
            res[f"check_{backend}"] = dict(rel_err=err, tol=TOL[args.dtype],
                                           ok=err <= TOL[args.dtype], rows=sub)
        res["check"] = res["check_pallas"]
    dev = gdn_build(q_lens, args)
    for backend in ("pallas", "xla"):
        try:
            t = timed_stateful(gdn_fn(args, backend, tiles), dev, args)
            res[backend] = dict(t, x_of_bound=t["median_s"] / res["bound_s"],
                                frac_copy_bw=res["bound_s"] / t["median_s"],
                                tflops=flops / t["median_s"] / 1e12)
        except Exception as e:  # one backend failing must not lose the other's numbers
            res[backend] = dict(error=f"{type(e).__name__}: {e}"[:500])
    return res


def lora_cases(args):
    n, length = (int(v) for v in args.lora_prefill.split("x"))
    rng = np.random.default_rng(0)
    nl, nd = args.lora_adapters, args.lora_decodes
    dec = list(rng.integers(-1, nl, size=nd))  # scattered: neighbours rarely share a slot
    runs = [int(i % nl) for i in range(n) for _ in range(length)]
    half = [int(i % nl) for i in range(max(1, n // 2)) for _ in range(length)]
    # rows: the requests of the step (its sequence count), which bounds the runs of one slot.
    return [
        dict(name=f"lora_decode_T{nd}", kind="lora", slots=dec, rows=nd),
        dict(name=f"lora_prefill_{n}x{length}", kind="lora", slots=runs, rows=n),
        dict(name=f"lora_mixed_{max(1, n // 2)}x{length}+{nd}dec", kind="lora",
             slots=half + dec, rows=max(1, n // 2) + nd),
    ]


def run_lora_case(case, args):
    import jax
    import jax.numpy as jnp

    from pallas_kernels import lora, reference

    slots = np.asarray(case["slots"], np.int32)
    t, d_in, d_out = len(slots), args.lora_in, args.lora_out
    nl, r = args.lora_adapters, args.lora_rank
    dt = jnp.dtype(args.dtype)
    ks = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(ks[0], (t, d_in), dt)
    w = (jax.random.normal(ks[1], (d_in, d_out), jnp.float32) / np.sqrt(d_in)).astype(dt)
    a = (jax.random.normal(ks[2], (nl, d_in, r), jnp.float32) / np.sqrt(d_in)).astype(dt)
    b = jax.random.normal(ks[3], (nl, r, d_out), dt)
    scale = jnp.full((nl,), 2.0, jnp.float32)
    sl = jnp.asarray(slots)
    rows = case["rows"]
    res = dict(case=case["name"], kind="lora", num_tokens=t, num_seqs=rows,
               distinct_slots=int(len(set(slots[slots >= 0].tolist()))),
               runs=int(1 + np.count_nonzero(np.diff(slots))))
    if not args.no_check:
        n = min(t, 256)
        ref = reference.lora_delta(x[:n], a, b, sl[:n], scale)
        for name, fn in (("pallas", functools.partial(lora.lora_delta_pallas, max_runs=rows,
                                                      interpret=args.interpret)),
                         ("xla", lora.lora_delta)):
            err = rel_err(fn(x[:n], a, b, sl[:n], scale), ref)
            res[f"check_{name}"] = dict(rel_err=err, tol=TOL[args.dtype],
                                        ok=err <= TOL[args.dtype], tokens=n)
        res["check"] = res["check_pallas"]
    base = jax.jit(lambda x, w: x @ w)
    with_pallas = jax.jit(lambda x, w, a, b, s, c: x @ w + lora.lora_delta_pallas(
        x, a, b, s, c, max_runs=case["rows"], interpret=args.interpret))
    with_xla = jax.jit(lambda x, w, a, b, s, c: x @ w + lora.lora_delta(x, a, b, s, c))
    res["base"] = timed(base, x, w, args=args)
    for name, fn in (("pallas", with_pallas), ("xla", with_xla)):
        try:
            tt = timed(fn, x, w, a, b, sl, scale, args=args)
            res[name] = dict(tt, throughput_vs_base=res["base"]["median_s"] / tt["median_s"])
        except Exception as e:
            res[name] = dict(error=f"{type(e).__name__}: {e}"[:500])
    return res


def plot_gdn_lora(results, path):
    plt = common.pyplot()
    gdn, lo = results.get("gdn", []), results.get("lora", [])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.3))
    ax = axes[0]
    for i, (name, key) in enumerate((("pallas", "pallas"), ("xla", "xla"), ("bound", None))):
        ys = [(r["bound_s"] if key is None else r.get(key, {}).get("median_s") or 0) * 1e3
              for r in gdn]
        bars = ax.bar([j + (i - 1) * 0.27 for j in range(len(gdn))], ys, 0.27,
                      label="state-traffic bound" if key is None else name)
        ax.bar_label(bars, fmt="%.3g", fontsize=7)
    ax.set_xticks(range(len(gdn)), [r["case"] for r in gdn], fontsize=7)
    ax.set_ylabel("ms")
    ax.set_yscale("log")
    ax.set_title("Gated DeltaNet step (lower is better)", fontsize=10)
    ax.legend(fontsize=8)
    ax = axes[1]
    for i, name in enumerate(("pallas", "xla")):
        ys = [r.get(name, {}).get("throughput_vs_base") or 0 for r in lo]
        bars = ax.bar([j + (i - 0.5) * 0.4 for j in range(len(lo))], ys, 0.4,
                      label=f"base + {name} LoRA")
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="k", linewidth=1)
    ax.axhline(0.9, color="k", linestyle="--", linewidth=1, label="0.9x target")
    ax.set_xticks(range(len(lo)), [r["case"] for r in lo], fontsize=7)
    ax.set_ylabel("throughput / base projection")
    ax.set_title("multi-LoRA projection (higher is better)", fontsize=10)
    ax.legend(fontsize=8)
    fig.suptitle(f"{results['meta']['device']}  {results['meta']['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def gdn_lora_table(results):
    lines = []
    for r in results.get("gdn", []):
        row = f"{r['case']:<32}bound {r['bound_s'] * 1e3:8.3f} ms"
        for name in ("pallas", "xla"):
            e = r.get(name, {})
            row += (f"  {name} {e['median_s'] * 1e3:8.3f} ms (x{e['x_of_bound']:.2f})"
                    if e.get("median_s") else f"  {name} error")
        lines.append(row + f"  check {'ok' if r.get('check', {}).get('ok', True) else 'FAIL'}")
    for r in results.get("lora", []):
        row = f"{r['case']:<32}base {r['base']['median_s'] * 1e3:8.3f} ms"
        for name in ("pallas", "xla"):
            e = r.get(name, {})
            row += (f"  +{name} {e['median_s'] * 1e3:8.3f} ms ({e['throughput_vs_base']:.2f}x)"
                    if e.get("median_s") else f"  +{name} error")
        lines.append(row + f"  check {'ok' if r.get('check', {}).get('ok', True) else 'FAIL'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax

    accel = jax.devices()[0].platform != "cpu"
    if not accel:
        args.tiny = True
    args.interpret = not accel
    if args.tiny:
        apply_tiny(args)
    tiles = json.loads(args.tiles) if args.tiles else {}
    args.backend_list = [b.strip() for b in (args.backends or (
        "pallas,mosaic,triton" if accel else "pallas")).split(",") if b.strip()]
    meta = common.run_metadata()
    bw = common.measure_copy_bandwidth()
    copy_bw = bw["bandwidth_bytes_per_s"]
    cases = []
    kinds = [c.strip() for c in args.cases.split(",") if c.strip()]
    if "decode" in kinds:
        cases += [decode_case(args, int(c)) for c in args.ctx.split(",")]
    if "mixed" in kinds:
        cases.append(mixed_case(args))
    results = dict(meta=meta, copy_bandwidth=bw, tiny=args.tiny, interpret=args.interpret,
                   config=dict(batch=args.batch, num_q_heads=args.num_q_heads,
                               num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                               page_size=args.page_size, dtype=args.dtype,
                               kv_cache_dtype=args.kv_cache_dtype, iters=args.iters,
                               warmup=args.warmup), cases=[])
    for case in common.progress(cases, disable=args.disable_tqdm, desc="kernels"):
        results["cases"].append(run_case(case, args, tiles, copy_bw))
    gdn_tiles = json.loads(args.gdn_tiles) if args.gdn_tiles else {}
    if "gdn" in kinds:
        results["gdn_config"] = dict(key_heads=args.gdn_key_heads,
                                     value_heads=args.gdn_value_heads,
                                     head_dim=args.gdn_head_dim, dtype=args.dtype)
        results["gdn"] = []
        for c in gdn_cases(args):  # a line per case: a capped run shows where it stopped
            print(f"gdn case {c['name']}", file=sys.stderr, flush=True)
            results["gdn"].append(run_gdn_case(c, args, copy_bw, gdn_tiles))
    if "lora" in kinds:
        results["lora_config"] = dict(d_in=args.lora_in, d_out=args.lora_out,
                                      rank=args.lora_rank, adapters=args.lora_adapters,
                                      dtype=args.dtype)
        results["lora"] = []
        for c in lora_cases(args):
            print(f"lora case {c['name']}", file=sys.stderr, flush=True)
            results["lora"].append(run_lora_case(c, args))
    if args.sweep:
        t_sweep = time.time()
        results["sweep"] = []
        for i, c in enumerate(cases):  # an equal share of what is left for each case
            share = (args.sweep_budget_s - (time.time() - t_sweep)) / (len(cases) - i)
            results["sweep"].append(run_sweep(c, args, tiles, time.time() + share))
    results["default_backend"] = choose_backend(results["cases"])
    path = common.result_path("kernels", args, tag="-tiny" if args.tiny else "")
    common.write_json(path, results)
    print(f"wrote {path}")
    if not args.no_plot:
        if results["cases"]:
            print(f"wrote {plot(results, path[:-5] + '.png', copy_bw)}")
        if results.get("gdn") or results.get("lora"):
            print(f"wrote {plot_gdn_lora(results, path[:-5] + '-gdn-lora.png')}")
    print(f"copy bandwidth {copy_bw / 1e9:.1f} GB/s on {meta['device']}")
    if results["cases"]:
        print(summary_table(results))
        print(backend_table(results))
    if results.get("gdn") or results.get("lora"):
        print(gdn_lora_table(results))
    bad = [f"{r['case']}:{name}" for r in results["cases"]
           for name, e in r.get("backends", {"pallas": r}).items()
           if e.get("check") and not e["check"]["ok"]]
    bad += [f"{r['case']}:{k}" for r in results.get("gdn", []) + results.get("lora", [])
            for k, v in r.items() if k.startswith("check_") and not v["ok"]]
    if bad:
        print(f"REFERENCE CHECK FAILED: {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
