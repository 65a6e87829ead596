"""Multi-host: a two-process ``jax.distributed`` job on 127.0.0.1 (CPU, gloo collectives) serves a
request end to end.

Two ``jaxserve serve`` processes, one CPU device each, form one tp=2 mesh across processes. The
leader (host 0) serves HTTP and broadcasts each step; the follower replays it. The greedy answer
must equal the single-process engine's, and SIGTERM to the leader must stop both cleanly.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from server_process import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
ENGINE_FLAGS = ["--max-num-batched-tokens", "32", "--min-token-bucket", "32",
                "--max-num-seqs", "4", "--max-model-len", "128", "--dtype", "float32"]
PROMPT, MAX_TOKENS = "The capital of France is", 6


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)


def test_two_process_job_serves_a_request(tiny_model_factory, tmp_path):
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.core.sampling_params import SamplingParams

    model = str(tiny_model_factory("llama"))
    port, coord = free_port(), free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)  # one CPU device per process
    procs, logs = [], []
    for host in (1, 0):
        log = open(tmp_path / f"host{host}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", model, "-tp", "2",
             "--num-hosts", "2", "--host-index", str(host), "--coordinator",
             f"127.0.0.1:{coord}", "--port", str(port), *ENGINE_FLAGS],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT)))
    follower, leader = procs
    try:
        wait_healthy(port, [leader, follower], [tmp_path / "host0.log", tmp_path / "host1.log"],
                     timeout=300, poll=1)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120, json=dict(
            model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0))
        assert r.status_code == 200, r.text
        served = r.json()["choices"][0]
        assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS

        leader.send_signal(signal.SIGTERM)
        assert leader.wait(timeout=60) == 0
        assert follower.wait(timeout=60) == 0  # the leader's STOP reached it
        follower_log = (tmp_path / "host1.log").read_text()
        steps = int(follower_log.split("leader stopped after ")[1].split()[0])
        assert steps >= MAX_TOKENS  # the follower replayed every step of the request
    finally:
        for p in procs:
            _stop(p)
        for log in logs:
            log.close()

    single = LLM(model, tensor_parallel_size=1, max_num_batched_tokens=32, min_token_bucket=32,
                 max_num_seqs=4, max_model_len=128, dtype="float32")
    out = single.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                          use_tqdm=False)[0].outputs[0]
    assert served["text"] == out.text
    assert served["finish_reason"] == out.finish_reason
