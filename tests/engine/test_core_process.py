"""``jaxserve serve`` runs the engine core in a child process: the API process never loads jax,
a dead core turns into 503s and an unhealthy ``/health`` (not a hang), and a burst of
aborted streams leaves no KV page behind."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server_process import free_port, stop, wait_healthy

FLAGS = ["--max-model-len", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "32",
         "--min-token-bucket", "32", "--num-gpu-blocks-override", "64",
         "--uvicorn-log-level", "warning"]


def _env(**extra):
    root = str(Path(__file__).resolve().parents[2])
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
        stop(proc, timeout=30)


def _kv_usage(url: str) -> float:
    return _metric(url, "jaxserve:kv_cache_usage_perc")


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
                                    "ignore_eos": True, "stream": True,
                                    "n": 1 + 2 * (i % 2)}) as r:  # n = 3: every child aborted
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


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return float(next(ln for ln in text.splitlines() if ln.startswith(name)).rsplit(" ", 1)[1])


def test_reset_prefix_cache(server):
    """The same prompt hits the prefix cache the second time, not after a reset; a reset while
    a request holds pages is refused (409) and drops nothing."""
    _, url, _ = server
    body = {"prompt": "a shared prefix that spans several pages " * 4, "max_tokens": 2}

    def hits_after_one_request():
        before = _metric(url, "jaxserve:prefix_cache_hits_total")
        assert httpx.post(url + "/v1/completions", timeout=60, json=body).status_code == 200
        return _metric(url, "jaxserve:prefix_cache_hits_total") - before

    hits_after_one_request()
    assert hits_after_one_request() >= 16  # at least one whole page of 16 tokens reused
    r = httpx.post(url + "/reset_prefix_cache", timeout=30)
    assert r.status_code == 200 and r.json() == {"reset": True}
    assert hits_after_one_request() == 0
    for _ in range(3):  # the stream must still be running when the reset arrives
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"prompt": "hold pages", "max_tokens": 240, "ignore_eos": True,
                                "stream": True}) as s:
            lines = s.iter_lines()
            next(lines)
            busy = httpx.post(url + "/reset_prefix_cache", timeout=30)
            still_running = any(ln.startswith("data: {") for ln in lines)
        if still_running:
            break
    assert still_running, "every stream ended before the reset request: cannot test the 409"
    assert busy.status_code == 409 and busy.json()["error"]["code"] == 409
    assert hits_after_one_request() >= 16  # the refused reset dropped nothing


def test_stop_strings_are_found_in_the_api_process(server):
    """The core sends ids only; the API process's output processor finds a stop string that
    spans two tokens, cuts the text there, and tells the core to stop: the sequence's pages
    are freed and the ids the core made past the stop leave the token count."""
    _, url, _ = server
    body = {"prompt": "the stop test", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}
    full = httpx.post(url + "/v1/completions", timeout=60, json=body).json()["choices"][0]
    tokens, text = full["logprobs"]["tokens"], full["text"]
    assert "".join(tokens) == text
    # a stop string made of the last character of token i and the first of token i + 1
    i = next(i for i in range(3, len(tokens) - 1) if tokens[i] and tokens[i + 1]
             and (tokens[i][-1] + tokens[i + 1][0]) not in "".join(tokens[:i]) + tokens[i][:-1])
    stop = tokens[i][-1] + tokens[i + 1][0]
    cut = text.index(stop)
    before = _metric(url, "jaxserve:generation_tokens_total")
    pieces, finish = [], None
    with httpx.stream("POST", url + "/v1/completions", timeout=60,
                      json=dict(body, stop=[stop], stream=True, logprobs=None)) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                pieces.append(choice["text"])
                finish = choice["finish_reason"] or finish
    assert "".join(pieces) == text[:cut]
    assert finish == "stop"
    deadline = time.time() + 10
    while (_kv_usage(url) > 0 or _metric(url, "jaxserve:generation_tokens_total") - before
           != i + 2) and time.time() < deadline:
        time.sleep(0.1)
    assert _kv_usage(url) == 0
    assert _metric(url, "jaxserve:generation_tokens_total") - before == i + 2, \
        "ids past the stop string are not generation tokens"


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
