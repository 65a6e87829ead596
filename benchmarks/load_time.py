"""Model load time: orbax checkpoint vs safetensors, into the serving mesh.

Both loads end with every parameter placed with its ``NamedSharding`` (``block_until_ready``):
safetensors reads each tensor on the host, casts it and ``device_put``s it; orbax restores
straight into the target shardings and dtype. The runs alternate (page cache warm for both after
the first pair); the median of ``--repeats`` is reported. ``--preset`` writes the preset's dummy
weights as safetensors first, so any size can be measured without a download.

    python benchmarks/load_time.py --model demo-random
    python benchmarks/load_time.py --preset tinyllama-1.1b --dtype bfloat16 --repeats 3
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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="HF dir with safetensors, or demo-random")
    p.add_argument("--preset", default=None, help="write this preset with dummy weights")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temp dir)")
    C.add_output_args(p)
    args = p.parse_args(argv)
    if not args.model and not args.preset:
        args.model = "demo-random"
    return args


def _write_preset_safetensors(preset: str, out: str, dtype) -> str:
    """The preset's config + tokenizer, and dummy weights saved as one safetensors file."""
    import numpy as np
    from flax import nnx
    from safetensors.numpy import save_file

    from jaxserve.loaders.model_loader import load_model
    from jaxserve.testing.presets import write_preset

    write_preset(preset, out)
    model = load_model(out, dtype=dtype, load_format="dummy")[0]
    tensors = {".".join(map(str, k)): np.asarray(v.get_value())
               for k, v in nnx.to_flat_state(nnx.split(model)[1])}
    save_file(tensors, os.path.join(out, "model.safetensors"))
    return out


def _timed_load(path: str, load_format: str, dtype, mesh) -> tuple[float, int]:
    import jax

    from jaxserve.loaders.model_loader import load_model

    t0 = time.perf_counter()
    model = load_model(path, dtype=dtype, load_format=load_format, mesh=mesh)[0]
    leaves = [x for x in jax.tree_util.tree_leaves(model) if hasattr(x, "nbytes")]
    jax.block_until_ready(leaves)
    dt = time.perf_counter() - t0
    return dt, int(sum(x.nbytes for x in leaves))


def main(argv=None) -> dict:
    args = parse_args(argv)
    from jaxserve.loaders.model_loader import _resolve_model_path, convert_to_orbax
    from jaxserve.sharding import make_mesh

    mesh = make_mesh(args.tensor_parallel_size) if args.tensor_parallel_size > 1 else None
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        if args.preset:
            src = _write_preset_safetensors(args.preset, os.path.join(tmp, "src"), args.dtype)
        else:
            src = str(_resolve_model_path(args.model))
        t0 = time.perf_counter()
        orbax_dir = str(convert_to_orbax(src, os.path.join(tmp, "orbax"), dtype=args.dtype))
        convert_s = time.perf_counter() - t0
        times = {"safetensors": [], "orbax": []}
        nbytes = 0
        for _ in range(args.repeats):
            for fmt, path in (("safetensors", src), ("orbax", orbax_dir)):
                dt, nbytes = _timed_load(path, fmt, args.dtype, mesh)
                times[fmt].append(dt)
                print(f"{fmt:12s} {dt:7.2f} s", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = dict(benchmark="load_time", **C.run_metadata(),
                  config=dict(model=args.model, preset=args.preset, dtype=args.dtype,
                              tensor_parallel_size=args.tensor_parallel_size,
                              repeats=args.repeats),
                  param_bytes=nbytes, convert_s=convert_s, times_s=times, median_s=med,
                  gb_per_s={k: nbytes / v / 1e9 for k, v in med.items()},
                  orbax_speedup=med["safetensors"] / med["orbax"])
    tag = f"-{args.preset or os.path.basename(str(args.model))}-tp{args.tensor_parallel_size}"
    path = C.write_json(C.result_path("load_time", args, tag), result)
    print(f"median load: safetensors {med['safetensors']:.2f} s, orbax {med['orbax']:.2f} s "
          f"({result['orbax_speedup']:.2f}x), {nbytes / 2**20:.0f} MiB -> {path}")
    return result


if __name__ == "__main__":
    main()
