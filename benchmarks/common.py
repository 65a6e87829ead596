"""Helpers every benchmark shares: run metadata, device copy bandwidth, timing, JSON, PNG.

No jax import at module level (benchmarks/baselines.py imports this from an HF subprocess that
must not touch the accelerator through XLA); functions that need jax import it themselves.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH_DIR)
RESULTS_DIR = os.path.join(BENCH_DIR, "results")
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except Exception:
        return ""


def versions() -> dict:
    out = {"python": platform.python_version()}
    from importlib import metadata

    for dist in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin",
                 "jax-cuda13-pjrt", "flax", "numpy", "triton", "jax-triton", "torch",
                 "transformers"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def device_info() -> dict:
    import jax

    dev = jax.devices()[0]
    info = dict(platform=dev.platform, device_kind=dev.device_kind, device_count=jax.device_count())
    try:
        stats = dev.memory_stats() or {}
        if "bytes_limit" in stats:
            info["memory_bytes"] = int(stats["bytes_limit"])
    except Exception:
        pass
    return info


def run_metadata() -> dict:
    """Device, versions, UTC date and git commit: what every result JSON carries."""
    try:
        dev = device_info()
        device = f"{dev['platform']}: {dev['device_kind']} x{dev['device_count']}"
    except Exception as e:  # still record the run
        dev, device = {"error": repr(e)}, "unknown"
    return dict(
        device=device,
        device_info=dev,
        versions=versions(),
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        git_commit=git("rev-parse", "HEAD"),
        git_dirty=bool(git("status", "--porcelain", "--untracked-files=no")),
        hostname=platform.node(),
        cpu_count=os.cpu_count(),
        argv=sys.argv,
    )


def on_accelerator() -> bool:
    import jax

    return jax.devices()[0].platform != "cpu"


def block(x):
    import jax

    return jax.block_until_ready(x)


def time_fn(fn, *args, warmup: int = 3, iters: int = 20, min_time_s: float = 0.0,
            calls_per_sample: int = 10) -> dict:
    """Median time of one ``fn(*args)`` after ``warmup`` calls (compile included there).

    Each sample dispatches ``calls_per_sample`` calls back to back and waits once, so the
    per-call host sync (~0.3 ms on the GPU VMs here) does not set a floor under short kernels;
    on CPU (synchronous execution) it changes nothing.
    """
    t0 = time.perf_counter()
    for _ in range(max(1, warmup)):
        block(fn(*args))
    first = time.perf_counter() - t0
    k = max(1, calls_per_sample)
    times = []
    start = time.perf_counter()
    while len(times) < iters or (time.perf_counter() - start) < min_time_s:
        t = time.perf_counter()
        out = None
        for _ in range(k):
            out = fn(*args)
        block(out)
        times.append((time.perf_counter() - t) / k)
        if len(times) >= 10 * max(iters, 1):
            break
    return dict(median_s=statistics.median(times), min_s=min(times), mean_s=statistics.fmean(times),
                iters=len(times), calls_per_sample=k, warmup_s=first)


def measure_copy_bandwidth(nbytes: int | None = None, iters: int = 20) -> dict:
    """Device copy bandwidth in bytes read + written per second (median of ``iters`` copies).

    A jitted elementwise ``x * 1 + 0`` over a large f32 buffer (1 GiB on an accelerator, 64 MiB
    on CPU): one read and one write per element, what a memory-bound kernel can hope for.
    """
    import jax
    import jax.numpy as jnp

    dev = jax.devices()[0]
    if nbytes is None:
        nbytes = (1 << 30) if dev.platform != "cpu" else (64 << 20)
    n = nbytes // 4
    x = jnp.arange(n, dtype=jnp.float32)
    copy = jax.jit(lambda a: a * 1.0 + 0.0)
    t = time_fn(copy, x, warmup=3, iters=iters)
    del x
    return dict(bandwidth_bytes_per_s=2 * n * 4 / t["median_s"], copy_bytes=n * 4,
                median_s=t["median_s"], iters=t["iters"], device=dev.device_kind,
                method="jit(x*1+0) over f32, read+write")


def add_output_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--output-json", default=None,
                   help="result file (default: a timestamped name under --result-dir)")
    g.add_argument("--result-dir", default=None, help=f"default {RESULTS_DIR}")
    g.add_argument("--no-plot", action="store_true", help="skip the PNG")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bars")


def result_path(kind: str, args=None, tag: str = "") -> str:
    if args is not None and getattr(args, "output_json", None):
        return args.output_json
    d = (getattr(args, "result_dir", None) if args is not None else None) or RESULTS_DIR
    os.makedirs(d, exist_ok=True)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return os.path.join(d, f"{kind}{tag}-{stamp}.json")


def _json_default(o):
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:
        pass
    return str(o)


def write_json(path: str, result: dict) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=_json_default)
    return path


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def bar_plot(path: str, groups: list[str], series: dict[str, list[float | None]], *,
             ylabel: str, title: str, hline: float | None = None, hline_label: str = "") -> str:
    """Grouped bars (one group per case, one bar per series); missing values are skipped."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups) + 2), 4.2))
    width = 0.8 / max(1, len(series))
    for i, (name, vals) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        pts = [(x, v) for x, v in zip(xs, vals) if v is not None]
        if pts:
            bars = ax.bar([p[0] for p in pts], [p[1] for p in pts], width, label=name)
            ax.bar_label(bars, fmt="%.2g", fontsize=7)
    if hline is not None:
        ax.axhline(hline, color="k", linestyle="--", linewidth=1, label=hline_label or None)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def progress(iterable, *, disable: bool = False, **kw):
    from tqdm.auto import tqdm

    return tqdm(iterable, disable=disable, **kw)
