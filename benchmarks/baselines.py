"""What jaxserve's numbers are compared against, and the code the benchmark scripts share.

* The decode roofline: a decode step must read every weight once plus the KV cache of every
  running sequence; at the copy bandwidth measured in the same run that bounds tokens/s.
* HF transformers ``generate`` (static batches, batch sizes swept, best reported) and HF's
  continuous batching with paged KV (``generate_batch`` and friends, best attention
  implementation), on the same model shape and the same prompts. They run in a subprocess
  (``python benchmarks/baselines.py hf-generate|hf-cb ...``) so torch and XLA never fight over
  device memory, a crash or hang costs only that baseline, and partial results survive a timeout.
* Requests (random or fixed lengths, or ShareGPT), percentiles, the result JSON and its metadata.

Nothing here imports jax at module level: the HF subprocess must not touch the accelerator
through XLA.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH_DIR)
RESULTS_DIR = os.path.join(BENCH_DIR, "results")
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import common  # noqa: E402  (metadata, copy bandwidth, JSON, pyplot)

DTYPE_BYTES = {"float32": 4, "fp32": 4, "float": 4, "bfloat16": 2, "bf16": 2, "float16": 2,
               "fp16": 2, "half": 2}


# ---------------------------------------------------------------------------------------------
# model shapes, presets
# ---------------------------------------------------------------------------------------------
def resolve_model(model: str | None, preset: str | None, workdir: str | None = None) -> str:
    """A model directory: --preset writes config + tokenizer (no weights) to a cache folder."""
    if preset:
        from jaxserve.testing.presets import write_preset
        base = workdir or os.path.join(tempfile.gettempdir(), "jaxserve-presets")
        out = os.path.join(base, preset)
        if not os.path.exists(os.path.join(out, "config.json")):
            write_preset(preset, out)
        return out
    if not model:
        raise SystemExit("give --model DIR or --preset NAME")
    return model


def load_hf_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        raise SystemExit(f"{model_dir} has no config.json (HF model directory expected)")
    with open(path) as f:
        d = json.load(f)
    if "text_config" in d and "hidden_size" not in d:
        d = {**d, **d["text_config"]}
    return d


def dtype_bytes(dtype: str, default: str = "bfloat16") -> int:
    name = default if dtype in (None, "auto") else dtype
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}; got {dtype!r}")
    return DTYPE_BYTES[name]


def kv_bytes_per_token(config: dict, nbytes: int) -> int:
    """K and V of one token in every layer."""
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * nbytes


def weight_bytes(config: dict, nbytes: int) -> int:
    """Bytes of weights a decode step reads. The embedding table is a gather of a few rows, so
    only the LM head counts as a vocab-sized read (the same matrix when tied)."""
    from jaxserve.testing.presets import param_count
    n = param_count(config)
    if not config.get("tie_word_embeddings"):
        n -= config["vocab_size"] * config["hidden_size"]
    return n * nbytes


# ---------------------------------------------------------------------------------------------
# the decode roofline
# ---------------------------------------------------------------------------------------------
def decode_roofline(weight_bytes: int, kv_bytes_per_token: int, batch: int, avg_context: float,
                    bandwidth: float) -> dict:
    """Tokens/s ceiling of decode: each step reads the weights once plus the KV of ``batch``
    sequences at ``avg_context`` tokens, and yields ``batch`` tokens.

        bytes_per_step = W + batch * avg_context * kv_per_token
        tokens_per_s   = batch * bandwidth / bytes_per_step
    """
    if batch < 1 or bandwidth <= 0 or weight_bytes < 0 or avg_context < 0:
        raise ValueError("decode_roofline needs batch >= 1, bandwidth > 0, sizes >= 0")
    kv = batch * avg_context * kv_bytes_per_token
    step_bytes = weight_bytes + kv
    step_s = step_bytes / bandwidth
    return dict(bandwidth_gbps=bandwidth / 1e9, batch=batch, avg_context=avg_context,
                weight_bytes=int(weight_bytes), kv_bytes_per_step=int(kv),
                bytes_per_step=int(step_bytes), step_ms=step_s * 1e3,
                output_tokens_per_s=batch / step_s)


def roofline_for_run(config: dict, dtype: str, batch: int, input_len: float, output_len: float,
                     bandwidth: float) -> dict:
    """The roofline of a throughput run: ``batch`` sequences decoding at the average context of
    a decode step (prompt plus half of the output)."""
    nb = dtype_bytes(dtype)
    return decode_roofline(weight_bytes(config, nb), kv_bytes_per_token(config, nb), batch,
                           input_len + output_len / 2.0, bandwidth)


def measure_copy_bandwidth() -> dict:
    """Device copy bandwidth (bytes read + written per second), measured in this run."""
    return common.measure_copy_bandwidth()


def bandwidth_value(bw: dict) -> float:
    for key in ("bandwidth_bytes_per_s", "bytes_per_s", "bandwidth"):
        if key in bw:
            return float(bw[key])
    if "gbps" in bw:
        return float(bw["gbps"]) * 1e9
    if "bandwidth_gbps" in bw:
        return float(bw["bandwidth_gbps"]) * 1e9
    raise KeyError(f"no bandwidth in {sorted(bw)}")


# ---------------------------------------------------------------------------------------------
# requests
# ---------------------------------------------------------------------------------------------
@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def random_requests(num_prompts: int, input_len: int, output_len: int, vocab_size: int,
                    range_ratio: float = 0.0, seed: int = 0,
                    low_id: int = 0) -> list[BenchRequest]:
    """vLLM's random dataset: lengths uniform in [len*(1-r), len*(1+r)], ids uniform."""
    if num_prompts < 1 or input_len < 1 or output_len < 1:
        raise ValueError("num_prompts, input_len and output_len must be >= 1")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"random_range_ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)

    def length(n):
        lo, hi = max(1, int(n * (1 - range_ratio))), max(1, int(n * (1 + range_ratio)))
        return rng.randint(lo, hi)

    out = []
    for _ in range(num_prompts):
        ids = [rng.randrange(low_id, vocab_size) for _ in range(length(input_len))]
        out.append(BenchRequest(ids, length(output_len)))
    return out


def sharegpt_requests(path: str, num_prompts: int, tokenizer, vocab_size: int,
                      output_len: int | None = None, seed: int = 0,
                      max_len: int = 2048) -> list[BenchRequest]:
    """ShareGPT JSON: first human turn is the prompt, the reply's length is the output length
    (vLLM's sampling: shuffled, prompts < 4 tokens and pairs > max_len tokens dropped)."""
    with open(path) as f:
        data = json.load(f)
    convs = [d["conversations"] for d in data if len(d.get("conversations", [])) >= 2]
    random.Random(seed).shuffle(convs)
    out = []
    for conv in convs:
        prompt, reply = conv[0]["value"], conv[1]["value"]
        ids = [t % vocab_size for t in tokenizer.encode(prompt)]
        n_out = output_len or len(tokenizer.encode(reply))
        if len(ids) < 4 or n_out < 1 or len(ids) + n_out > max_len:
            continue
        out.append(BenchRequest(ids, n_out))
        if len(out) == num_prompts:
            break
    if not out:
        raise SystemExit(f"no usable conversations in {path}")
    return out


def make_requests(args, model_dir: str, vocab_size: int) -> list[BenchRequest]:
    if getattr(args, "dataset_path", None):
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(model_dir)
        return sharegpt_requests(args.dataset_path, args.num_prompts, tok, vocab_size,
                                 output_len=args.output_len_override, seed=args.seed,
                                 max_len=args.max_model_len or 2048)
    return random_requests(args.num_prompts, args.input_len, args.output_len, vocab_size,
                           args.random_range_ratio, args.seed)


def add_request_args(p: argparse.ArgumentParser, input_len=512, output_len=128,
                     num_prompts=1000) -> None:
    g = p.add_argument_group("requests (vLLM's random / sharegpt datasets)")
    g.add_argument("--num-prompts", type=int, default=num_prompts)
    g.add_argument("--input-len", "--random-input-len", dest="input_len", type=int,
                   default=input_len, help="prompt tokens (random dataset)")
    g.add_argument("--output-len", "--random-output-len", dest="output_len", type=int,
                   default=output_len, help="generated tokens per request (exact: ignore_eos)")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)]; 0 = fixed lengths")
    g.add_argument("--dataset-path", default=None,
                   help="ShareGPT-format JSON; prompts and reply lengths come from it")
    g.add_argument("--sharegpt-output-len", dest="output_len_override", type=int, default=None,
                   help="with --dataset-path: fixed output length instead of the reply's")
    g.add_argument("--seed", type=int, default=0)


def add_model_args(p: argparse.ArgumentParser) -> None:
    from jaxserve.testing.presets import PRESETS
    g = p.add_argument_group("model / engine (LLM(...) kwargs)")
    g.add_argument("--model", default=None, help="HF model directory (config.json + weights)")
    g.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="a real model shape, no checkpoint: implies --load-format dummy")
    g.add_argument("--load-format", default=None,
                   help="auto | safetensors | gguf | orbax | dummy (random weights on device)")
    g.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, float32 on CPU) | "
                                                    "bfloat16 | float16 | float32")
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--max-model-len", type=int, default=None,
                   help="default: the longest prompt + output of this run, block aligned")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--num-gpu-blocks-override", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--attention-backend", default="auto")
    g.add_argument("--min-token-bucket", type=int, default=None,
                   help="smallest token bucket of the step ladder (fewer buckets, fewer "
                        "compiles); default: the engine's")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True)


def llm_kwargs(args, requests: list[BenchRequest]) -> dict:
    need = max(r.prompt_len + r.output_len for r in requests)
    block = args.block_size
    max_len = args.max_model_len or -(-need // block) * block
    kw = dict(dtype=args.dtype, max_model_len=max_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              gpu_memory_utilization=args.gpu_memory_utilization,
              num_gpu_blocks_override=args.num_gpu_blocks_override, block_size=block,
              attention_backend=args.attention_backend,
              enable_prefix_caching=args.enable_prefix_caching, seed=args.seed,
              min_token_bucket=args.min_token_bucket,
              load_format=args.load_format or ("dummy" if args.preset else "auto"),
              async_scheduling=getattr(args, "async_scheduling", None))
    return {k: v for k, v in kw.items() if v is not None}


def resolved_dtype_name(dtype: str) -> str:
    """``auto`` as the engine resolves it: bf16 on GPU, float32 on CPU."""
    if dtype not in (None, "auto"):
        return dtype
    import jax
    return "bfloat16" if jax.default_backend() == "gpu" else "float32"


# ---------------------------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------------------------
def percentile(values, q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def summarize(values, name: str, percentiles=(50, 90, 99), scale: float = 1.0) -> dict:
    """``mean_<name>, median_<name>, std_<name>, p<q>_<name>`` as vLLM's benchmarks name them."""
    xs = [v * scale for v in values]
    if not xs:
        return {}
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))
    out = {f"mean_{name}": mean, f"median_{name}": percentile(xs, 50), f"std_{name}": std}
    for q in percentiles:
        out[f"p{q:g}_{name}"] = percentile(xs, q)
    return out


# ---------------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------------
def run_metadata() -> dict:
    return common.run_metadata()


def result_path(kind: str, args, tag: str = "") -> str:
    if getattr(args, "output_json", None):
        return args.output_json
    d = getattr(args, "result_dir", None) or RESULTS_DIR
    os.makedirs(d, exist_ok=True)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    name = (getattr(args, "preset", None) or os.path.basename(
        os.path.normpath(getattr(args, "model", None) or "model")))
    return os.path.join(d, f"{kind}-{name}{tag}-{stamp}.json")


def write_result(path: str, result: dict) -> str:
    return common.write_json(path, result)


def add_output_args(p: argparse.ArgumentParser) -> None:
    common.add_output_args(p)


def plt():
    return common.pyplot()


# ---------------------------------------------------------------------------------------------
# HF baselines: run in a subprocess
# ---------------------------------------------------------------------------------------------
def add_baseline_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("baselines (same model shape, same prompts)")
    g.add_argument("--hf-baseline", action="store_true",
                   help="HF transformers generate(), static batches, best batch size reported")
    g.add_argument("--hf-batch-sizes", default="8,32,64,128,256",
                   help="batch sizes swept by --hf-baseline")
    g.add_argument("--hf-num-batches", type=int, default=1,
                   help="timed batches per batch size (static batching: throughput per batch "
                        "does not depend on how many follow)")
    g.add_argument("--hf-cb-baseline", action="store_true",
                   help="HF continuous batching with paged KV (generate_batch), best attention "
                        "implementation reported")
    g.add_argument("--hf-cb-attn-impls", default="sdpa,paged|eager,flash_attention_2,"
                                                 "sdpa_paged,eager_paged,paged_attention",
                   help="attention implementations tried by --hf-cb-baseline (unavailable ones "
                        "are recorded and skipped)")
    g.add_argument("--hf-cb-num-prompts", type=int, default=None,
                   help="prompts for --hf-cb-baseline (default: all)")
    g.add_argument("--hf-dtype", default="auto", help="auto: bf16 on CUDA, float32 on CPU")
    g.add_argument("--hf-timeout", type=float, default=1800,
                   help="seconds per HF baseline subprocess; results so far are kept")
    g.add_argument("--roofline", action="store_true",
                   help="decode roofline from a copy bandwidth measured in this run")


def run_hf_subprocess(kind: str, model_dir: str, requests: list[BenchRequest], extra: list[str],
                      timeout: float) -> dict:
    """Run one HF baseline in a fresh interpreter; returns its result dict (partial on timeout,
    with ``error`` set when it failed)."""
    with tempfile.TemporaryDirectory() as tmp:
        req_path, out_path = os.path.join(tmp, "requests.json"), os.path.join(tmp, "out.json")
        with open(req_path, "w") as f:
            json.dump([[r.prompt_token_ids, r.output_len] for r in requests], f)
        cmd = [sys.executable, os.path.abspath(__file__), kind, "--model", model_dir,
               "--requests", req_path, "--out", out_path, *extra]
        env = dict(os.environ)
        env.pop("XLA_FLAGS", None)
        t0 = time.perf_counter()
        err = None
        try:
            proc = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True)
            if proc.returncode != 0:
                err = f"exit {proc.returncode}: {proc.stderr[-2000:]}"
        except subprocess.TimeoutExpired:
            err = f"timed out after {timeout:.0f} s"
        res = {}
        if os.path.exists(out_path):
            with open(out_path) as f:
                res = json.load(f)
        if err:
            res["error"] = err
        res["wall_s"] = time.perf_counter() - t0
        return res


def _torch_setup(dtype: str):
    import torch
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype in (None, "auto"):
        tdt = torch.bfloat16 if dev == "cuda" else torch.float32
    else:
        tdt = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
               "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}[dtype]
    return torch, dev, tdt


def _hf_model(model_dir: str, dtype: str, attn: str | None = None):
    """The model shape of ``model_dir`` with random weights, built straight on the device."""
    torch, dev, tdt = _torch_setup(dtype)
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(model_dir)
    kw = {"attn_implementation": attn} if attn else {}
    torch.manual_seed(0)
    with torch.device(dev):
        try:
            model = AutoModelForCausalLM.from_config(cfg, dtype=tdt, **kw)
        except TypeError:  # transformers 4.x spelling
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=tdt, **kw)
    model.eval()
    model.generation_config.pad_token_id = 0
    return model, torch, dev, tdt


def _sync(torch, dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def _dump(path: str, res: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=2)
    os.replace(tmp, path)


def hf_generate_main(a) -> None:
    """Static batches through ``model.generate`` (greedy, exactly output_len new tokens)."""
    reqs = _load_requests(a.requests)
    model, torch, dev, tdt = _hf_model(a.model, a.dtype)
    res = {"baseline": "hf_generate", "device": _torch_device_name(torch, dev),
           "dtype": str(tdt).replace("torch.", ""), "num_batches": a.num_batches, "runs": []}
    _dump(a.out, res)

    def run_batch(batch):
        n_out = max(o for _, o in batch)
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (p, _) in enumerate(batch):  # left padding, as generate expects
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.no_grad():
            out = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                                 max_new_tokens=n_out, min_new_tokens=n_out, do_sample=False,
                                 pad_token_id=0, eos_token_id=None)
        return out.shape[1] - width

    run_batch(reqs[:2])  # warm-up: kernels, allocator
    _sync(torch, dev)
    for bs in a.batch_sizes:
        if bs > len(reqs):
            res["runs"].append({"batch_size": bs, "skipped": f"only {len(reqs)} prompts"})
            continue
        nb = max(1, min(a.num_batches, len(reqs) // bs))
        batches = [reqs[i * bs:(i + 1) * bs] for i in range(nb)]
        try:
            _sync(torch, dev)
            t0 = time.perf_counter()
            gen = [run_batch(b) for b in batches]
            _sync(torch, dev)
            dt = time.perf_counter() - t0
        except torch.cuda.OutOfMemoryError as e:  # larger batches will not fit either
            res["runs"].append({"batch_size": bs, "error": f"OOM: {str(e)[:200]}"})
            torch.cuda.empty_cache()
            _dump(a.out, res)
            break
        useful = sum(o for b in batches for _, o in b)
        prompt = sum(len(p) for b in batches for p, _ in b)
        assert all(g >= max(o for _, o in b) for g, b in zip(gen, batches)), "short generation"
        res["runs"].append({"batch_size": bs, "num_requests": bs * nb, "elapsed_s": dt,
                            "output_tokens": useful, "prompt_tokens": prompt,
                            "output_throughput": useful / dt,
                            "total_token_throughput": (useful + prompt) / dt,
                            "request_throughput": bs * nb / dt})
        _best(res)
        _dump(a.out, res)


def hf_cb_main(a) -> None:
    """HF continuous batching (paged KV) over all requests, per attention implementation."""
    reqs = _load_requests(a.requests)
    model, torch, dev, tdt = _hf_model(a.model, a.dtype)
    res = {"baseline": "hf_generate_batch", "device": _torch_device_name(torch, dev),
           "dtype": str(tdt).replace("torch.", ""), "num_requests": len(reqs), "runs": []}
    _dump(a.out, res)
    for impl in a.attn_impls:
        run = {"attn_implementation": impl}
        try:
            if hasattr(model, "set_attn_implementation"):
                model.set_attn_implementation(impl)
            else:
                model.config._attn_implementation = impl
            dt, produced = _cb_run(model, torch, dev, reqs)
            useful = sum(o for _, o in reqs)
            if produced < useful:
                raise RuntimeError(f"generated {produced} tokens, expected {useful}")
            prompt = sum(len(p) for p, _ in reqs)
            run.update(elapsed_s=dt, output_tokens=useful, prompt_tokens=prompt,
                       output_throughput=useful / dt,
                       total_token_throughput=(useful + prompt) / dt,
                       request_throughput=len(reqs) / dt)
        except Exception as e:  # an implementation this transformers/machine lacks
            run["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        res["runs"].append(run)
        _best(res)
        _dump(a.out, res)
        if dev == "cuda":
            torch.cuda.empty_cache()


def _cb_run(model, torch, dev, reqs) -> tuple[float, int]:
    """Time add-requests-to-last-result with a warmed-up manager; per-request output lengths.

    Written against transformers 5.x (``continuous_batching_context_manager``); keyword
    arguments an installed version lacks are dropped, and without the context manager the
    whole ``generate_batch`` call is timed.
    """
    import inspect

    from transformers import GenerationConfig
    max_out = max(o for _, o in reqs)
    gc = GenerationConfig(max_new_tokens=max_out, do_sample=False, eos_token_id=-1,
                          pad_token_id=0)
    cb_kw = {"auto_switch_to_flash": False}
    if dev == "cpu":  # sized from device memory otherwise; on CPU that takes minutes
        page = 256
        need = sum(-(-(len(p) + o) // page) for p, o in reqs)
        cb_kw.update(num_blocks=need + 1, max_batch_tokens=512)
    cbc = None
    try:
        try:
            from transformers import ContinuousBatchingConfig
        except ImportError:
            from transformers.generation.configuration_utils import ContinuousBatchingConfig
        known = inspect.signature(ContinuousBatchingConfig).parameters
        cbc = ContinuousBatchingConfig(**{k: v for k, v in cb_kw.items() if k in known})
    except (ImportError, TypeError, ValueError):
        pass
    hints = None
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints
        hints = WorkloadHints(max_prompt_length=max(len(p) for p, _ in reqs),
                              max_generated_length=max_out, num_requests=len(reqs))
    except (ImportError, TypeError):
        pass
    cm = getattr(model, "continuous_batching_context_manager", None)
    if cm is None:  # older API: time generate_batch as a whole
        kw = {"continuous_batching_config": cbc} if cbc is not None else {}
        kw = {k: v for k, v in kw.items() if k in inspect.signature(
            model.generate_batch).parameters}
        _sync(torch, dev)
        t0 = time.perf_counter()
        out = model.generate_batch([p for p, _ in reqs], generation_config=gc, **kw)
        _sync(torch, dev)
        return time.perf_counter() - t0, sum(len(r.generated_tokens) for r in out.values())
    kw = dict(generation_config=gc, continuous_batching_config=cbc, block=True, timeout=10,
              workload_hints=hints)
    params = inspect.signature(cm).parameters
    kw = {k: v for k, v in kw.items() if v is not None and k in params}
    with cm(**kw) as manager:
        _sync(torch, dev)
        t0 = time.perf_counter()
        for i, (p, o) in enumerate(reqs):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=o)
        produced, done = 0, 0
        while done < len(reqs):
            r = manager.get_result(timeout=1)
            if r is None:
                if not manager.is_running():
                    raise RuntimeError("HF continuous batching thread stopped")
                continue
            if r.is_finished():
                if r.error:
                    raise RuntimeError(r.error)
                done += 1
                produced += len(r.generated_tokens)
        dt = time.perf_counter() - t0
    return dt, produced


def _best(res: dict) -> None:
    ok = [r for r in res["runs"] if "output_throughput" in r]
    if ok:
        best = max(ok, key=lambda r: r["output_throughput"])
        res["best"] = best
        res["output_throughput"] = best["output_throughput"]
        res["total_token_throughput"] = best["total_token_throughput"]
        res["request_throughput"] = best["request_throughput"]


def _load_requests(path: str) -> list[tuple[list[int], int]]:
    with open(path) as f:
        return [(list(p), int(o)) for p, o in json.load(f)]


def _torch_device_name(torch, dev: str) -> str:
    if dev == "cuda":
        return f"cuda: {torch.cuda.get_device_name(0)}"
    return f"cpu: {platform.processor() or platform.machine()}"


def summary_table(result_dir: str) -> str:
    """A plain-text table of every result JSON in ``result_dir``, with issue #14's targets."""
    rows = []

    def row(name, value, target=None, ok=None):
        mark = "" if ok is None else ("  ok" if ok else "  MISSED")
        rows.append(f"  {name:<44} {value:>14}  {target or '':<10}{mark}")

    def num(v, fmt="{:,.1f}"):
        return "n/a" if v is None else fmt.format(v)

    for fn in sorted(os.listdir(result_dir)):
        if not fn.endswith(".json"):
            continue
        try:
            with open(os.path.join(result_dir, fn)) as f:
                d = json.load(f)
        except (OSError, ValueError):
            continue
        kind = d.get("benchmark")
        cfg = d.get("config", {})
        if kind == "throughput":
            r = d.get("jaxserve", {})
            big = cfg.get("preset") == "llama3-8b"
            rows.append(f"{fn}  [{d.get('device', '?')}]")
            row("output tok/s", num(r.get("output_throughput")),
                ">= 12000" if big else None,
                r.get("output_throughput", 0) >= 12000 if big else None)
            row("requests/s | total tok/s", f"{num(r.get('request_throughput'), '{:.2f}')} | "
                f"{num(r.get('total_token_throughput'), '{:,.0f}')}")
            for k, tgt, need in (("output_throughput_vs_hf", ">= 15", 15.0),
                                 ("output_throughput_vs_hf_cb", ">= 3", 3.0),
                                 ("output_throughput_of_roofline", ">= 0.40", 0.40),
                                 ("decode_step_throughput_of_roofline", None, None)):
                if k in r:
                    row(k, num(r[k], "{:.3f}"), tgt, None if need is None else r[k] >= need)
            for name, b in (d.get("baselines") or {}).items():
                best = b.get("best", {})
                row(f"  {name} best output tok/s", num(b.get("output_throughput")),
                    f"bs {best['batch_size']}" if "batch_size" in best else
                    best.get("attn_implementation"))
                if "error" in b:
                    row(f"  {name} error", b["error"][:60])
            roof = d.get("roofline") or {}
            if roof:
                row("roofline tok/s (copy GB/s)", f"{num(roof.get('output_tokens_per_s'))} "
                    f"({num(roof.get('bandwidth_gbps'), '{:.0f}')})")
            row("host / device ms per step", f"{num(r.get('host_ms_per_step'), '{:.2f}')} / "
                f"{num(r.get('device_ms_per_step'), '{:.2f}')}")
            if "host_overhead_fraction" in r:
                row("host_overhead_fraction", num(r["host_overhead_fraction"], "{:.3f}"),
                    "<= 0.10", r["host_overhead_fraction"] <= 0.10)
            if "decode_host_time_fraction" in r:  # results written before async scheduling
                row(f"decode host/device at batch {r.get('decode_batch')}",
                    num(r["decode_host_time_fraction"], "{:.3f}"), "<= 0.10",
                    r["decode_host_time_fraction"] <= 0.10)
            row("compiles after warm-up", str(r.get("compiles_after_warmup")), "0",
                r.get("compiles_after_warmup") == 0)
        elif kind == "serving":
            rows.append(f"{fn}  [{d.get('device', '?')}]")
            for m in d.get("runs", []):
                ttft, tpot = m.get("median_ttft_ms"), m.get("median_tpot_ms")
                row(f"rate {m.get('request_rate')}: req/s, ok/failed",
                    f"{num(m.get('request_throughput'), '{:.2f}')}, {m.get('completed')}/"
                    f"{m.get('failed')}")
                row("  TTFT p50 ms", num(ttft, "{:.2f}"), "< 30")
                row("  TPOT p50 ms", num(tpot, "{:.3f}"), "< 8")
                if "request_goodput" in m:
                    row("  goodput req/s", num(m["request_goodput"], "{:.2f}"))
        elif kind == "latency":
            rows.append(f"{fn}  [{d.get('device', '?')}]")
            row("median batch latency s", num(d.get("median_latency_s"), "{:.4f}"))
            for k in ("latency_vs_hf", "latency_vs_hf_cb", "latency_of_roofline"):
                if k in d:
                    row(k, num(d[k], "{:.3f}"))
        elif kind:
            rows.append(f"{fn}  ({kind})")
    return "\n".join(rows) if rows else f"no results in {result_dir}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="HF baselines (run by the benchmark scripts in a "
                                            "subprocess; usable by hand) and the results table")
    sub = p.add_subparsers(dest="kind", required=True)
    t = sub.add_parser("table", help="print a table of the result JSONs in a folder")
    t.add_argument("result_dir", nargs="?", default=RESULTS_DIR)
    for kind in ("hf-generate", "hf-cb"):
        s = sub.add_parser(kind)
        s.add_argument("--model", required=True)
        s.add_argument("--requests", required=True, help="JSON [[prompt ids, output len], ...]")
        s.add_argument("--out", required=True)
        s.add_argument("--dtype", default="auto")
        s.add_argument("--batch-sizes", type=_int_list, default=[8, 32, 64, 128, 256])
        s.add_argument("--num-batches", type=int, default=1)
        s.add_argument("--attn-impls", type=lambda s: [x for x in s.split(",") if x],
                       default=["sdpa", "paged|eager"])
    a = p.parse_args(argv)
    if a.kind == "table":
        print(summary_table(a.result_dir))
        return
    (hf_generate_main if a.kind == "hf-generate" else hf_cb_main)(a)


def _int_list(s: str) -> list[int]:
    try:
        vals = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}")
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return vals


def run_baselines(args, model_dir: str, requests: list[BenchRequest], log=print) -> dict:
    """The HF baselines the flags ask for, each in its own subprocess, before the engine runs."""
    out = {}

    def report(name, res):
        err = f" ({res['error'][:200]})" if "error" in res else ""
        log(f"  {name}: {res.get('output_throughput', float('nan')):.1f} output tok/s{err}")

    if args.hf_baseline:
        log("HF generate baseline ...")
        out["hf"] = run_hf_subprocess(
            "hf-generate", model_dir, requests,
            ["--dtype", args.hf_dtype, "--batch-sizes", args.hf_batch_sizes,
             "--num-batches", str(args.hf_num_batches)], args.hf_timeout)
        report("HF generate", out["hf"])
    if args.hf_cb_baseline:
        log("HF continuous batching baseline ...")
        cb_reqs = requests[:args.hf_cb_num_prompts] if args.hf_cb_num_prompts else requests
        out["hf_cb"] = run_hf_subprocess(
            "hf-cb", model_dir, cb_reqs,
            ["--dtype", args.hf_dtype, "--attn-impls", args.hf_cb_attn_impls], args.hf_timeout)
        report("HF generate_batch", out["hf_cb"])
    return out


def ratios(result: dict, baselines: dict, keys=("output_throughput", "total_token_throughput",
                                                  "request_throughput")) -> dict:
    """``<key>_vs_hf`` and ``<key>_vs_hf_cb``: jaxserve / baseline (higher is better)."""
    out = {}
    for name, suffix in (("hf", "vs_hf"), ("hf_cb", "vs_hf_cb")):
        b = baselines.get(name) or {}
        for k in keys:
            if b.get(k) and result.get(k) is not None:
                out[f"{k}_{suffix}"] = result[k] / b[k]
    return out


if __name__ == "__main__":
    main()
