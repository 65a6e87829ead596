"""Compare the host's time per step between sets of ``throughput.py`` runs (before/after a
change, CPU/GPU): the median of each phase of ``host_breakdown_ms_per_step`` and of the
headline numbers, as JSON and a grouped bar plot.

Runs on a shared CPU are noisy (XLA's threads and the host's share the cores), so each set
should hold several runs, interleaved with the other set's:

    python -m benchmarks.host_phases before=DIR1 after=DIR2 --output-json OUT.json
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import common as C  # noqa: E402

HEADLINE = ("output_throughput", "host_ms_per_step", "device_ms_per_step", "step_ms_per_step",
            "host_overhead_fraction")


def load_set(directory: str) -> tuple[list[dict], dict]:
    """The ``jaxserve`` results of every throughput JSON under ``directory``, and where they
    ran (devices, commits, files)."""
    runs, where = [], {"devices": set(), "git_commits": set(), "files": []}
    for path in sorted(glob.glob(os.path.join(directory, "**", "throughput-*.json"),
                                 recursive=True)):
        with open(path) as f:
            d = json.load(f)
        res = d.get("jaxserve", {})
        if "host_breakdown_ms_per_step" in res:
            runs.append(res)
            where["devices"].add(d.get("device"))
            where["git_commits"].add(d.get("git_commit"))
            where["files"].append(path)
    if not runs:
        raise SystemExit(f"{directory}: no throughput JSON with host_breakdown_ms_per_step")
    return runs, {k: sorted(v) if isinstance(v, set) else v for k, v in where.items()}


def summarize(runs: list[dict], where: dict) -> dict:
    phases = list(runs[0]["host_breakdown_ms_per_step"])
    out = {"num_runs": len(runs), **where}
    for k in HEADLINE:
        out[k] = statistics.median(r[k] for r in runs)
    out["host_breakdown_ms_per_step"] = {
        p: statistics.median(r["host_breakdown_ms_per_step"][p] for r in runs) for p in phases}
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sets", nargs="+", help="NAME=DIR, in the order to plot")
    p.add_argument("--output-json", required=True)
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    sets = {}
    for spec in args.sets:
        name, sep, directory = spec.partition("=")
        if not sep or not name or not directory:
            p.error(f"{spec!r}: expected NAME=DIR")
        sets[name] = summarize(*load_set(directory))
    names = list(sets)
    out = dict(benchmark="host_phases", **C.run_metadata(), sets=sets)
    if len(names) >= 2:
        a, b = sets[names[0]], sets[names[-1]]
        out["host_ms_ratio"] = b["host_ms_per_step"] / a["host_ms_per_step"]
        out["output_throughput_ratio"] = b["output_throughput"] / a["output_throughput"]
    if not args.no_plot:
        phases = list(sets[names[0]]["host_breakdown_ms_per_step"])
        out["plot"] = C.bar_plot(
            args.output_json[:-5] + ".png", phases,
            {n: [sets[n]["host_breakdown_ms_per_step"][ph] for ph in phases] for n in names},
            ylabel="ms per step (median)", title="host time per engine step, by phase")
    C.write_json(args.output_json, out)
    for n in names:
        s = sets[n]
        print(f"{n}: {s['num_runs']} runs, {s['output_throughput']:.0f} output tok/s, host "
              f"{s['host_ms_per_step']:.2f} ms / device {s['device_ms_per_step']:.2f} ms per "
              "step; " + ", ".join(f"{k} {v:.2f}" for k, v in
                                   s["host_breakdown_ms_per_step"].items()))
    print(f"wrote {args.output_json}")
    return out


if __name__ == "__main__":
    main()
