"""Summary of a ``benchmarks/code_pair.sh`` run: medians of each side and after / before."""
from __future__ import annotations

import glob
import json
import statistics
import sys
from pathlib import Path

METRICS = [("throughput", "output_tok_s", "output tok/s (32 x 128 -> 64)"),
           ("throughput", "single_request_decode_tok_s", "single-request decode tok/s"),
           ("serving", "request_throughput@inf", "peak req/s (burst)"),
           ("serving", "p50_ttft_ms@4.0", "TTFT p50 ms at 4 req/s"),
           ("serving", "p99_ttft_ms@4.0", "TTFT p99 ms at 4 req/s"),
           ("serving", "p50_tpot_ms@4.0", "TPOT p50 ms at 4 req/s"),
           ("serving", "p99_tpot_ms@4.0", "TPOT p99 ms at 4 req/s")]


def values(out: Path, kind: str, tag: str, key: str) -> list[float]:
    vals = []
    for f in sorted(glob.glob(str(out / f"{kind}-{tag}-*.json"))):
        d = json.loads(Path(f).read_text())
        if kind == "throughput":
            vals.append(d["jaxserve"][key])
            continue
        field, rate = key.split("@")
        for run in d["runs"]:
            if str(run["request_rate"]) == rate:
                vals.append(run[field])
    return vals


def main(out: Path) -> None:
    rows = {}
    for kind, key, label in METRICS:
        b, a = values(out, kind, "before", key), values(out, kind, "after", key)
        if b and a:
            mb, ma = statistics.median(b), statistics.median(a)
            rows[label] = {"before": b, "after": a, "before_median": mb, "after_median": ma,
                           "after_over_before": round(ma / mb, 3)}
    (out / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
    for label, r in rows.items():
        print(f"{label:34s} before {r['before_median']:9.2f}  after {r['after_median']:9.2f}"
              f"  ratio {r['after_over_before']:.2f}")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    labels = list(rows)
    ax.barh(labels, [rows[k]["after_over_before"] for k in labels])
    ax.axvline(1.0, color="k", lw=1)
    ax.set_xlabel("after / before (medians)")
    ax.set_title(out.name)
    fig.tight_layout()
    fig.savefig(out / "summary.png", dpi=100)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
