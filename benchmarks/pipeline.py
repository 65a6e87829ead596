"""The pipeline bubble, measured: throughput with P step plans in flight against one in flight,
for P pipeline stages on forced CPU devices.

    python benchmarks/pipeline.py --stages 2 4 \
        --result-dir benchmarks/results/cpu-pipeline-2026-11-25
    (XLA_FLAGS is set per case; on a machine with accelerators pass --real-devices)

Each (P, plans in flight) case is a fresh process with ``--xla_force_host_platform_device_count=P``
and single-threaded XLA:CPU programs (``--xla_cpu_multi_thread_eigen=false``), so a stage is one
core's worth of work and stages can only overlap when plans of different micro-batches are in
flight. One plan in flight is the same engine with ``async_scheduling=False`` (each step read
before the next is scheduled): every stage waits for the others, the bubble is (P-1)/P of the
time. With P plans in flight the ideal is P x (capped by the cores the process gets: each run
records ``cpu_seconds_per_second``, the cores it was given). Both cases run the same requests
at once (``max_num_seqs`` = P x ``--rows``): one plan of all of them, or P micro-batches. The
model is a random Llama (hidden 1024, 8 layers) so that a stage's compute outweighs the host's
per-step work; every request decodes exactly ``--output-len`` tokens (``ignore_eos``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common as C  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--rows", type=int, default=8,
                   help="rows of one micro-batch: max_num_seqs is P x rows in both cases, so "
                        "both run the same requests at once (one plan of P x rows, or P plans "
                        "of about rows each)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per case (best kept)")
    p.add_argument("--real-devices", action="store_true",
                   help="use the machine's devices instead of forced CPU devices")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--replot", default=None, metavar="JSON",
                   help="recompute the summary and the PNG of a result file, run nothing")
    C.add_output_args(p)
    return p.parse_args(argv)


def _case(model: str, stages: int, in_flight: int, args) -> dict:
    """One case in this process (run as the child): tokens/s of generation, best of repeats."""
    import jax

    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.entrypoints.llm import LLM

    llm = LLM(model, pipeline_parallel_size=stages, async_scheduling=in_flight > 1,
              max_num_seqs=stages * args.rows, max_num_batched_tokens=128, min_token_bucket=1,
              max_model_len=256, dtype="float32", enable_prefix_caching=False)
    eng = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 500 + 1 for j in range(args.input_len)]}
               for i in range(args.num_prompts)]
    llm.generate(prompts[:stages * args.rows], sp, use_tqdm=False)  # first real steps
    runs = []
    for _ in range(args.repeats):
        t0, c0 = time.perf_counter(), os.times()
        out = llm.generate(prompts, sp, use_tqdm=False)
        dt, c1 = time.perf_counter() - t0, os.times()
        n = sum(len(o.outputs[0].token_ids) for o in out)
        total = n + args.num_prompts * args.input_len
        # cores this process actually got: stages can only overlap with more than one
        cores = (c1.user + c1.system - c0.user - c0.system) / dt
        runs.append(dict(seconds=dt, output_tokens=n, output_throughput=n / dt,
                         total_token_throughput=total / dt, cpu_seconds_per_second=cores))
    best = max(runs, key=lambda r: r["output_throughput"])
    return dict(stages=stages, plans_in_flight=in_flight, devices=len(jax.devices()),
                engine_depth=eng.batch_queue_size, max_in_flight=eng.max_in_flight,
                partition=eng.runner.stages.partition, runs=runs, **best)


def _spawn(model: str, stages: int, in_flight: int, args) -> dict:
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
               PYTHONPATH=C.ROOT)
    if not args.real_devices:
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count={stages} "
                            "--xla_cpu_multi_thread_eigen=false")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", model, str(stages),
           str(in_flight), json.dumps(vars(args))]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bubble(stages: int) -> float:
    """The idle share of P stages with one plan in flight: (P-1)/P."""
    return (stages - 1) / stages


def summarize(cases: list[dict], stages: list[int]) -> list[dict]:
    """Speed-up of P plans in flight over one, per P, with the cores each case got."""
    out = []
    for p in stages:
        one = next(c for c in cases if c["stages"] == p and c["plans_in_flight"] == 1)
        full = next(c for c in cases if c["stages"] == p and c["plans_in_flight"] == p)
        out.append(dict(stages=p, speedup=full["output_throughput"] / one["output_throughput"],
                        ideal_with_a_core_per_stage=p, bubble_one_in_flight=bubble(p),
                        cores_one=one["cpu_seconds_per_second"],
                        cores_full=full["cpu_seconds_per_second"]))
    return out


def plot(result: dict, path: str) -> str:
    stages = result["config"]["stages"]
    cases = result["cases"]
    series = {"1 plan in flight": [], "P plans in flight": []}
    for p in stages:
        for name, k in (("1 plan in flight", 1), ("P plans in flight", p)):
            series[name].append(next(c["output_throughput"] for c in cases
                                     if c["stages"] == p and c["plans_in_flight"] == k))
    cores = ", ".join(f"P={s['stages']}: {s['cores_one']:.2f} / {s['cores_full']:.2f}"
                      for s in result["summary"])
    where = "real devices" if result["config"].get("real_devices") else "P forced CPU devices"
    return C.bar_plot(path, [f"P={p}" for p in stages], series, ylabel="output tokens/s",
                      title=f"pipeline: 1 vs P plans in flight ({where}, "
                            f"{result['cpu_count']} host cores)\ncores the runs got "
                            f"(1 / P in flight): {cores}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.replot:  # summary and PNG again from a result JSON
        with open(args.replot) as f:
            result = json.load(f)
        result["summary"] = summarize(result["cases"], result["config"]["stages"])
        C.write_json(args.replot, result)
        print("wrote", plot(result, args.replot.replace(".json", ".png")))
        return result
    from jaxserve.testing.tiny_model import make_tiny_model

    tmp = tempfile.mkdtemp(prefix="jaxserve-pp-bench-")
    model = str(make_tiny_model("llama", os.path.join(tmp, "m"), layers=args.layers,
                                hidden=args.hidden, heads=8, kv_heads=4,
                                intermediate=4 * args.hidden, vocab=512, max_position=256))
    cases = []
    for p in args.stages:
        for in_flight in (1, p):
            r = _spawn(model, p, in_flight, args)
            print(f"P={p} plans in flight={in_flight}: {r['output_throughput']:.1f} tok/s "
                  f"(max in flight {r['max_in_flight']}, "
                  f"{r['cpu_seconds_per_second']:.2f} cores)", flush=True)
            cases.append(r)
    result = dict(C.run_metadata(), benchmark="pipeline", config=vars(args), cases=cases,
                  summary=summarize(cases, args.stages))
    path = C.write_json(C.result_path("pipeline", args), result)
    print(json.dumps(result["summary"], indent=1))
    print("wrote", path)
    if not args.no_plot:
        print("wrote", plot(result, path.replace(".json", ".png")))
    return result


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        model, stages, in_flight, a = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
        print(json.dumps(_case(model, stages, in_flight, argparse.Namespace(**json.loads(a)))))
    else:
        main()
