"""What a ``jax.profiler`` trace says, without TensorBoard: the device's time per XLA op (or
kernel), summed over the trace, largest first.

``trace_generate`` traces one ``LLM.generate`` call (the throughput benchmark's
``--profile-dir``); ``summarize`` reads the newest ``.xplane.pb`` under a directory. On a GPU the
ops are the events of each ``/device:GPU:N`` plane's "XLA Ops" line; on a CPU, the XLA
client's worker threads (there is no device plane).

    python -m benchmarks.profile_summary TRACE_DIR [--top 30] [--output-json OUT.json]
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import common as C  # noqa: E402

# CPU thread lines that run XLA's ops, and their bookkeeping events (not ops)
_CPU_OP_LINES = ("tf_XLAPjRtCpuClient", "tf_XLAEigen")
_CPU_NOT_OPS = ("ThreadpoolListener::", "ThunkExecutor::", "end: ")


def trace_generate(llm, prompts, params, log_dir: str) -> str:
    """Trace one ``llm.generate(prompts, params)`` into ``log_dir`` (no Python tracer: it
    would slow the host, whose time is what the steps are short of); returns the xplane."""
    import jax

    opts = jax.profiler.ProfileOptions()
    opts.python_tracer_level = 0
    jax.profiler.start_trace(log_dir, profiler_options=opts)
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        jax.profiler.stop_trace()
    return newest_xplane(log_dir)


def newest_xplane(log_dir: str) -> str:
    files = glob.glob(os.path.join(log_dir, "**", "*.xplane.pb"), recursive=True)
    if not files:
        raise SystemExit(f"{log_dir}: no .xplane.pb trace")
    return max(files, key=os.path.getmtime)


def _op_events(pd):
    """(plane, event) of every op run: device planes' "XLA Ops" lines (their stream lines
    without one), else the CPU client's worker threads."""
    device = [p for p in pd.planes if p.name.startswith("/device:")]
    if device:
        for plane in device:
            lines = list(plane.lines)
            # no "XLA Ops" line (a raw CUPTI trace): each stream's kernels and copies; the
            # per-program and per-step lines would count the same time twice
            ops = [ln for ln in lines if ln.name == "XLA Ops"] or [
                ln for ln in lines if "Modules" not in ln.name and "Steps" not in ln.name]
            for line in ops:
                for ev in line.events:
                    yield plane.name, ev
        return
    for plane in pd.planes:
        for line in plane.lines:
            if line.name.startswith(_CPU_OP_LINES):
                for ev in line.events:
                    if not ev.name.startswith(_CPU_NOT_OPS):
                        yield plane.name, ev


def summarize(path: str, top: int = 30) -> dict:
    """Each op's total time over the trace (ms), its count and its share of all op time, keyed
    ``module:op`` (an HLO op name is only unique inside its program); and each program's
    (``hlo_module``) total: the model's forward against the sampler."""
    import jax

    pd = jax.profiler.ProfileData.from_file(path)
    total_ns: dict[str, float] = defaultdict(float)
    module_ns: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    source: dict[str, str] = {}
    planes = set()
    for plane, ev in _op_events(pd):
        planes.add(plane)
        stats = dict(ev.stats)
        module = str(stats.get("hlo_module", "?"))
        key = f"{module}:{ev.name}"
        total_ns[key] += ev.duration_ns
        module_ns[module] += ev.duration_ns
        count[key] += 1
        if key not in source and "tf_op" in stats:  # the jax op it came from (GPU traces)
            source[key] = str(stats["tf_op"])
    all_ns = sum(total_ns.values())
    ranked = sorted(total_ns, key=total_ns.get, reverse=True)
    return dict(xplane=path, planes=sorted(planes), num_ops=len(total_ns),
                op_time_ms=all_ns / 1e6,
                module_time_ms={m: v / 1e6 for m, v in sorted(module_ns.items(),
                                                             key=lambda kv: -kv[1])},
                top_ops=[dict(name=n, total_ms=total_ns[n] / 1e6, count=count[n],
                              fraction=total_ns[n] / all_ns if all_ns else 0.0,
                              **({"source": source[n]} if n in source else {}))
                         for n in ranked[:top]])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace_dir")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    out = summarize(newest_xplane(args.trace_dir), args.top)
    for op in out["top_ops"]:
        print(f"{op['total_ms']:10.3f} ms {op['fraction']:6.1%} {op['count']:7d}  {op['name']}")
    print(f"{out['num_ops']} ops, {out['op_time_ms']:.1f} ms of op time on {out['planes']}; "
          "by program: " + ", ".join(f"{m} {v:.1f} ms" for m, v in out["module_time_ms"].items()))
    if args.output_json:
        C.write_json(args.output_json, dict(benchmark="profile_summary", **C.run_metadata(),
                                            **out))
    return out


if __name__ == "__main__":
    main()
