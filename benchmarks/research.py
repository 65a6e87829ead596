"""Research controls: ``update_weights`` and ``sleep`` / ``wake_up`` times, against a restart.

One engine (SmolLM2-135M by default, the model ``jaxserve serve`` serves; ``--preset`` for a
preset's shape with dummy weights, e.g. the 1.1B on a GPU); each case repeated, median reported:

- ``update_weights`` from arrays already placed as the engine's (a trainer's jitted output: the
  target is <= 20 ms, i.e. no copy), from host (numpy) arrays (cast and placed), and from a
  safetensors directory (read, cast, placed);
- ``sleep(1)`` / ``wake_up()`` (weights to host memory and back, KV pool dropped and made
  again) and ``sleep(2)`` / ``wake_up()`` (weights reloaded from the last path), with the
  device bytes live while asleep (live arrays on CPU, the allocator's bytes in use on a GPU);
- the baseline: building a new engine of the same model (what a restart costs).

Every swap is checked (greedy after an update from the path equals greedy after the same weights
as arrays; wake-up restores the greedy of before) and no step compiles.

    python benchmarks/research.py                                   # SmolLM2, CPU
    python benchmarks/research.py --preset tinyllama-1.1b --dtype bfloat16    # GPU stage
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common as C  # noqa: E402

TARGET_PLACED_MS = 20.0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="model path (default: jaxserve serve's)")
    p.add_argument("--preset", default=None, help="a preset's shape with dummy weights")
    p.add_argument("--tiny", action="store_true", help="the tiny test shape (CPU check)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    C.add_output_args(p)
    return p.parse_args(argv)


def _median_ms(fn, repeats: int) -> tuple[float, list[float]]:
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(ts), ts


def _device_bytes() -> int:
    """Device memory in use: the allocator's count on an accelerator, live arrays on CPU."""
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_in_use" in stats and C.on_accelerator():
        return int(stats["bytes_in_use"])
    return sum(x.nbytes for x in jax.live_arrays())


def _model(args, work: str) -> tuple[str, str]:
    """(model path, its name in the result)."""
    if args.tiny:
        from jaxserve.testing.tiny_model import make_tiny_model

        return str(make_tiny_model("llama", os.path.join(work, "tiny"))), "tiny-llama"
    if args.preset:
        from jaxserve.testing.presets import write_preset

        return write_preset(args.preset, os.path.join(work, args.preset)), args.preset
    if args.model:
        return args.model, os.path.basename(args.model.rstrip("/"))
    from jaxserve.loaders.gguf import default_model_path

    return default_model_path(), "SmolLM2-135M-Instruct"


def run(args) -> dict:
    import jax
    import numpy as np
    from safetensors.numpy import save_file

    from jaxserve import LLM, SamplingParams

    work = tempfile.mkdtemp(prefix="research-bench-")
    model, name = _model(args, work)
    engine_kw = dict(dtype=args.dtype, max_model_len=args.max_model_len,
                     gpu_memory_utilization=args.gpu_memory_utilization,
                     max_num_seqs=16, max_num_batched_tokens=256)
    if args.preset:
        engine_kw["load_format"] = "dummy"
    t0 = time.perf_counter()
    llm = LLM(model, **engine_kw)
    start_s = time.perf_counter() - t0
    runner = llm.llm_engine.runner
    warm_compiles = runner.num_compiles
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [[10 + i, 200 + 3 * i, 31, 47, 5 + i, 99] for i in range(4)]

    def outputs():
        return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]

    before = outputs()
    weights = llm.get_weights()
    param_bytes = sum(x.nbytes for x in weights.values())
    kv_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(runner.kv_pages))
    shardings = {n: x.sharding for n, x in weights.items()}
    # a trainer's step output: new buffers, placed as the engine's
    nudge = jax.jit(lambda p: jax.tree_util.tree_map(lambda x: (x * 1.01).astype(x.dtype), p),
                    out_shardings=shardings)
    placed = jax.block_until_ready(nudge(weights))
    host = {n: np.asarray(x) for n, x in placed.items()}
    ckpt = os.path.join(work, "new")
    os.makedirs(ckpt)
    save_file(host, os.path.join(ckpt, "model.safetensors"))
    cases = {}
    cases["update_weights: placed arrays"] = _median_ms(lambda: llm.update_weights(placed),
                                                        args.repeats)
    after_arrays = outputs()
    no_copy = all(a is placed[n] for n, a in llm.get_weights().items())
    cases["update_weights: host arrays"] = _median_ms(lambda: llm.update_weights(host),
                                                      args.repeats)
    cases["update_weights: safetensors path"] = _median_ms(lambda: llm.update_weights(ckpt),
                                                           args.repeats)
    after_path = outputs()

    live = _device_bytes()
    asleep = {}

    def cycle(level):
        t = time.perf_counter()
        llm.sleep(level)
        s = time.perf_counter() - t
        asleep[level] = live - _device_bytes()
        t = time.perf_counter()
        llm.wake_up()
        return 1e3 * s, 1e3 * (time.perf_counter() - t)

    sleep_wake = {lv: [cycle(lv) for _ in range(args.repeats)] for lv in (1, 2)}
    for lv, pairs in sleep_wake.items():
        cases[f"sleep({lv})"] = (statistics.median(p[0] for p in pairs), [p[0] for p in pairs])
        cases[f"wake_up after sleep({lv})"] = (statistics.median(p[1] for p in pairs),
                                               [p[1] for p in pairs])
    after_wake = outputs()
    compiles = runner.num_compiles - warm_compiles
    placed_ms = cases["update_weights: placed arrays"][0]
    res = dict(
        C.run_metadata(), benchmark="research", model=name, dtype=args.dtype,
        param_bytes=param_bytes, kv_pool_bytes=kv_bytes, repeats=args.repeats,
        baseline=dict(name="a new engine (restart): load + warm-up", seconds=start_s),
        cases={k: dict(median_ms=m, all_ms=ts) for k, (m, ts) in cases.items()},
        released_bytes_asleep={f"level{lv}": b for lv, b in asleep.items()},
        released_share_of_engine_bytes={f"level{lv}": b / (param_bytes + kv_bytes)
                                        for lv, b in asleep.items()},
        target=dict(placed_update_ms=TARGET_PLACED_MS, met=placed_ms <= TARGET_PLACED_MS,
                    ratio_to_target=placed_ms / TARGET_PLACED_MS),
        ratio_update_to_restart={k: m / (1e3 * start_s) for k, (m, _) in cases.items()
                                 if k.startswith("update_weights")},
        checks=dict(no_copy_from_placed_arrays=no_copy,
                    outputs_changed_by_update=after_arrays != before,
                    path_equals_arrays=after_path == after_arrays,
                    wake_restores_outputs=after_wake == after_path,
                    compiles_after_warmup=compiles),
    )
    return res


def plot(res: dict, path: str) -> str:
    plt = C.pyplot()
    names = list(res["cases"]) + ["restart (baseline)"]
    vals = [c["median_ms"] for c in res["cases"].values()] + [1e3 * res["baseline"]["seconds"]]
    fig, ax = plt.subplots(figsize=(9, 4.6))
    bars = ax.barh(names, vals, color=["C0"] * 3 + ["C2"] * 4 + ["C3"])
    ax.bar_label(bars, fmt="%.3g ms", fontsize=7)
    ax.axvline(TARGET_PLACED_MS, color="k", linestyle="--", linewidth=1,
               label=f"target {TARGET_PLACED_MS:.0f} ms (placed arrays)")
    ax.set_xscale("log")
    ax.set_xlabel("milliseconds (median, log scale)")
    ax.invert_yaxis()
    ax.set_title(f"{res['model']} ({res['dtype']}, {res['param_bytes'] / 2**20:.0f} MiB params) "
                 f"on {res['device']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> dict:
    args = parse_args(argv)
    res = run(args)
    tag = "-" + res["model"].lower().replace("/", "_")
    out = C.write_json(C.result_path("research", args, tag), res)
    print(f"wrote {out}")
    if not args.no_plot:
        print(f"wrote {plot(res, out[:-5] + '.png')}")
    for k, c in res["cases"].items():
        print(f"  {k:34s} {c['median_ms']:10.2f} ms")
    print(f"  {'restart (baseline)':34s} {1e3 * res['baseline']['seconds']:10.2f} ms")
    print(f"  checks: {res['checks']}; released asleep: "
          f"{res['released_share_of_engine_bytes']}")
    return res


if __name__ == "__main__":
    main()
