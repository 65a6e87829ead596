"""The CPU int8 matmul kernel's cost per activation row count: what a speculative verify step
of M tokens pays for its projections against a one-token decode step.

One timed call is a decode step's projections for SmolLM2-135M (30 layers of q/k/v, o,
gate/up and down, then the 49,152-row LM head: ~134 MB of int8 weights, each read once), run
back to back on ``M`` activation rows. Each ``--repo`` (a checkout of jaxserve: its
``pallas_kernels/cpu_int8_matmul.cc``) is timed in its own process, the repos taking turns
for ``--rounds`` rounds (a shared machine drifts); the result is the median per repo and M (of
the rounds' medians), and each M's time over M = 1's of the same repo; the fastest step of
all rounds (``min_ms``) beside it. ``--pin-cpu N`` runs each worker on one core and records its
CPU time (``cpu_ms``), which other processes on a shared machine disturb less than wall time.
Each worker also times the greedy argmax over 49,152 logits at the same row counts: XLA's and,
where the checkout has it, the C++ kernel's (``argmax_min_us``).

    python benchmarks/cpu_int8_rows.py --repo . --repo /path/to/baseline --rows 1,2,4,8 \\
        --output-json benchmarks/results/cpu-spec-2026-11-28/int8-rows.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common as B  # noqa: E402

# SmolLM2-135M: hidden 576, 9 q heads and 3 kv heads of 64, MLP 1536, vocab 49,152, 30 layers
HIDDEN, KV, MLP, VOCAB, LAYERS = 576, 192, 1536, 49152, 30


def _worker(rows: list[int], iters: int) -> dict:
    """Time the step's projections at each M in this process (the repo on sys.path[0])."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    repo = os.environ["CPU_INT8_ROWS_REPO"]
    sys.path.insert(0, repo)  # that checkout's kernels, not this script's
    sys.modules.pop("pallas_kernels", None)
    from pallas_kernels import cpu_kernels

    assert os.path.abspath(cpu_kernels.__file__).startswith(repo + os.sep), cpu_kernels.__file__
    if not cpu_kernels.available():
        raise SystemExit("cpu kernels not available")
    rng = np.random.default_rng(0)

    def weight(n, k):
        return (jnp.asarray(rng.integers(-127, 128, (n, k), dtype=np.int8)),
                jnp.asarray(rng.uniform(1e-3, 1e-2, n).astype(np.float32)))

    layers = [dict(qkv=[weight(HIDDEN, HIDDEN), weight(KV, HIDDEN), weight(KV, HIDDEN)],
                   o=[weight(HIDDEN, HIDDEN)], gu=[weight(MLP, HIDDEN), weight(MLP, HIDDEN)],
                   down=[weight(HIDDEN, MLP)]) for _ in range(LAYERS)]
    head = [weight(VOCAB, HIDDEN)]

    @jax.jit
    def step(x, layers, head):
        # each call's input depends on the last one's output, so they run in order
        for p in layers:
            q, k, v = cpu_kernels.int8_matmul(x, p["qkv"])
            x = x + 1e-3 * cpu_kernels.int8_matmul(q + k.sum() + v.sum(), p["o"])[0]
            g, u = cpu_kernels.int8_matmul(x, p["gu"])
            x = x + 1e-3 * cpu_kernels.int8_matmul(g * u, p["down"])[0]
        return cpu_kernels.int8_matmul(x, head)[0]

    out = {}
    for m in rows:
        x = jnp.asarray(rng.standard_normal((m, HIDDEN)).astype(np.float32))
        for _ in range(2):
            jax.block_until_ready(step(x, layers, head))
        wall, cpu = [], []
        for _ in range(iters):
            t, c = time.perf_counter(), time.process_time()
            jax.block_until_ready(step(x, layers, head))
            wall.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
        out[m] = [statistics.median(wall), min(wall), statistics.median(cpu)]
    # the greedy pick over SmolLM2's vocabulary at the same row counts: XLA's argmax and, where
    # the checkout has it, the kernel's
    fns = {"xla": jax.jit(lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32))}
    if hasattr(cpu_kernels, "argmax"):
        fns["kernel"] = jax.jit(cpu_kernels.argmax)
    for name, fn in fns.items():
        out[f"argmax_{name}"] = {}
        for m in rows:
            x = jnp.asarray(rng.standard_normal((m, VOCAB)).astype(np.float32))
            t = B.time_fn(fn, x, warmup=3, iters=50, calls_per_sample=1)
            out[f"argmax_{name}"][m] = [t["median_s"], t["min_s"]]
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", action="append", default=None,
                   help="a jaxserve checkout to time (repeatable; default: this one)")
    p.add_argument("--rows", default="1,2,3,4,5,6,8", help="activation row counts M")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=15, help="timed steps per M per round")
    p.add_argument("--pin-cpu", type=int, default=None, metavar="N",
                   help="run each worker on core N alone (taskset): one thread, no helpers, "
                        "and its CPU time (process_time) as a measure that other processes' "
                        "load disturbs less than wall time")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    B.add_output_args(p)
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    if args.worker:
        print(json.dumps(_worker(rows, args.iters)))
        return {}
    repos = [os.path.abspath(r) for r in (args.repo or [B.ROOT])]
    samples = {r: {m: [] for m in rows} for r in repos}
    fastest = {r: {m: [] for m in rows} for r in repos}
    cpu = {r: {m: [] for m in rows} for r in repos}
    argmax_us = {}  # repo -> argmax_xla / argmax_kernel -> M -> fastest call per round
    loads = []
    for i in range(args.rounds):
        for repo in repos:
            env = dict(os.environ, PYTHONPATH=repo, JAX_PLATFORMS="cpu", CPU_INT8_ROWS_REPO=repo)
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--rows", args.rows,
                   "--iters", str(args.iters)]
            if args.pin_cpu is not None:
                cmd = ["taskset", "-c", str(args.pin_cpu), *cmd]
            loads.append(os.getloadavg()[0])
            res = subprocess.run(cmd, env=env, cwd=repo, capture_output=True, text=True,
                                 check=True)
            times = json.loads(res.stdout.strip().splitlines()[-1])
            for key in [x for x in times if x.startswith("argmax_")]:
                for m in rows:
                    argmax_us.setdefault(repo, {}).setdefault(key, {}).setdefault(m, []).append(
                        times[key][str(m)][1] * 1e6)
            for m in rows:
                samples[repo][m].append(times[str(m)][0])
                fastest[repo][m].append(times[str(m)][1])
                cpu[repo][m].append(times[str(m)][2])
            print(f"round {i} {repo}: " + ", ".join(f"M={m} {times[str(m)][0] * 1e3:.2f} ms"
                                                     for m in rows), flush=True)
    table = {}
    for repo in repos:
        med = {m: statistics.median(samples[repo][m]) for m in rows}
        best = {m: min(fastest[repo][m]) for m in rows}
        cpu_med = {m: statistics.median(cpu[repo][m]) for m in rows}
        table[repo] = dict(
            git_commit=subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True,
                                      text=True).stdout.strip(),
            median_ms={m: med[m] * 1e3 for m in rows},
            vs_one_row={m: med[m] / med[rows[0]] for m in rows},
            min_ms={m: best[m] * 1e3 for m in rows},
            min_vs_one_row={m: best[m] / best[rows[0]] for m in rows},
            cpu_ms={m: cpu_med[m] * 1e3 for m in rows},
            cpu_vs_one_row={m: cpu_med[m] / cpu_med[rows[0]] for m in rows},
            samples_ms={m: [s * 1e3 for s in samples[repo][m]] for m in rows},
            argmax_min_us={key: {m: statistics.median(v) for m, v in per.items()}
                           for key, per in argmax_us.get(repo, {}).items()})
    result = dict(B.run_metadata(), benchmark="cpu_int8_rows", rows=rows, rounds=args.rounds,
                  iters=args.iters, pin_cpu=args.pin_cpu, weight_bytes=LAYERS * HIDDEN * (2 * HIDDEN + 2 * KV + 3 * MLP)
                  + VOCAB * HIDDEN, load_average_at_each_run=loads, repos=table)
    path = B.result_path("cpu_int8_rows", args)
    # pinned: CPU time is the measure; otherwise wall time
    key = "cpu" if args.pin_cpu is not None else "median"
    ratio = "cpu_vs_one_row" if args.pin_cpu is not None else "vs_one_row"
    result["measure"] = "process CPU time, median" if key == "cpu" else "wall time, median"
    B.write_json(path, result)
    if not args.no_plot:
        names = {r: os.path.basename(r.rstrip("/")) + f" ({table[r]['git_commit'][:7]})"
                 for r in repos}
        B.bar_plot(path[:-5] + ".png", [f"M={m}" for m in rows],
                   {names[r]: [table[r][ratio][m] for m in rows] for r in repos},
                   ylabel=f"{result['measure']} / M=1's (same kernel)", hline=1.0,
                   title="int8 kernel: SmolLM2-135M step projections, M activation rows")
    for repo in repos:
        print(repo, {m: f"{table[repo][key + '_ms'][m]:.2f} ms ({table[repo][ratio][m]:.2f}x)"
                     for m in rows})
    print(path)
    return result


if __name__ == "__main__":
    main()
