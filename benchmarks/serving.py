"""Online serving benchmark, like vLLM's ``benchmarks/benchmark_serving.py``.

Streams ``/v1/completions`` requests to a running OpenAI-compatible server over HTTP (httpx),
arriving at ``--request-rate`` per second (Poisson with ``--burstiness 1``, gamma otherwise,
all at once with ``inf`` = burst), or at each rate of a ``--request-rates`` sweep. Per rate:
TTFT, TPOT, ITL and end-to-end latency (mean / median / std / percentiles, ms), throughputs,
and goodput under ``--goodput ttft:MS tpot:MS e2el:MS``. ``--launch`` starts
``jaxserve serve`` on a free port for the run and stops it afterwards.

    python benchmarks/serving.py --launch --preset tinyllama-1.1b --num-prompts 200 \\
        --request-rates 4,16,64,inf --goodput ttft:30 tpot:8
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import baselines as B  # noqa: E402

METRICS = ("ttft", "tpot", "itl", "e2el")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s = p.add_argument_group("server")
    s.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000 (default: "
                                                    "from --host/--port)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--endpoint", default="/v1/completions")
    s.add_argument("--served-model-name", default=None,
                   help="model name sent in requests (default: the server's first model)")
    s.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    s.add_argument("--launch", action="store_true",
                   help="start `jaxserve serve` on a free port with the model flags below, "
                        "stop it at the end")
    s.add_argument("--server-args", default="",
                   help="extra flags for the launched server, one string")
    s.add_argument("--launch-timeout", type=float, default=900,
                   help="seconds to wait for the launched server's /health")
    B.add_model_args(p)
    B.add_request_args(p, input_len=512, output_len=128, num_prompts=200)
    r = p.add_argument_group("load")
    r.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second; inf sends all at once (burst)")
    r.add_argument("--request-rates", default=None,
                   help="comma-separated sweep, e.g. 2,8,32,inf (overrides --request-rate)")
    r.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of inter-arrival times: 1 = Poisson, < 1 burstier")
    r.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight")
    r.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly --output-len tokens")
    r.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:30 tpot:8 (keys ttft, tpot, e2el)")
    r.add_argument("--metric-percentiles", default="50,90,99")
    r.add_argument("--vocab-size", type=int, default=None,
                   help="random prompt ids are drawn below this (default: the model's "
                        "config.json when the model is a local directory or preset)")
    r.add_argument("--request-timeout", type=float, default=600)
    B.add_output_args(p)
    args = p.parse_args(argv)
    try:
        args.rates = ([_rate(x) for x in args.request_rates.split(",") if x.strip()]
                      if args.request_rates else [args.request_rate])
        args.goodput_slos = parse_goodput(args.goodput)
        args.percentiles = [float(x) for x in args.metric_percentiles.split(",")]
    except ValueError as e:
        p.error(str(e))
    if any(not isinstance(r, str) and r <= 0 for r in args.rates):
        p.error("request rates must be > 0")
    if isinstance(args.rates[0], str):
        p.error("a relative rate (0.8x) needs an absolute or inf rate before it")
    if args.burstiness <= 0:
        p.error("--burstiness must be > 0")
    return args


def _rate(s: str):
    """A rate in requests/s, ``inf``, or ``0.8x``: that fraction of the highest request
    throughput achieved earlier in the sweep (e.g. ``inf,0.8x`` = 80 % of the peak)."""
    s = s.strip()
    if s.lower() == "inf":
        return float("inf")
    if s.endswith("x"):
        f = float(s[:-1])
        if f <= 0:
            raise ValueError(f"relative rate {s!r} must be > 0")
        return s
    return float(s)


def parse_goodput(items) -> dict[str, float]:
    """``["ttft:30", "tpot:8"]`` -> ``{"ttft": 30.0, "tpot": 8.0}`` (milliseconds)."""
    slos = {}
    for item in items or []:
        key, sep, val = item.partition(":")
        if not sep or key not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput entries look like ttft:30, tpot:8 or e2el:1000; got "
                             f"{item!r}")
        ms = float(val)
        if ms <= 0:
            raise ValueError(f"--goodput {key} must be > 0 ms, got {val}")
        slos[key] = ms
    return slos


# ---------------------------------------------------------------------------------------------
# the client
# ---------------------------------------------------------------------------------------------
@dataclass
class RequestResult:
    prompt_len: int
    output_len_requested: int
    success: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    start: float = 0.0

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


async def send_request(client, url: str, model: str, req: B.BenchRequest, ignore_eos: bool,
                       headers: dict, timeout: float) -> RequestResult:
    """One streamed completion; every SSE chunk with a choice counts as a token arrival, the
    usage chunk gives the token count."""
    res = RequestResult(req.prompt_len, req.output_len)
    body = {"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.output_len,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": ignore_eos}
    if ignore_eos:
        body["min_tokens"] = req.output_len
    t0 = res.start = time.perf_counter()
    last = t0
    chunks = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers,
                                 timeout=timeout) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {text[:300]}"
                return res
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    res.error = str(msg["error"])[:300]
                    return res
                now = time.perf_counter()
                if msg.get("choices"):
                    if chunks == 0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    chunks += 1
                    last = now
                usage = msg.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    res.output_tokens = int(usage["completion_tokens"])
        res.latency = time.perf_counter() - t0
        if not res.output_tokens:
            res.output_tokens = chunks
        res.success = chunks > 0
        if not res.success:
            res.error = "no tokens streamed"
    except Exception as e:  # connection errors, timeouts: a failed request, not a crash
        res.error = f"{type(e).__name__}: {e}"[:300]
    return res


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds before each request: gamma(shape=burstiness, mean=1/rate); 0 for rate inf."""
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    return [rng.gammavariate(burstiness, theta) for _ in range(n)]


async def run_rate(base_url: str, endpoint: str, model: str, requests: list[B.BenchRequest],
                   rate: float, args, pbar=None) -> tuple[list[RequestResult], float]:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    gaps = arrival_gaps(len(requests), rate, args.burstiness, args.seed)
    url = base_url.rstrip("/") + endpoint

    async with httpx.AsyncClient(limits=limits, timeout=args.request_timeout) as client:
        async def one(req):
            if sem is None:
                r = await send_request(client, url, model, req, args.ignore_eos, headers,
                                       args.request_timeout)
            else:
                async with sem:
                    r = await send_request(client, url, model, req, args.ignore_eos, headers,
                                           args.request_timeout)
            if pbar is not None:
                pbar.update(1)
            return r

        t0 = time.perf_counter()
        tasks = []
        for req, gap in zip(requests, gaps):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return list(results), duration


def compute_metrics(results: list[RequestResult], duration: float, slos: dict,
                    percentiles) -> dict:
    ok = [r for r in results if r.success]
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_len for r in ok)
    m = dict(completed=len(ok), failed=len(results) - len(ok), duration=duration,
             total_input_tokens=in_tok, total_output_tokens=out_tok,
             request_throughput=len(ok) / duration, output_throughput=out_tok / duration,
             total_token_throughput=(in_tok + out_tok) / duration,
             num_wrong_length=sum(1 for r in ok if r.output_tokens != r.output_len_requested))
    values = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.tpot is not None],
              "itl": [x for r in ok for x in r.itl], "e2el": [r.latency for r in ok]}
    for name in METRICS:
        m.update(B.summarize(values[name], f"{name}_ms", percentiles, scale=1e3))
    if slos:
        good = 0
        for r in ok:
            ms = {"ttft": r.ttft * 1e3, "tpot": (r.tpot or 0.0) * 1e3, "e2el": r.latency * 1e3}
            if all(ms[k] <= v for k, v in slos.items()):
                good += 1
        m["request_goodput"] = good / duration
        m["goodput_fraction"] = good / max(len(results), 1)
    errors = sorted({r.error for r in results if r.error})
    if errors:
        m["errors"] = errors[:5]
    return m


# ---------------------------------------------------------------------------------------------
# the launched server
# ---------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchedServer:
    """``jaxserve serve`` in a subprocess on a free port; its log goes to a file."""

    def __init__(self, model_dir: str, args, max_model_len: int):
        self.port = free_port()
        self.log_path = os.path.join(tempfile.mkdtemp(prefix="jaxserve-serve-"), "server.log")
        cmd = [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", model_dir,
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", args.dtype,
               "--max-model-len", str(max_model_len),
               "--load-format", args.load_format or ("dummy" if args.preset else "auto"),
               "--gpu-memory-utilization", str(args.gpu_memory_utilization),
               "--block-size", str(args.block_size), "--uvicorn-log-level", "warning"]
        for flag, val in (("--max-num-seqs", args.max_num_seqs),
                          ("--max-num-batched-tokens", args.max_num_batched_tokens),
                          ("--num-gpu-blocks-override", args.num_gpu_blocks_override),
                          ("--attention-backend",
                           None if args.attention_backend == "auto" else args.attention_backend)):
            if val is not None:
                cmd += [flag, str(val)]
        if not args.enable_prefix_caching:
            cmd.append("--no-enable-prefix-caching")
        cmd += args.server_args.split()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([B.ROOT] + [x for x in env.get(
            "PYTHONPATH", "").split(os.pathsep) if x])
        self.cmd = cmd
        self._log = open(self.log_path, "w")
        # same process group: a `timeout` or Ctrl-C that ends the benchmark ends the server too
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.base_url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float) -> float:
        import httpx
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jaxserve serve exited with {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"jaxserve serve not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


# ---------------------------------------------------------------------------------------------
def _server_model(base_url: str, api_key: str | None) -> str:
    import httpx
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def main(argv=None) -> dict:
    args = parse_args(argv)
    from tqdm.auto import tqdm

    model_dir = None
    if args.preset or (args.model and os.path.isdir(args.model)):
        model_dir = B.resolve_model(args.model, args.preset)
    elif args.launch:
        model_dir = B.resolve_model(args.model, args.preset)
    vocab = args.vocab_size
    if vocab is None:
        vocab = B.load_hf_config(model_dir)["vocab_size"] if model_dir else 1000
    requests = B.make_requests(args, model_dir, vocab) if args.dataset_path else \
        B.random_requests(args.num_prompts, args.input_len, args.output_len, vocab,
                          args.random_range_ratio, args.seed)
    need = max(r.prompt_len + r.output_len for r in requests)
    max_model_len = args.max_model_len or -(-need // args.block_size) * args.block_size

    server = None
    # SIGTERM (e.g. from `timeout`) unwinds through `finally`, which stops a launched server
    old_term = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        if args.launch:
            server = LaunchedServer(model_dir, args, max_model_len)
            print(f"launching: {' '.join(server.cmd)}")
            ready = server.wait_ready(args.launch_timeout)
            print(f"server ready in {ready:.1f} s (log: {server.log_path})")
            base_url = server.base_url
        else:
            base_url = args.base_url or f"http://{args.host}:{args.port}"
        model = args.served_model_name or _server_model(base_url, args.api_key)
        # one request first: checks the server works, and keeps warm-up out of the numbers
        test, _ = asyncio.run(run_rate(base_url, args.endpoint, model,
                                       [B.BenchRequest(requests[0].prompt_token_ids,
                                                       min(4, requests[0].output_len))],
                                       float("inf"), args))
        if not test[0].success:
            raise RuntimeError(f"test request failed: {test[0].error}")
        runs = []
        for rate in args.rates:
            if isinstance(rate, str):  # fraction of the peak so far
                rate = float(rate[:-1]) * max(r["request_throughput"] for r in runs)
            bar = tqdm(total=len(requests), desc=f"rate {rate:g} req/s",
                       disable=args.disable_tqdm)
            results, duration = asyncio.run(run_rate(base_url, args.endpoint, model, requests,
                                                     rate, args, bar))
            bar.close()
            m = compute_metrics(results, duration, args.goodput_slos, args.percentiles)
            m["request_rate"] = "inf" if rate == float("inf") else rate
            runs.append(m)
            _print_run(m)
    finally:
        signal.signal(signal.SIGTERM, old_term)
        if server is not None:
            code = server.stop()
            print(f"server stopped (exit {code})")

    config = dict(vars(args), model_dir=model_dir, base_url=base_url, served_model=model,
                  max_model_len_launched=max_model_len if args.launch else None)
    config["rates"] = [r if isinstance(r, str) else "inf" if r == float("inf") else r
                       for r in args.rates]
    config["request_rate"] = "inf" if args.request_rate == float("inf") else args.request_rate
    out = dict(benchmark="serving", **B.run_metadata(), config=config, runs=runs)
    if args.launch:
        out["server_log_tail"] = server.log_tail(2000) if server else ""
    if len(runs) == 1:
        out.update({k: v for k, v in runs[0].items() if not isinstance(v, list)})
    path = B.result_path("serving", args)
    if not args.no_plot:
        out["plot"] = plot(path[:-5] + ".png", runs, args)
    B.write_result(path, out)
    if server is not None:  # its log's tail is in the JSON
        shutil.rmtree(os.path.dirname(server.log_path), ignore_errors=True)
    print(f"wrote {path}")
    return out


def _print_run(m: dict) -> None:
    print(f"rate {m['request_rate']}: {m['completed']} ok / {m['failed']} failed in "
          f"{m['duration']:.2f} s; {m['request_throughput']:.2f} req/s, "
          f"{m['output_throughput']:.1f} output tok/s; TTFT p50 {m.get('median_ttft_ms', 0):.1f}"
          f" ms, TPOT p50 {m.get('median_tpot_ms', 0):.2f} ms, ITL p50 "
          f"{m.get('median_itl_ms', 0):.2f} ms, e2e p50 {m.get('median_e2el_ms', 0):.1f} ms"
          + (f", goodput {m['request_goodput']:.2f} req/s" if "request_goodput" in m else ""))
    if m.get("errors"):
        print(f"  errors: {m['errors']}")


def plot(path: str, runs: list[dict], args) -> str:
    plt = B.plt()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    x = [r["request_throughput"] for r in runs]
    labels = [str(r["request_rate"]) for r in runs]
    hi = max(args.percentiles)
    for ax, name, title in ((axes[0], "ttft", "time to first token"),
                            (axes[1], "tpot", "time per output token"),
                            (axes[2], "e2el", "end-to-end latency")):
        for stat, style in (("median", "o-"), (f"p{hi:g}", "s--")):
            ys = [r.get(f"{stat}_{name}_ms", float("nan")) for r in runs]
            ax.plot(x, ys, style, label=stat)
        for xi, yi, lab in zip(x, [r.get(f"median_{name}_ms", 0) for r in runs], labels):
            ax.annotate(f"rate {lab}", (xi, yi), fontsize=7, textcoords="offset points",
                        xytext=(3, 3))
        slo = args.goodput_slos.get(name)
        if slo:
            ax.axhline(slo, color="red", ls=":", label=f"SLO {slo:g} ms")
        ax.set_xlabel("achieved requests / s")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"serving: {len(runs)} rate(s), in {args.input_len}, out {args.output_len}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
