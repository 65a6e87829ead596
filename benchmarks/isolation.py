"""Latency of innocent requests with and without a hostile client in flight (issue #49).

    python benchmarks/isolation.py --result-dir benchmarks/results/cpu-isolation-2026-11-27

Starts ``jaxserve serve`` (API process + engine core) on a tiny random Llama with
``--enable-lora`` and runtime adapter loading, then times ``--requests`` short greedy
completions one after another, twice: alone, and while a hostile client loops over what used
to stall the engine (100k choices, a 100k enum, a 5 MB schema, ``(a{1000}){1000}``, a 2048-choice
grammar inside the limits that really compiles, adapter configs that are a FIFO, 1 GiB and a
symlink to /dev/zero, a NaN adapter). Reports p50 / p99 of the innocent requests in both runs
and how fast each hostile request was answered; writes JSON and a PNG.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import add_output_args, bar_plot, result_path, run_metadata, write_json  # noqa: E402

SHAPES = {f"model.layers.{i}.self_attn.{p}": (64, 64 if p == "q_proj" else 32)
          for i in range(2) for p in ("q_proj", "v_proj")}


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def _hostile_cases(adapters: Path):
    import numpy as np
    from safetensors.numpy import load_file, save_file

    from jaxserve.testing.lora_adapters import write_random_adapter

    dirs = {}
    for kind in ("fifo", "1gib", "dev-zero"):
        d = adapters / f"hostile-{kind}"
        d.mkdir(parents=True)
        cfg = d / "adapter_config.json"
        if kind == "fifo":
            os.mkfifo(cfg)
        elif kind == "1gib":
            with open(cfg, "wb") as f:
                f.truncate(2**30)
        else:
            cfg.symlink_to("/dev/zero")
        dirs[kind] = d
    nan = write_random_adapter(adapters / "nan", SHAPES, r=8, target_modules=["q_proj"])
    f = nan / "adapter_model.safetensors"
    t = load_file(str(f))
    k = sorted(t)[0]
    t[k] = np.full_like(t[k], np.nan)
    save_file(t, str(f))
    dirs["nan"] = nan
    big_schema = {"type": "object", "properties": {
        f"f{i:06d}": {"type": "string", "description": "x" * 40} for i in range(65536)}}
    completions = {
        "choice-100k": {"structured_outputs": {"choice": [f"c{i}" for i in range(100_000)]}},
        "enum-100k": {"structured_outputs": {"json": {"enum": list(range(100_000))}}},
        "schema-5mb": {"structured_outputs": {"json": big_schema}},
        "regex-nested": {"structured_outputs": {"regex": "(a{1000}){1000}"}},
        "choice-2048-ok": None,  # filled per request: a fresh grammar each time, compiled
    }
    return completions, dirs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=40, help="innocent requests per run")
    p.add_argument("--max-tokens", type=int, default=8)
    add_output_args(p)
    args = p.parse_args()
    import httpx

    from jaxserve.testing.lora_adapters import write_random_adapter
    from jaxserve.testing.tiny_model import make_tiny_model
    from tests.server_process import free_port, stop, wait_healthy

    tmp = Path(tempfile.mkdtemp(prefix="jaxserve-isolation-"))
    base = make_tiny_model("llama", tmp / "base")
    adapters = tmp / "adapters"
    write_random_adapter(adapters / "good", SHAPES, r=8, target_modules=["q_proj", "v_proj"])
    completions, dirs = _hostile_cases(adapters)
    port = free_port()
    log = tmp / "server.log"
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONUNBUFFERED="1", JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING="1",
               PYTHONPATH=os.pathsep.join(x for x in (root, os.environ.get("PYTHONPATH")) if x))
    flags = ["--max-model-len", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "32",
             "--min-token-bucket", "32", "--enable-lora", "--max-loras", "2",
             "--max-lora-rank", "8", "--lora-allowed-paths", str(adapters),
             "--uvicorn-log-level", "warning", "--port", str(port)]
    with open(log, "w") as lf:
        proc = subprocess.Popen([sys.executable, "-m", "jaxserve.entrypoints.cli", "serve",
                                 str(base), *flags], stdout=lf, stderr=subprocess.STDOUT,
                                env=env)
    url = f"http://127.0.0.1:{port}"
    body = {"prompt": "the quick brown fox", "max_tokens": args.max_tokens, "temperature": 0,
            "ignore_eos": True}
    try:
        wait_healthy(port, [proc], [log], timeout=600)
        client = httpx.Client(base_url=url, timeout=300)

        def innocent() -> float:
            t = time.perf_counter()
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return time.perf_counter() - t

        for _ in range(10):  # warm: every bucket the innocent request needs
            innocent()
        alone = [innocent() for _ in range(args.requests)]
        hostile_times: dict[str, list[float]] = {}
        statuses: dict[str, set] = {}
        stop_flag = threading.Event()

        def hostile() -> None:
            hc = httpx.Client(base_url=url, timeout=300)
            i = 0
            while not stop_flag.is_set():
                for name, extra in completions.items():
                    if extra is None:
                        extra = {"structured_outputs": {"choice": [
                            f"opt{i}-{j}" for j in range(2048)]}}
                    t = time.perf_counter()
                    r = hc.post("/v1/completions", json={**body, "max_tokens": 2, **extra})
                    hostile_times.setdefault(name, []).append(time.perf_counter() - t)
                    statuses.setdefault(name, set()).add(r.status_code)
                for name, d in dirs.items():
                    t = time.perf_counter()
                    r = hc.post("/v1/load_lora_adapter",
                                json={"lora_name": f"{name}-{i}", "lora_path": str(d)})
                    hostile_times.setdefault(f"adapter-{name}", []).append(
                        time.perf_counter() - t)
                    statuses.setdefault(f"adapter-{name}", set()).add(r.status_code)
                i += 1

        th = threading.Thread(target=hostile, daemon=True)
        th.start()
        time.sleep(0.5)
        beside = [innocent() for _ in range(args.requests)]
        stop_flag.set()
        th.join(120)
    finally:
        stop(proc, timeout=30)
    runs = {"alone": alone, "hostile in flight": beside}
    summary = {k: dict(p50_s=statistics.median(v), p99_s=_pct(v, 99), mean_s=statistics.mean(v),
                       n=len(v)) for k, v in runs.items()}
    hostile_summary = {k: dict(p50_s=statistics.median(v), max_s=max(v), n=len(v),
                               statuses=sorted(statuses[k])) for k, v in hostile_times.items()}
    result = dict(benchmark="isolation", meta=run_metadata(), requests=args.requests,
                  max_tokens=args.max_tokens, innocent=summary, hostile=hostile_summary,
                  model="random tiny Llama (2 layers, hidden 64, vocab 512), CPU",
                  raw=runs)
    path = write_json(result_path("isolation", args), result)
    print(f"wrote {path}")
    for k, s in summary.items():
        print(f"innocent {k:>18}: p50 {s['p50_s'] * 1e3:7.1f} ms  p99 {s['p99_s'] * 1e3:7.1f} ms")
    for k, s in hostile_summary.items():
        print(f"hostile {k:>18}: p50 {s['p50_s'] * 1e3:7.1f} ms  max {s['max_s'] * 1e3:7.1f} ms "
              f"status {s['statuses']}")
    if not args.no_plot:
        png = path[:-5] + ".png"
        bar_plot(png, ["p50", "p99"],
                 {k: [s["p50_s"] * 1e3, s["p99_s"] * 1e3] for k, s in summary.items()},
                 ylabel="innocent request latency (ms)",
                 title="Innocent completions, alone and beside a hostile client")
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
