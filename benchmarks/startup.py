"""Start-up time of ``jaxserve serve``: cold (empty compile cache) and cached restart.

Each run starts ``jaxserve serve`` (default model unless ``--model``) in a fresh process with
``JAX_COMPILATION_CACHE_DIR`` pointing at a directory that is empty for the first run and kept
for the next, polls ``/health`` until it answers 200, asks the chat question "What is the
capital of France?" (greedy) and waits for the background compiles to finish. The breakdown
comes from the server's own log lines (load, compiles, warm-up) and the wall clock of this
script (healthy, first answer); the machine's load average is recorded beside it.

Memory: the resident set (RSS) of every process of the server (the API process and the
engine core), once all buckets are compiled and again after ``--requests`` more chat requests
(``--concurrency`` at a time, 32 tokens each); each process's peak (VmHWM) beside it. The
engine's own account of its memory by part is read from its start-up log.

    python benchmarks/startup.py                       # cold, then cached
    python benchmarks/startup.py --runs cold --tag before
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common as C  # noqa: E402

QUESTION = "What is the capital of France?"
DEFAULT_DIR = os.path.join(C.RESULTS_DIR, "cpu-startup-2026-11-23")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# log lines of the engine (old and new wording both read)
_LOADED = re.compile(r"loaded .* in ([\d.]+) s")
_WARMUP = re.compile(r"warm-up: (\d+) compiles .* in ([\d.]+) s")
_COMPILE_S = re.compile(r"compiled .* in ([\d.]+) s")
_READY = re.compile(r"engine (?:ready|loaded) in ([\d.]+) s")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="model to serve (default: jaxserve's default)")
    p.add_argument("--runs", default="cold,cached",
                   help="comma list of cold / cached / load (the model load alone)")
    p.add_argument("--tag", default="", help="suffix of the result files (e.g. before, after)")
    p.add_argument("--cache-dir", default=None, help="compile cache dir (default: a temp dir, "
                   "emptied before a cold run)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("--extra-args", default="", help="more `jaxserve serve` flags")
    p.add_argument("--python", default=sys.executable, help="the interpreter that runs "
                   "`jaxserve serve` (e.g. a fresh venv made by the README's serve command)")
    p.add_argument("--requests", type=int, default=100,
                   help="chat requests sent after warm-up before the second RSS reading (0: none)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at a time")
    p.add_argument("--repo", default=REPO, help="the jaxserve checkout to start (e.g. an "
                   "export of an older commit, for a before/after in one session)")
    C.add_output_args(p)
    args = p.parse_args(argv)
    args.result_dir = args.result_dir or DEFAULT_DIR
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _proc_status(pid: int) -> dict:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out[key] = int(val.split()[0]) * 1024
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            out["cmd"] = f.read().replace(b"\0", b" ").decode(errors="replace")[:160]
    except OSError:
        pass
    return out


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (from /proc/*/stat's parent ids)."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += [c for c, pp in parent.items() if pp == p]
    return out


def memory(pid: int) -> dict:
    """RSS and peak RSS (bytes) of ``pid``'s process tree, per process and summed (a process
    under 20 MB, e.g. multiprocessing's resource tracker, counts in the sum too)."""
    procs = [dict(pid=p, **_proc_status(p)) for p in _descendants(pid)]
    procs = [p for p in procs if "VmRSS" in p]
    return dict(rss_bytes=sum(p["VmRSS"] for p in procs),
                peak_rss_bytes=sum(p.get("VmHWM", 0) for p in procs), processes=procs)


def _chat_requests(url: str, n: int, concurrency: int) -> float:
    """``n`` greedy chat requests of 32 tokens, ``concurrency`` at a time -> seconds taken."""
    import concurrent.futures

    import httpx

    name = _model_name(url)
    prompts = [f"Write one sentence about the number {i}." for i in range(n)]

    def one(p):
        r = httpx.post(url + "/v1/chat/completions", timeout=300, json=dict(
            model=name, messages=[{"role": "user", "content": p}], temperature=0.0,
            max_tokens=32))
        r.raise_for_status()

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, prompts))
    return time.perf_counter() - t0


_MEMORY_LOG = re.compile(r"memory after warm-up: (.*)")


def _last(rx, text: str):
    found = rx.findall(text)
    return found[-1] if found else None


_LOAD_ONLY = """
import json, os, sys, time
t0 = time.perf_counter()
import jax
from jaxserve.loaders.gguf import default_model_path
from jaxserve.loaders.model_loader import load_model, load_tokenizer
t1 = time.perf_counter()
path = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] else default_model_path()
m = load_model(path)[0]
jax.block_until_ready([x for x in jax.tree_util.tree_leaves(m) if hasattr(x, "nbytes")])
t2 = time.perf_counter()
load_tokenizer(path)
t3 = time.perf_counter()
print("RESULT" + json.dumps(dict(import_s=t1 - t0, weights_s=t2 - t1, tokenizer_s=t3 - t2,
                                 load_s=t3 - t1)))
"""


def load_only(args) -> dict:
    """The model load alone (weights placed + tokenizer) in a fresh process of ``--repo``."""
    import json

    before = _loadavg()
    out = subprocess.run([args.python, "-c", _LOAD_ONLY, args.model or ""], cwd=args.repo,
                         capture_output=True, text=True, timeout=args.timeout,
                         env=dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS",
                                                                           "cpu")))
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT")]
    if not line:
        raise RuntimeError(out.stderr[-3000:])
    res = dict(kind="load", repo=args.repo, repo_commit=_commit(args.repo),
               load_avg_start=before, load_avg_end=_loadavg(), **json.loads(line[0][6:]))
    print(f"load    weights {res['weights_s']:.1f} s, tokenizer {res['tokenizer_s']:.1f} s "
          f"(import {res['import_s']:.1f} s), loadavg {before}", flush=True)
    return res


def one_run(kind: str, cache_dir: str, args) -> dict:
    import httpx

    if kind == "load":
        return load_only(args)

    if kind == "cold":
        for root, dirs, files in os.walk(cache_dir, topdown=False):
            for f in files:
                os.remove(os.path.join(root, f))
            for d in dirs:
                os.rmdir(os.path.join(root, d))
    port = _free_port()
    cmd = [args.python, "-m", "jaxserve.entrypoints.cli", "serve", "--port", str(port)]
    if args.model:
        cmd += ["--model", args.model]
    cmd += args.extra_args.split()
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_PLATFORMS=os.environ.get(
        "JAX_PLATFORMS", "cpu"), PYTHONUNBUFFERED="1")
    log_path = os.path.join(tempfile.gettempdir(), f"startup-{kind}-{port}.log")
    load_before = _loadavg()
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=args.repo)
    res: dict = dict(kind=kind, command=" ".join(cmd), repo=args.repo,
                     repo_commit=_commit(args.repo), load_avg_start=load_before)
    first_listen = None
    progress = []  # (t, buckets_ready, of) seen in 503 bodies
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited ({proc.returncode}):\n"
                                   + open(log_path).read()[-3000:])
            if time.perf_counter() - t0 > args.timeout:
                res["error"] = f"not healthy in {args.timeout} s"
                break
            try:
                r = httpx.get(url + "/health", timeout=2)
                now = time.perf_counter() - t0
                if first_listen is None:
                    first_listen = now
                if r.status_code == 200:
                    res["healthy_s"] = now
                    break
                try:
                    body = r.json()
                    progress.append((round(now, 2), body.get("buckets_ready"), body.get("of")))
                except ValueError:
                    pass
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        res["listening_s"] = first_listen
        if "error" in res:
            raise TimeoutError(res["error"])
        t1 = time.perf_counter()
        r = httpx.post(url + "/v1/chat/completions", timeout=args.timeout, json=dict(
            model=_model_name(url), messages=[{"role": "user", "content": QUESTION}],
            temperature=0.0, max_tokens=32))
        r.raise_for_status()
        answer = r.json()["choices"][0]["message"]["content"]
        res.update(first_answer_s=time.perf_counter() - t0, answer_latency_s=time.perf_counter()
                   - t1, answer=answer, says_paris="Paris" in answer)
        # wait for the background compiles (the warm-up summary line)
        deadline = time.perf_counter() + args.timeout
        while _last(_WARMUP, open(log_path).read()) is None and time.perf_counter() < deadline:
            time.sleep(0.5)
        res["all_compiled_s"] = time.perf_counter() - t0
        time.sleep(1.0)
        res["memory_warm"] = memory(proc.pid)
        if args.requests:
            res["requests"] = args.requests
            res["requests_s"] = _chat_requests(url, args.requests, args.concurrency)
            res["memory_after_requests"] = memory(proc.pid)
    except TimeoutError:
        pass
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log = open(log_path).read()
    res["load_avg_end"] = _loadavg()
    loaded = _last(_LOADED, log)
    warm = _last(_WARMUP, log)
    ready = _last(_READY, log)
    compiles = [float(x) for x in _COMPILE_S.findall(log)]
    res.update(load_s=float(loaded) if loaded else None,
               num_compiles=int(warm[0]) if warm else None,
               warmup_s=float(warm[1]) if warm else None,
               engine_ready_s=float(ready) if ready else None,
               compile_s_sum=sum(compiles) if compiles else None,
               engine_memory_log=_last(_MEMORY_LOG, log),
               health_progress=progress, log_tail=log[-4000:])
    if "error" in res:
        print(f"{kind:7s} {res['error']}; load {res['load_s']} s, loadavg {load_before} -> "
              f"{res['load_avg_end']}", flush=True)
        return res
    print(f"{kind:7s} healthy {res['healthy_s']:.1f} s, answer at {res['first_answer_s']:.1f} s "
          f"({'Paris' if res['says_paris'] else 'NO Paris'}), load {res['load_s']} s, "
          f"warm-up {res['warmup_s']} s, {res['num_compiles']} compiles, loadavg "
          f"{load_before} -> {res['load_avg_end']}", flush=True)
    for key in ("memory_warm", "memory_after_requests"):
        if key in res:
            m = res[key]
            parts = ", ".join(f"{p['VmRSS'] / 2**20:.0f} MB" for p in m["processes"])
            print(f"        RSS {key[7:]}: {m['rss_bytes'] / 2**20:.0f} MB ({parts}); peak "
                  f"{m['peak_rss_bytes'] / 2**20:.0f} MB", flush=True)
    return res


def _commit(repo: str) -> str:
    try:
        return subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or open(
                                  os.path.join(repo, "COMMIT")).read().strip()
    except OSError:
        return "unknown"


def _model_name(url: str) -> str:
    import httpx

    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]


def plot(path: str, runs: list[dict], title: str) -> str:
    plt = C.pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.2))
    runs = [r for r in runs if "error" not in r and r["kind"] != "load"]
    if not runs:
        return ""
    for i, r in enumerate(runs):
        load = r.get("load_s") or 0.0
        healthy = r["healthy_s"]
        ax.barh(i, load, color="tab:blue", label="load" if i == 0 else None)
        ax.barh(i, healthy - load, left=load, color="tab:orange",
                label="compile + warm-up until healthy" if i == 0 else None)
        ax.barh(i, r["first_answer_s"] - healthy, left=healthy, color="tab:green",
                label="first answer" if i == 0 else None)
        rest = r.get("all_compiled_s", r["first_answer_s"]) - r["first_answer_s"]
        if rest > 0.5:
            ax.barh(i, rest, left=r["first_answer_s"], color="tab:gray", alpha=0.5,
                    label="rest compiling in background" if i == 0 else None)
        ax.text(r["first_answer_s"], i, f" {r['first_answer_s']:.0f} s", va="center", fontsize=8)
    ax.set_yticks(range(len(runs)), [r["kind"] for r in runs])
    ax.set_xlabel("seconds since `jaxserve serve` started")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> dict:
    args = parse_args(argv)
    own = args.cache_dir is None
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="jaxserve-xla-cache-")
    runs = [one_run(kind, cache_dir, args) for kind in args.runs.split(",")]
    result = dict(benchmark="startup", **C.run_metadata(), nproc=os.cpu_count(),
                  config=dict(model=args.model or "default (SmolLM2-135M-Instruct GGUF)",
                              runs=args.runs, extra_args=args.extra_args, python=args.python,
                              repo=args.repo), runs=runs)
    tag = f"-{args.tag}" if args.tag else ""
    path = C.write_json(C.result_path("startup", args, tag), result)
    if not args.no_plot and any(r["kind"] != "load" for r in runs):
        plot(path[:-5] + ".png", runs, f"jaxserve serve start-up {args.tag} "
             f"({result.get('git_commit', '')[:8]}, {os.cpu_count()} cores)")
    print(f"-> {path}")
    if own:
        import shutil

        shutil.rmtree(cache_dir, ignore_errors=True)
    return result


if __name__ == "__main__":
    main()
