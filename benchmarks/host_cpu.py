"""The engine loop's own CPU time per step, trees against trees: the main thread's CPU time
(``time.thread_time``) over ``LLM.generate``, less what it spends inside ``runner.dispatch``
and ``runner.fetch`` (argument transfer, launches, waits), per step.

Thread CPU time does not count the time the thread waits for a core, so on a shared machine it
says what the host's Python and numpy cost where wall-clock phases (``throughput.py``) swing
by 2-3x with the load. Each tree runs in its own process (``PYTHONPATH``), alternating::

    python -m benchmarks.host_cpu before=<tree> after=<tree> --model <tiny llama> \\
        --output-json host_cpu.json

The workload is ``throughput.py``'s host-phase one (512 prompts of 64 tokens -> 32, greedy,
``max_num_seqs`` 256, ``max_num_batched_tokens`` 2048, ``max_model_len`` 128), with
``enforce_eager`` (steps compile on first use; the first pass is not timed). Each pass also
reports the CPU of the loop's parts (``PHASES``: schedule, the two scheduler updates, the output
processor, the batch's apply and prepare_inputs; "rest" is what is left besides dispatch and
fetch).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import common as C  # noqa: E402

# the loop's parts timed on their own (main-thread CPU, not nested in one another); "rest" is
# the loop less them and dispatch / fetch (engine glue, adding requests, garbage collection)
PHASES = [("eng.scheduler", "schedule"), ("eng.scheduler", "update_after_dispatch"),
          ("eng.scheduler", "update_from_output"), ("eng.output_processor", "process"),
          ("eng.input_batch", "apply"), ("eng.input_batch", "prepare_inputs")]

CHILD = r'''
import json, sys, time
PHASES = json.loads(sys.argv[2])
import numpy as np
from jaxserve import LLM, SamplingParams
a = json.loads(sys.argv[1])
llm = LLM(a["model"], max_num_seqs=a["max_num_seqs"], max_num_batched_tokens=a["budget"],
          max_model_len=a["max_model_len"], enforce_eager=True)
rng = np.random.default_rng(0)
prompts = [rng.integers(3, 500, a["input_len"]).tolist() for _ in range(a["num_prompts"])]
sp = SamplingParams(temperature=0, max_tokens=a["output_len"], ignore_eos=True, detokenize=False)
llm.generate(prompts, sp, use_tqdm=False)  # compiles every shape the timed passes use
if a["freeze"]:  # what the end of warm-up does without enforce_eager: the compiles' heap too
    import gc
    gc.collect()
    gc.freeze()
eng, acc = llm.llm_engine, {"steps": 0, "device": 0.0}
phase = {}
step = eng.step
def counted():
    acc["steps"] += 1
    return step()
eng.step = counted
def timed(obj, name, key):
    f = getattr(obj, name)
    def g(*args, **kwargs):
        c = time.thread_time()
        try:
            return f(*args, **kwargs)
        finally:
            dt = time.thread_time() - c
            phase[key] = phase.get(key, 0.0) + dt
            if key in ("dispatch", "fetch"):
                acc["device"] += dt
    setattr(obj, name, g)
timed(eng.runner, "dispatch", "dispatch"); timed(eng.runner, "fetch", "fetch")
for obj, name in PHASES:
    timed(eval(obj), name, name)
out = []
for _ in range(a["passes"]):
    acc.update(steps=0, device=0.0)
    phase.clear()
    c0 = time.thread_time()
    llm.generate(prompts, sp, use_tqdm=False)
    total = time.thread_time() - c0
    n = acc["steps"]
    phases = {k: 1e3 * v / n for k, v in phase.items() if k not in ("dispatch", "fetch")}
    phases["rest"] = 1e3 * (total - sum(phase.values())) / n
    out.append(dict(host_cpu_ms_per_step=1e3 * (total - acc["device"]) / n,
                    dispatch_fetch_cpu_ms_per_step=1e3 * acc["device"] / n,
                    steps=n, phases_cpu_ms_per_step=phases))
print("RESULT " + json.dumps(out))
'''


def run_tree(tree: str, args) -> list[dict]:
    cfg = dict(model=args.model, max_num_seqs=args.max_num_seqs, budget=args.max_num_batched_tokens,
               max_model_len=args.max_model_len, input_len=args.input_len,
               output_len=args.output_len, num_prompts=args.num_prompts, passes=args.passes,
               freeze=args.freeze_after_compile)
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    env.setdefault("JAX_PLATFORMS", "cpu")
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg), json.dumps(PHASES)],
                       cwd="/", env=env,
                       capture_output=True, text=True, timeout=args.timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not lines:
        raise RuntimeError(f"{tree}: rc {p.returncode}\n{p.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trees", nargs="+", help="NAME=DIR (a source tree holding jaxserve/)")
    p.add_argument("--model", required=True)
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=128)
    p.add_argument("--passes", type=int, default=3, help="timed passes per process")
    p.add_argument("--rounds", type=int, default=2, help="processes per tree, alternating")
    p.add_argument("--freeze-after-compile", action="store_true",
                   help="gc.freeze() after the compiling pass, as warm-up's end does without "
                        "enforce_eager (else the compiles' garbage stays in every full "
                        "collection of the timed passes: a ~40 ms pause every ~100 steps)")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--output-json", required=True)
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    trees = dict(t.split("=", 1) for t in args.trees)
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for r in range(args.rounds):
        for name, tree in trees.items():
            runs[name] += run_tree(tree, args)
            print(f"round {r + 1} {name}: " + ", ".join(
                f"{x['host_cpu_ms_per_step']:.2f}" for x in runs[name][-args.passes:]),
                flush=True)
    summary = {name: dict(
        host_cpu_ms_per_step=statistics.median(x["host_cpu_ms_per_step"] for x in rs),
        dispatch_fetch_cpu_ms_per_step=statistics.median(
            x["dispatch_fetch_cpu_ms_per_step"] for x in rs),
        phases_cpu_ms_per_step={k: statistics.median(x["phases_cpu_ms_per_step"][k] for x in rs)
                                for k in rs[0]["phases_cpu_ms_per_step"]},
        passes=rs) for name, rs in runs.items()}
    names = list(trees)
    out = dict(benchmark="host_cpu", **C.run_metadata(), config=vars(args), trees=trees,
               sets=summary)
    if len(names) >= 2:
        out["host_cpu_ratio"] = (summary[names[-1]]["host_cpu_ms_per_step"]
                                 / summary[names[0]]["host_cpu_ms_per_step"])
    if not args.no_plot:
        out["plot"] = C.bar_plot(
            args.output_json[:-5] + ".png", names,
            {"host CPU ms / step (less dispatch, fetch)": [summary[n]["host_cpu_ms_per_step"]
                                                           for n in names],
             "dispatch + fetch CPU ms / step": [summary[n]["dispatch_fetch_cpu_ms_per_step"]
                                                for n in names],
             **{k: [summary[n]["phases_cpu_ms_per_step"].get(k) for n in names]
                for k in summary[names[0]]["phases_cpu_ms_per_step"]}},
            ylabel="main-thread CPU ms per step", title="engine loop CPU per step",
            hline=3.0, hline_label="target host 3.0 ms")
    C.write_json(args.output_json, out)
    for n in names:
        print(f"{n}: host CPU {summary[n]['host_cpu_ms_per_step']:.2f} ms / step, dispatch + "
              f"fetch {summary[n]['dispatch_fetch_cpu_ms_per_step']:.2f} ms; " + ", ".join(
                  f"{k} {v:.2f}" for k, v in summary[n]["phases_cpu_ms_per_step"].items()))
    if "host_cpu_ratio" in out:
        print(f"ratio {names[-1]} / {names[0]}: {out['host_cpu_ratio']:.3f}")
    print(f"wrote {args.output_json}")
    return out


if __name__ == "__main__":
    main()
