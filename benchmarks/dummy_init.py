"""Dummy weights (``load_format="dummy"``): how long they take to make, against one jit of the
whole init as the baseline.

The loader builds a one-device dummy model op by op, each initialiser compiled once per
distinct weight shape. The baseline is what it did before: the model's whole init as one jitted
program, here only lowered and compiled ahead of time (nothing is allocated, so it also runs for
shapes larger than the machine's memory; ``--skip-load`` then skips the real load).

    python -m benchmarks.dummy_init --preset tinyllama-1.1b --dtype bfloat16
    python -m benchmarks.dummy_init --hybrid-shape 27b --skip-load
    python -m benchmarks.dummy_init --hybrid-shape 27b --num-layers 4
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import common as C  # noqa: E402

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a model directory (its config.json is enough)")
    src.add_argument("--preset", help="a preset of jaxserve.testing.presets")
    src.add_argument("--hybrid-shape", help="a Qwen 3.6 shape of benchmarks/hybrid_decode.py")
    p.add_argument("--num-layers", type=int, default=None,
                   help="--hybrid-shape cut to this depth (a multiple of 4): the same weight "
                        "shapes, so the same programs, in less memory")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--skip-load", action="store_true", help="only the baseline's compile")
    p.add_argument("--skip-one-jit", action="store_true", help="only the real load")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    if args.num_layers is not None and not args.hybrid_shape:
        p.error("--num-layers cuts a --hybrid-shape only")
    return args


def model_dir(args) -> str:
    if args.model:
        return args.model
    if args.preset:
        from jaxserve.testing.presets import write_preset

        return write_preset(args.preset, os.path.join(tempfile.mkdtemp(), args.preset))
    from benchmarks.hybrid_decode import write_shape

    return write_shape(args.hybrid_shape, num_layers=args.num_layers)


def one_jit_compile_s(path: str, dtype: str) -> dict:
    """Lower and compile the loader's init as one program (the baseline), timed apart."""
    from pathlib import Path

    import jax

    from jaxserve.config import ModelConfig
    from jaxserve.loaders.model_loader import _read_config, dummy_init_fn

    init = dummy_init_fn(ModelConfig.from_hf_config(_read_config(Path(path))), dtype)
    t0 = time.perf_counter()
    lowered = jax.jit(init).lower()
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    return dict(lower_s=t1 - t0, compile_s=t2 - t1, total_s=t2 - t0)


def dummy_load_s(path: str, dtype: str) -> dict:
    """The loader's dummy weights, every leaf ready; and how many programs it compiled."""
    import jax
    from jax import monitoring

    from jaxserve.loaders.model_loader import load_model

    compiles = []

    def on_event(event, secs, **kw):
        if event == COMPILE_EVENT:
            compiles.append(secs)

    monitoring.register_event_duration_secs_listener(on_event)
    try:
        t0 = time.perf_counter()
        model = load_model(path, dtype=dtype, load_format="dummy")[0]
        leaves = [x for x in jax.tree_util.tree_leaves(model) if hasattr(x, "nbytes")]
        jax.block_until_ready(leaves)
        total = time.perf_counter() - t0
    finally:
        monitoring.unregister_event_duration_listener(on_event)
    return dict(total_s=total, num_compiles=len(compiles), compile_s=sum(compiles),
                param_bytes=int(sum(x.nbytes for x in leaves)))


def main(argv=None) -> dict:
    args = parse_args(argv)
    path = model_dir(args)
    json_path = args.output_json or C.result_path("dummy_init", args)
    out = dict(benchmark="dummy_init", **C.run_metadata(), config=vars(args), model_dir=path)
    if not args.skip_load:  # first: the baseline's compile must not warm anything it uses
        out["dummy_load"] = dummy_load_s(path, args.dtype)
        C.write_json(json_path, out)  # kept if the baseline's compile outlasts a time cap
        print(f"dummy load: {out['dummy_load']['total_s']:.1f} s, "
              f"{out['dummy_load']['num_compiles']} programs compiled", flush=True)
    if not args.skip_one_jit:
        out["one_jit"] = one_jit_compile_s(path, args.dtype)
        print(f"one jit of the whole init: lower {out['one_jit']['lower_s']:.1f} s, compile "
              f"{out['one_jit']['compile_s']:.1f} s", flush=True)
    if "dummy_load" in out and "one_jit" in out:
        out["one_jit_compile_over_dummy_load"] = (out["one_jit"]["total_s"]
                                                  / out["dummy_load"]["total_s"])
    bars = {"dummy load\n(op by op, all of it)": out.get("dummy_load", {}).get("total_s"),
            "one jit: lower + compile\n(before running anything)":
                out.get("one_jit", {}).get("total_s")}
    bars = {k: v for k, v in bars.items() if v is not None}
    if not args.no_plot and bars:
        out["plot"] = C.bar_plot(json_path[:-5] + ".png", list(bars),
                                 {"seconds": list(bars.values())}, ylabel="s",
                                 title=f"dummy weights: {os.path.basename(path)}")
    C.write_json(json_path, out)
    print(f"wrote {json_path}")
    return out


if __name__ == "__main__":
    main()
