"""``jaxserve serve`` runs the engine core in a child process: the API process never loads jax,
a dead core turns into 503s and an unhealthy ``/health`` (not a hang), and a burst of
aborted streams leaves no KV page behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server_process import free_port, wait_healthy

FLAGS = ["--max-model-len", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "32",
         "--min-token-bucket", "32", "--num-gpu-blocks-override", "64",
         "--uvicorn-log-level", "warning"]


def _env(**extra):
    root = str(Path(__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", PYTHONPATH=path, **extra)
    env.pop("JAXSERVE_API_KEY", None)
    return env


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


def _loads_jaxlib(pid: int) -> bool:
    maps = Path(f"/proc/{pid}/maps").read_text()
    return "jaxlib" in maps or "xla_extension" in maps


@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory):
    model = tiny_model_factory("llama")
    port = free_port()
    log_path = tmp_path_factory.mktemp("core") / "log.txt"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", str(model), *FLAGS,
             "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, env=_env())
    try:
        wait_healthy(port, [proc], [log_path], timeout=300)
        yield proc, f"http://127.0.0.1:{port}", log_path
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _kv_usage(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    line = next(ln for ln in text.splitlines() if ln.startswith("jaxserve:kv_cache_usage_perc"))
    return float(line.rsplit(" ", 1)[1])


def test_the_api_process_never_loads_jax(server):
    proc, url, _ = server
    r = httpx.post(url + "/v1/completions", timeout=60,
                   json={"prompt": "hello", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    cores = [k for k in _children(proc.pid) if _loads_jaxlib(k)]
    assert len(cores) == 1, "the engine core is one child process with jax loaded"
    assert not _loads_jaxlib(proc.pid), "the HTTP process mapped jaxlib"


def test_aborted_streams_leave_no_kv_page(server):
    _, url, _ = server

    def cut(i):
        try:
            with httpx.stream("POST", url + "/v1/completions", timeout=60,
                              json={"prompt": f"burst {i} " * 8, "max_tokens": 200,
                                    "ignore_eos": True, "stream": True}) as r:
                for n, _ in enumerate(r.iter_lines()):
                    if n >= 3:
                        return  # closing the stream mid-way aborts the request
        except httpx.HTTPError:
            pass

    threads = [threading.Thread(target=cut, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    deadline = time.time() + 30
    while (usage := _kv_usage(url)) > 0 and time.time() < deadline:
        time.sleep(0.2)
    assert usage == 0, f"{usage:.3f} of the KV cache still held after every stream was aborted"
    r = httpx.post(url + "/v1/completions", timeout=60, json={"prompt": "after", "max_tokens": 3})
    assert r.status_code == 200


def test_a_dead_core_gives_503_not_a_hang(server):
    """Runs last in this module: it kills the core."""
    proc, url, log_path = server
    (core,) = [k for k in _children(proc.pid) if _loads_jaxlib(k)]
    stream_lines: list[str] = []

    def stream():
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"prompt": "long", "max_tokens": 240, "ignore_eos": True,
                                "stream": True}) as r:
            stream_lines.extend(r.iter_lines())

    t = threading.Thread(target=stream)
    t.start()
    time.sleep(1.0)
    os.kill(core, signal.SIGKILL)
    t.join(30)
    assert not t.is_alive(), "the stream hung after the core died"
    assert any('"error"' in ln for ln in stream_lines) or any(
        "finish_reason\":\"length" in ln for ln in stream_lines), stream_lines[-3:]
    deadline = time.time() + 5
    while httpx.get(url + "/health", timeout=5).status_code == 200:
        assert time.time() < deadline, "/health stayed 200 with the core dead"
        time.sleep(0.1)
    r = httpx.post(url + "/v1/completions", timeout=10, json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == 503
    assert proc.poll() is None, "the API process stays up to answer 503s"
