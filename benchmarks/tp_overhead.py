"""Cost of the tensor-parallel mesh path at tp=1: throughput through the mesh vs unsharded.

Runs ``benchmarks/throughput.py`` (same flags) twice per repeat in fresh processes: once on the
plain single-device path, once with ``JAXSERVE_FORCE_MESH=1``, which builds a 1-device ``tp`` mesh
and runs attention through ``shard_map`` with pinned output shardings, i.e. exactly what
``--tensor-parallel-size N`` runs, on one device. The runs alternate so drift hits both equally;
the best of each is compared. Target: overhead < 3 %.

    python benchmarks/tp_overhead.py --preset tinyllama-1.1b --num-prompts 256 \\
        --input-len 512 --output-len 128
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common as C  # noqa: E402

TARGET = 0.03
METRICS = ("output_throughput", "total_token_throughput", "decode_step_throughput",
           "device_ms_per_step", "host_ms_per_step", "compiles_after_warmup")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", default="tinyllama-1.1b", help="model shape, dummy weights")
    p.add_argument("--model", default=None, help="a model directory instead of --preset")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="alternating runs of each path")
    p.add_argument("--extra", default="", help="more flags for throughput.py, one string")
    p.add_argument("--timeout", type=int, default=1200, help="seconds per throughput run")
    C.add_output_args(p)
    return p.parse_args(argv)


def _run(args, mesh: bool, out_json: str) -> dict:
    model = ["--model", args.model] if args.model else ["--preset", args.preset]
    cmd = [sys.executable, os.path.join(C.BENCH_DIR, "throughput.py"), *model,
           "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--output-json", out_json, "--no-plot",
           "--disable-tqdm", *args.extra.split()]
    env = dict(os.environ, JAXSERVE_FORCE_MESH="1" if mesh else "0")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode:
        raise SystemExit(f"throughput.py failed (mesh={mesh}):\n{proc.stderr[-3000:]}")
    with open(out_json) as f:
        r = json.load(f)
    j = r.get("jaxserve", r)
    return {k: j.get(k, r.get(k)) for k in METRICS}


def main(argv=None) -> dict:
    args = parse_args(argv)
    runs = {"unsharded": [], "mesh_tp1": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for name in runs:
                r = _run(args, name == "mesh_tp1", os.path.join(tmp, f"{name}-{i}.json"))
                runs[name].append(r)
                print(f"{name} run {i}: {r['output_throughput']:.1f} output tok/s, "
                      f"{r['device_ms_per_step']:.2f} ms device/step", flush=True)
    best = {k: max(v, key=lambda r: r["output_throughput"]) for k, v in runs.items()}
    overhead = 1.0 - best["mesh_tp1"]["output_throughput"] / best["unsharded"]["output_throughput"]
    result = dict(benchmark="tp_overhead", **C.run_metadata(),
                  config=dict(preset=None if args.model else args.preset, model=args.model,
                              num_prompts=args.num_prompts,
                              input_len=args.input_len, output_len=args.output_len,
                              repeats=args.repeats, extra=args.extra),
                  runs=runs, best=best, output_throughput_overhead=overhead,
                  target=TARGET, within_target=overhead < TARGET)
    tag = f"-{os.path.basename(args.model or args.preset)}"
    path = C.write_json(C.result_path("tp_overhead", args, tag), result)
    print(f"tp=1 mesh path vs unsharded: {100 * overhead:+.2f} % output throughput cost "
          f"(target < {100 * TARGET:.0f} %) -> {path}")
    return result


if __name__ == "__main__":
    main()
