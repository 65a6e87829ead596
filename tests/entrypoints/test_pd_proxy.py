"""Disaggregated prefill and decode over HTTP: two ``jaxserve serve`` processes started with a
vLLM-style ``--kv-transfer-config`` (NixlConnector, kv_both) and ``jaxserve proxy`` in front.
32 mixed greedy requests (completions and chat, n > 1, stop strings, structured outputs, a
LoRA adapter, short and long prompts, streamed and not) answer through the pair exactly as one
colocated instance answers them; a decode whose producer died fails within its timeout and
frees its pages."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from jaxserve.entrypoints.cli import engine_config_from_args, parse_args
from jaxserve.entrypoints.proxy import DisaggProxy
from jaxserve.testing.lora_adapters import write_random_adapter
from tests.server_process import ServerThread, free_port, stop, wait_healthy

# the tiny Llama's attention projections (hidden 64, 4 heads, 2 KV heads of 16), 2 layers
SHAPES = {f"model.layers.{i}.self_attn.{p}": (64, 64 if p == "q_proj" else 32)
          for i in range(2) for p in ("q_proj", "v_proj")}
LOAD_TIMEOUT_S = 5
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hum old songs "
         "about rivers mountains and distant cities").split()


def test_seed_style_kv_transfer_config_command_line():
    args = parse_args(["serve", "m", "--kv-transfer-config",
                       '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'])
    kt = engine_config_from_args(args).kv_transfer
    assert kt.kv_connector == "NixlConnector" and kt.is_producer and kt.is_consumer
    assert kt.kv_port == 14579 and kt.kv_load_failure_policy == "fail"
    with pytest.raises(ValueError, match="kv_role must be one of"):
        engine_config_from_args(parse_args(["serve", "m", "--kv-transfer-config",
                                            '{"kv_connector":"NixlConnector"}']))
    with pytest.raises(ValueError, match="kv_connector 'PyNcclConnectorr'"):
        engine_config_from_args(parse_args([
            "serve", "m", "--kv-transfer-config",
            '{"kv_connector":"PyNcclConnectorr","kv_role":"kv_producer"}']))
    proxy = parse_args(["proxy", "--prefill", "http://a:1", "http://b:2", "--decode",
                        "http://c:3", "--port", "9000"])
    assert proxy.prefill == ["http://a:1", "http://b:2"] and proxy.port == 9000


def _start(model, adapter, log: Path, port: int) -> subprocess.Popen:
    kv = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_port": 0,
          "kv_connector_extra_config": {"kv_load_timeout": LOAD_TIMEOUT_S}}
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[2]),
                                                      os.environ.get("PYTHONPATH")) if p))
    env.pop("JAXSERVE_API_KEY", None)
    flags = ["--served-model-name", "tiny", "--max-model-len", "256", "--max-num-seqs", "8",
             "--max-num-batched-tokens", "64", "--min-token-bucket", "16",
             "--dtype", "float32", "--enable-lora", "--max-loras", "1", "--max-lora-rank", "8",
             "--lora-modules", f"ad={adapter}", "--kv-transfer-config", json.dumps(kv),
             "--uvicorn-log-level", "warning", "--port", str(port)]
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, "-m", "jaxserve.entrypoints.cli", "serve",
                                 str(model), *flags], stdout=f, stderr=subprocess.STDOUT,
                                env=env)


@pytest.fixture(scope="module")
def pair(tiny_model_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("pd")
    adapter = write_random_adapter(root / "ad", SHAPES, r=8, target_modules=["q_proj", "v_proj"],
                                   std=0.3, seed=1)
    model = tiny_model_factory("llama")
    ports = [free_port(), free_port()]
    logs = [root / "prefill.log", root / "decode.log"]
    procs = [_start(model, adapter, log, port) for log, port in zip(logs, ports)]
    try:
        for port in ports:
            wait_healthy(port, procs, logs, timeout=300)
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        for url in urls:  # buckets compile after /health: a pull then waits for the pool
            _wait_warm(url)
        with ServerThread(DisaggProxy(urls[:1], urls[1:]).app()) as proxy:
            yield dict(prefill=urls[0], decode=urls[1], proxy=proxy.url, procs=procs,
                       logs=logs)
    finally:
        for p in procs:
            stop(p, timeout=30)


def _wait_warm(url: str, timeout: float = 300) -> None:
    """Until a completion that fills the largest token bucket is fast twice in a row."""
    deadline, fast = time.time() + timeout, 0
    while fast < 2:
        assert time.time() < deadline, f"{url} did not warm up"
        t = time.perf_counter()
        r = httpx.post(url + "/v1/completions", timeout=120, json=dict(
            model="tiny", prompt=_text(60, random.Random(1)), max_tokens=2, n=2))
        assert r.status_code == 200, r.text
        fast = fast + 1 if time.perf_counter() - t < 1.0 else 0


def _text(n: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def mixed_requests() -> list[tuple[str, dict]]:
    """32 requests: (route, body), greedy."""
    rng = random.Random(0)
    out = []
    for i in range(32):
        kind = i % 8
        n_words = rng.choice([2, 6, 15, 30, 60])  # within one page to several pages
        common = dict(model="ad" if kind == 5 else "tiny", temperature=0,
                      max_tokens=rng.randint(4, 10))
        if kind in (0, 1, 5):
            body = dict(common, prompt=_text(n_words, rng), ignore_eos=True)
        elif kind == 2:  # n > 1
            body = dict(common, prompt=_text(n_words, rng), n=2, ignore_eos=True)
        elif kind == 3:  # stop strings
            body = dict(common, prompt=_text(n_words, rng), stop=["e", "o "], max_tokens=12)
        elif kind == 4:  # structured output
            body = dict(common, prompt=_text(n_words, rng),
                        structured_outputs={"choice": ["yes", "no", "maybe later"]})
        elif kind == 6:  # chat, streamed half the time
            body = dict(common, messages=[{"role": "user", "content": _text(n_words, rng)}],
                        stream=bool(i % 16 == 6), ignore_eos=True)
        else:  # chat with a JSON schema
            body = dict(common, messages=[{"role": "user", "content": _text(n_words, rng)}],
                        response_format={"type": "json_schema", "json_schema": {
                            "name": "x", "schema": {"type": "object", "properties": {
                                "a": {"type": "integer"}}, "required": ["a"]}}},
                        max_tokens=16)
        out.append(("/v1/chat/completions" if "messages" in body else "/v1/completions", body))
    return out


def _answer(url: str, route: str, body: dict) -> list[tuple]:
    """(index, text, finish_reason) of each choice; a stream is joined."""
    if not body.get("stream"):
        r = httpx.post(url + route, json=body, timeout=120)
        assert r.status_code == 200, r.text
        return sorted((c["index"], c.get("text", (c.get("message") or {}).get("content")),
                       c["finish_reason"]) for c in r.json()["choices"])
    parts: dict[int, list] = {}
    finish: dict[int, str] = {}
    with httpx.stream("POST", url + route, json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                parts.setdefault(c["index"], []).append(c["delta"].get("content") or "")
                if c["finish_reason"]:
                    finish[c["index"]] = c["finish_reason"]
    return sorted((i, "".join(p), finish.get(i)) for i, p in parts.items())


@pytest.mark.slow
def test_mixed_requests_through_the_pair_equal_one_colocated_instance(pair):
    reqs = mixed_requests()
    with ThreadPoolExecutor(8) as pool:
        # colocated: the prefill instance answers them alone (no kv_transfer_params)
        want = list(pool.map(lambda rb: _answer(pair["prefill"], *rb), reqs))
        got = list(pool.map(lambda rb: _answer(pair["proxy"], *rb), reqs))
    assert got == want
    finishes = {f for answer in want for _, _, f in answer}
    assert "stop" in finishes and "length" in finishes  # stop strings did stop some
    assert any(len(a) == 2 for a in want)  # n = 2
    lora = [a for (_, b), a in zip(reqs, want) if b["model"] == "ad"]
    base = _answer(pair["prefill"], "/v1/completions", dict(reqs[5][1], model="tiny"))
    assert lora[0] != base  # the adapter changed the answer: it ran on both sides


@pytest.mark.slow
def test_decode_pulls_the_prompt_kv(pair):
    """The prefill answers with vLLM's params; the decode computes only the last prompt
    token (cached_tokens counts the pulled ones)."""
    msgs = [{"role": "user", "content": _text(40, random.Random(5))}]
    pre = httpx.post(pair["prefill"] + "/v1/chat/completions", timeout=60, json=dict(
        model="tiny", messages=msgs, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    assert pre.status_code == 200, pre.text
    params = pre.json()["kv_transfer_params"]
    assert {"remote_block_ids", "remote_engine_id", "remote_host", "remote_port"} <= set(params)
    n = pre.json()["usage"]["prompt_tokens"]
    assert params["do_remote_prefill"] and len(params["remote_block_ids"]) == -(-n // 16)
    dec = httpx.post(pair["decode"] + "/v1/chat/completions", timeout=60, json=dict(
        model="tiny", messages=msgs, max_tokens=4, kv_transfer_params=params))
    assert dec.status_code == 200, dec.text
    assert dec.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1
    bad = httpx.post(pair["decode"] + "/v1/completions", timeout=60, json=dict(
        model="tiny", prompt="hi", stream=True, kv_transfer_params={"do_remote_decode": True}))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "kv_transfer_params"


def _children(pid: int) -> list[int]:
    """Process ids whose parent is ``pid`` (from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _kv_usage(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(("jaxserve:kv_cache_usage_perc", "vllm:kv_cache_usage_perc")):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no kv_cache_usage_perc metric")


@pytest.mark.slow
def test_producer_killed_before_the_pull_fails_the_decode_within_its_timeout(pair):
    """Last in this module: it kills the prefill instance."""
    prompt = _text(50, random.Random(7))
    pre = httpx.post(pair["prefill"] + "/v1/completions", timeout=60, json=dict(
        model="tiny", prompt=prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    params = pre.json()["kv_transfer_params"]
    proc = pair["procs"][0]
    core = _children(proc.pid)
    assert core, "the prefill instance's engine core process was not found"
    for pid in [proc.pid, *core]:  # SIGKILL: the API process and its engine core at once
        os.kill(pid, signal.SIGKILL)
    proc.wait(30)
    t = time.perf_counter()
    dec = httpx.post(pair["decode"] + "/v1/completions", timeout=60, json=dict(
        model="tiny", prompt=prompt, max_tokens=4, kv_transfer_params=params))
    took = time.perf_counter() - t
    assert dec.status_code == 500, dec.text
    err = dec.json()["error"]
    assert err["param"] == "kv_transfer_params"
    assert f"{params['remote_host']}:{params['remote_port']}" in err["message"]
    assert f"within {LOAD_TIMEOUT_S} s" in err["message"]
    assert LOAD_TIMEOUT_S - 0.5 <= took < LOAD_TIMEOUT_S + 10
    # the decode instance goes on: its pages are back and it serves others
    deadline = time.time() + 10
    while _kv_usage(pair["decode"]) != 0.0:
        assert time.time() < deadline, "the failed decode's pages were not freed"
        time.sleep(0.2)
    ok = httpx.post(pair["decode"] + "/v1/completions", timeout=60,
                    json=dict(model="tiny", prompt=prompt, max_tokens=2))
    assert ok.status_code == 200
