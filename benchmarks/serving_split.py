"""Serving before/after the engine-core split, in one run: TTFT and TPOT at 80 % of each
server's own measured peak.

"before": one process, synchronous scheduling (``JAXSERVE_ENABLE_MULTIPROCESSING=0
--no-async-scheduling``): HTTP, tokenization, detokenization and the device loop share a
process and the host waits for every step. "after": the defaults (the engine core in its own
process, async scheduling, the output processor in the API process). Each variant runs
``benchmarks/serving.py --launch`` at rates ``inf`` (its peak) then ``0.8x`` (Poisson); the
variants alternate ``--repeats`` times so a drifting machine load hits both alike.

    python benchmarks/serving_split.py --model ~/.cache/jaxserve/demo-random \\
        --num-prompts 128 --input-len 64 --output-len 64 --repeats 2
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import baselines as B  # noqa: E402
from benchmarks import serving  # noqa: E402

VARIANTS = {
    "before": ({"JAXSERVE_ENABLE_MULTIPROCESSING": "0"}, "--no-async-scheduling"),
    "after": ({"JAXSERVE_ENABLE_MULTIPROCESSING": "1"}, "--async-scheduling"),
}
KEYS = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms",
        "request_throughput", "output_throughput")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--server-args", default="")
    p.add_argument("--result-dir", default=None)
    args = p.parse_args(argv)
    result_dir = args.result_dir or B.RESULTS_DIR
    runs = {name: [] for name in VARIANTS}
    for rep in range(args.repeats):
        for name, (env, flag) in VARIANTS.items():
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            try:
                out = serving.main([
                    "--launch", "--model", args.model, "--num-prompts", str(args.num_prompts),
                    "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                    "--max-num-seqs", str(args.max_num_seqs), "--request-rates", "inf,0.8x",
                    f"--server-args={flag} {args.server_args}".strip(), "--disable-tqdm",
                    "--no-plot", "--result-dir", os.path.join(result_dir, "runs")])
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
            peak, at80 = out["runs"]
            runs[name].append(dict({k: at80.get(k) for k in KEYS}, repeat=rep,
                                   peak_request_throughput=peak["request_throughput"],
                                   rate=at80["request_rate"]))
    summary = {name: {k: statistics.median(r[k] for r in rs) for k in KEYS + (
        "peak_request_throughput",)} for name, rs in runs.items()}
    ratios = {k: summary["after"][k] / summary["before"][k] for k in KEYS
              if summary["before"][k]}
    result = dict(benchmark="serving_split", **B.run_metadata(), config=vars(args), runs=runs,
                  summary=summary, after_over_before=ratios)
    path = os.path.join(result_dir, "serving_split.json")
    result["plot"] = _plot(path[:-5] + ".png", summary)
    B.write_result(path, result)
    for name, s in summary.items():
        print(f"{name:6s} peak {s['peak_request_throughput']:.2f} req/s | at 0.8x: TTFT p50 "
              f"{s['median_ttft_ms']:.0f} ms p99 {s['p99_ttft_ms']:.0f} ms, TPOT p50 "
              f"{s['median_tpot_ms']:.1f} ms")
    return result


def _plot(path: str, summary: dict) -> str:
    plt = B.plt()
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.5))
    for ax, (key, label) in zip(axes, [("median_ttft_ms", "TTFT p50 (ms)"),
                                       ("p99_ttft_ms", "TTFT p99 (ms)"),
                                       ("median_tpot_ms", "TPOT p50 (ms)")]):
        names = list(summary)
        ax.bar(names, [summary[n][key] for n in names], color=["tab:gray", "tab:blue"])
        ax.set_title(label)
    fig.suptitle("serving at 0.8x of each variant's peak: before/after the core split")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return os.path.basename(path)


if __name__ == "__main__":
    main()
