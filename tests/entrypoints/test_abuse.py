"""An adversarial client against the server (issue #28): no request can hurt another.

One in-process engine and uvicorn (the ``jaxserve serve`` uvicorn settings) for the module, so
engine-level checks and HTTP checks share one warm-up; the SIGTERM drain runs ``jaxserve serve``
in a subprocess. Each test names the failure it reproduces (what happened before the fix)."""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from jaxserve.entrypoints.cli import build_parser, engine_config_from_args
from jaxserve.entrypoints.openai.app import build_app
from jaxserve.errors import InvalidRequestError
from jaxserve.core.sampling_params import MAX_SEED, SamplingParams

from tests.server_process import ServerThread, free_port, wait_healthy

API_KEY = "sk-abuse"
MAX_MODEL_LEN = 256
FLAGS = ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8",
         "--max-num-batched-tokens", "32", "--min-token-bucket", "32",
         "--num-gpu-blocks-override", "96"]
AUTH = {"Authorization": f"Bearer {API_KEY}"}
HEADER_TIMEOUT = 1.0


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def engine(model_dir):
    from jaxserve.engine.async_llm import AsyncLLM

    eng = AsyncLLM(engine_config_from_args(build_parser().parse_args(
        ["serve", model_dir, *FLAGS])))
    yield eng
    asyncio.run(eng.shutdown())


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(build_app(engine, api_key=API_KEY), header_timeout=HEADER_TIMEOUT) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120, headers=AUTH) as c:
        yield c


def assert_alive(http) -> None:
    """/health is 200 and a fresh request is answered in full."""
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json={"prompt": "alive?", "max_tokens": 3,
                                           "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


def sse_events(lines) -> list:
    """The ``data:`` payloads of an event stream: dicts, and the final "[DONE]"."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def run_async(coro):
    return asyncio.run(coro)


async def collect(engine, prompt, params, rid, started: asyncio.Event | None = None):
    last = None
    async for out in engine.generate(prompt, params, rid):
        last = out
        if started is not None:
            started.set()
    return last


# ---- 1. seeds ---------------------------------------------------------------------------------
def test_max_seed_with_n2_keeps_the_engine_alive(http):
    """Before: n=2 with seed 2**64-1 gave child 1 seed 2**64, the uint32 seed arrays raised
    OverflowError in the engine loop and every later request (and /health) got 503."""
    body = {"prompt": "seed", "n": 2, "seed": MAX_SEED, "temperature": 1.0, "max_tokens": 6,
            "ignore_eos": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    # child i samples with seed (seed + i) mod 2**64: choice 1 is the n=1 answer for seed 0
    for i, seed in enumerate((MAX_SEED, 0)):
        one = http.post("/v1/completions", json={**body, "n": 1, "seed": seed})
        assert one.status_code == 200, one.text
        assert one.json()["choices"][0]["text"] == choices[i]["text"]
    assert_alive(http)


@pytest.mark.parametrize("seed", [MAX_SEED + 1, -1, 2**70])
def test_seed_outside_the_sampler_range_is_400(http, seed):
    r = http.post("/v1/completions", json={"prompt": "x", "seed": seed, "n": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=seed)


def test_child_seeds_stay_in_range_and_distinct():
    from jaxserve.engine.parallel_sampling import child_seed

    for parent in (0, 1, 2**32 - 1, 2**32, MAX_SEED - 3, MAX_SEED):
        kids = [child_seed(parent, i) for i in range(128)]
        assert all(0 <= k <= MAX_SEED for k in kids)
        assert len(set(kids)) == 128 and kids[0] == parent


# ---- 2. request ids ---------------------------------------------------------------------------
def _stream_completion(server, body: dict, out: dict, key: str, started: threading.Event):
    with httpx.Client(base_url=server.url, timeout=60, headers=AUTH) as c:
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            out[key + ".status"] = r.status_code
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                if line.startswith("data: "):
                    started.set()
            out[key] = sse_events(lines)
    started.set()


def _finish_reasons(events) -> dict[int, str]:
    return {ch["index"]: ch["finish_reason"] for e in events if isinstance(e, dict)
            for ch in e.get("choices", []) if ch.get("finish_reason")}


def _text_by_choice(events) -> dict[int, str]:
    text: dict[int, str] = {}
    for e in events:
        if isinstance(e, dict):
            for ch in e.get("choices", []):
                text[ch["index"]] = text.get(ch["index"], "") + ch["text"]
    return text


@pytest.mark.parametrize("first,second,first_n,second_n", [
    ("foo", "foo#0", 2, 1),  # before: 400, yet foo's choice 0 was aborted; later KeyError
    ("bar#0", "bar", 1, 2),  # before: 400, and bar#0's stream never ended (engine spinning)
])
def test_client_request_ids_never_reach_another_request(server, http, first, second,
                                                        first_n, second_n):
    long = {"prompt": "Keep talking", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    out: dict = {}
    started = threading.Event()
    t = threading.Thread(target=_stream_completion, args=(
        server, {**long, "n": first_n, "request_id": first}, out, "first", started))
    t.start()
    assert started.wait(60)
    r = http.post("/v1/completions", json={**long, "max_tokens": 5, "n": second_n,
                                           "request_id": second})
    assert r.status_code == 200, r.text
    assert r.json()["id"] == second  # the client's id is echoed as the response id
    assert len(r.json()["choices"]) == second_n
    # and a second request with the same client id is just another request
    again = http.post("/v1/completions", json={**long, "max_tokens": 5, "request_id": second})
    assert again.status_code == 200, again.text
    t.join(60)
    assert not t.is_alive() and out["first.status"] == 200
    events = out["first"]
    assert events[-1] == "[DONE]"
    assert all(e["id"] == first for e in events if isinstance(e, dict))
    assert _finish_reasons(events) == {i: "length" for i in range(first_n)}
    ref = http.post("/v1/completions", json={**long, "n": 1}).json()["choices"][0]["text"]
    assert _text_by_choice(events) == {i: ref for i in range(first_n)}  # greedy: untouched
    assert_alive(http)


def test_engine_children_are_keyed_by_the_engine(engine):
    """The engine API itself: a caller id equal to another request's old child id ("foo#0")
    runs beside it, and neither is cut short."""
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def main():
        started = asyncio.Event()
        two = asyncio.create_task(collect(engine, "parent", SamplingParams(
            n=2, temperature=0, max_tokens=200, ignore_eos=True), "foo", started))
        await started.wait()
        one = await collect(engine, "child", sp, "foo#0")
        assert not two.done()  # they really ran side by side
        return await two, one

    two, one = run_async(main())
    assert [len(c.token_ids) for c in two.outputs] == [200, 200]
    assert len(one.outputs[0].token_ids) == 12
    engine.check_health()


def test_rejected_duplicate_never_aborts_the_running_request(engine):
    """Guard (held before too): AsyncLLM answers a duplicate id with an error and leaves the
    running request alone; the failed add sends no abort of its own."""
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        started = asyncio.Event()
        first = asyncio.create_task(collect(engine, "dup", long, "dup-id", started))
        await started.wait()
        with pytest.raises(InvalidRequestError) as e:
            await collect(engine, "dup", long, "dup-id")
        assert e.value.param == "request_id"
        assert not first.done()
        return await first

    out = run_async(main())
    assert len(out.outputs[0].token_ids) == 200 and out.outputs[0].finish_reason == "length"


def test_cancel_before_the_add_runs_keeps_the_engine_alive(engine, http):
    """A stream cancelled while its add waits in the command queue: before, the engine thread's
    set_result on the cancelled future raised InvalidStateError and killed the engine."""
    async def main():
        busy = asyncio.create_task(collect(engine, "busy", SamplingParams(
            temperature=0, max_tokens=120, ignore_eos=True), "busy"))
        await asyncio.sleep(0.1)
        for i in range(30):
            task = asyncio.create_task(collect(engine, "gone", SamplingParams(max_tokens=4),
                                               f"gone-{i}"))
            await asyncio.sleep(0)  # the add is queued
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        return await busy

    out = run_async(main())
    assert len(out.outputs[0].token_ids) == 120
    assert_alive(http)


def test_x_request_id_is_echoed(http):
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2},
                  headers={"X-Request-Id": "trace-42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
    assert r.json()["id"] == "trace-42"
    r = http.get("/health")
    assert len(r.headers["x-request-id"]) == 32  # one is made up when the client sent none
    r = httpx.post(http.base_url.join("/v1/completions"), json={"prompt": "x"},
                   headers={"X-Request-Id": "no-key"})
    assert r.status_code == 401 and r.headers["x-request-id"] == "no-key"


# ---- 3. tokenization off the event loop --------------------------------------------------------
def _health_latencies(server, stop: threading.Event) -> list[float]:
    lat = []
    with httpx.Client(base_url=server.url, timeout=60) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            assert c.get("/health").status_code == 200
            lat.append(time.perf_counter() - t0)
            time.sleep(0.05)
    return lat


@pytest.mark.slow
def test_8mb_tokenize_does_not_stall_health(server):
    """Before: /health waited 11-13 s behind an 8 MB /tokenize (the event loop tokenized)."""
    prompt = "the quick brown fox jumps over the lazy dog. " * (8 * 2**20 // 45)
    stop = threading.Event()
    result: dict = {}

    def tokenize():
        t0 = time.perf_counter()
        result["r"] = httpx.post(server.url + "/tokenize", json={"prompt": prompt}, timeout=300)
        result["s"] = time.perf_counter() - t0
        stop.set()

    t = threading.Thread(target=tokenize)
    t.start()
    lat = _health_latencies(server, stop)
    t.join()
    r = result["r"]
    assert r.status_code == 200 and r.json()["count"] > 2**20, r.text[:200]
    assert len(lat) >= 5, (lat, result["s"])  # /health was polled all along the tokenization
    assert max(lat) < 2.0, (max(lat), result["s"])


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "a" * (8 * 2**20)}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "a" * (8 * 2**20)]}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * (8 * 2**20)}]},
     "messages"),
])
def test_prompt_too_long_by_bytes_is_rejected_before_tokenizing(http, path, body, param):
    """Before: an 8 MB prompt was tokenized (seconds, on the event loop) before the length
    check; a 30 MB one took 72 s to be rejected."""
    t0 = time.perf_counter()
    r = http.post(path, json=body)
    took = time.perf_counter() - t0
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text[:300]
    assert "maximum context length" in r.json()["error"]["message"]
    assert took < 3.0, took  # tokenizing 8 MB here takes 10+ s


def test_byte_bound_never_rejects_a_prompt_that_fits(http, engine):
    from jaxserve.entrypoints.openai.serving_engine import max_token_bytes

    width = max_token_bytes(engine.tokenizer)
    assert width and width >= max(len(t.encode()) for t in engine.tokenizer.get_vocab())
    # the longest text max_model_len - 1 tokens can spell
    longest = max(engine.tokenizer.get_vocab(), key=lambda t: len(engine.tokenizer.decode(
        [engine.tokenizer.convert_tokens_to_ids(t)])))
    tid = engine.tokenizer.convert_tokens_to_ids(longest)
    text = engine.tokenizer.decode([tid] * 40)
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) < MAX_MODEL_LEN - 1
    r = http.post("/v1/completions", json={"prompt": text, "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_body_limit_is_a_flag():
    args = build_parser().parse_args(["serve", "--max-request-body-bytes", "1M",
                                      "--shutdown-timeout", "2.5"])
    assert args.max_request_body_bytes == 2**20 and args.shutdown_timeout == 2.5
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--shutdown-timeout", "-1"])


# ---- 5. a client that hangs up during the upload ------------------------------------------------
def test_disconnect_during_body_upload_is_not_an_error(server, http, caplog):
    """Before: ``ERROR internal error`` and an 80-line traceback, no key needed."""
    caplog.set_level(logging.INFO)
    for path in ("/v1/completions", "/tokenize"):
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall((f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       f"Authorization: Bearer {API_KEY}\r\n"
                       "Content-Length: 100000\r\n\r\n{\"prompt\": \"").encode())
            time.sleep(0.3)
    time.sleep(0.5)
    bad = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not bad, [r.getMessage() for r in bad]
    assert_alive(http)


# ---- 6. half-open connections, strict types ----------------------------------------------------
def test_incomplete_request_head_is_closed(server, http):
    """Before: a connection that never finished its headers was held open (1000 of them for
    60 s); now it is closed HEADER_TIMEOUT after connecting, even while trickling bytes."""
    socks = []
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)
    t0 = time.monotonic()
    closed_after = []
    for i, s in enumerate(socks):
        s.settimeout(HEADER_TIMEOUT + 5)
        if i == 0:  # trickle: a byte now and then must not extend the deadline
            for _ in range(3):
                time.sleep(HEADER_TIMEOUT / 4)
                s.sendall(b"X")
        assert s.recv(1024) == b""  # closed by the server
        closed_after.append(time.monotonic() - t0)
        s.close()
    assert max(closed_after) < HEADER_TIMEOUT + 3, closed_after
    assert_alive(http)  # keep-alive connections with whole requests are unaffected


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "n": True}, "n"),
    ({"prompt": [True, False]}, "prompt"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "x", "temperature": "0.5"}, "temperature"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "logprobs": 1.0}, "logprobs"),
])
def test_lax_coercion_is_rejected(http, body, param):
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_non_json_content_type_is_rejected(http):
    body = json.dumps({"prompt": "x", "max_tokens": 2})
    r = http.post("/v1/completions", content=body, headers={"Content-Type": "text/plain"})
    assert r.status_code == 400 and "application/json" in r.json()["error"]["message"]
    r = http.post("/v1/completions", content=body,
                  headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text


# ---- 4. SIGTERM drains ---------------------------------------------------------------------------
def _env():
    import os

    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", PYTHONPATH=path)
    env.pop("JAXSERVE_API_KEY", None)
    return env


@pytest.mark.slow
def test_sigterm_ends_every_stream_with_done(tmp_path, model_dir):
    """Before: SIGTERM with 20 streams in flight cut every stream mid-chunk (no finish_reason,
    no error, no [DONE]) and logged 20 CancelledError tracebacks."""
    port = free_port()
    log_path = tmp_path / "log.txt"
    grace = 1.0
    # room for 2000-token streams: thousands of decode steps, far beyond the grace period
    flags = ["--max-model-len", "2048", "--max-num-seqs", "8", "--max-num-batched-tokens", "32",
             "--min-token-bucket", "32", "--num-gpu-blocks-override", "600"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", model_dir, *flags,
             "--port", str(port), "--api-key", API_KEY, "--shutdown-timeout", str(grace),
             "--uvicorn-log-level", "warning"],
            stdout=log, stderr=subprocess.STDOUT, env=_env())
    try:
        wait_healthy(port, [proc], [log_path], timeout=300)
        url = f"http://127.0.0.1:{port}"
        # 4 short streams finish inside the grace period; 4 long ones cannot (2000 decode
        # steps of 8 rows take seconds even on a fast CPU)
        bodies = [{"prompt": f"stream {i}", "temperature": 0, "ignore_eos": True,
                   "max_tokens": 3 if i < 4 else 2000, "stream": True} for i in range(8)]
        outs: dict = {}
        events = [threading.Event() for _ in bodies]
        threads = [threading.Thread(target=_stream_to, args=(url, b, outs, i, events[i]))
                   for i, b in enumerate(bodies)]
        for t in threads:
            t.start()
        assert all(e.wait(120) for e in events), outs
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        draining = httpx.get(url + "/health", timeout=10)
        refused = httpx.post(url + "/v1/completions", headers=AUTH, timeout=10,
                             json={"prompt": "late", "max_tokens": 2})
        for t in threads:
            t.join(60)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log_path.read_text()
    assert draining.status_code == 503 and refused.status_code == 503, (draining, refused.text)
    assert refused.json()["error"]["code"] == 503
    for i in range(8):
        ev = outs[i]
        assert ev[-1] == "[DONE]", (i, ev[-3:])
        finish = _finish_reasons(ev)
        errors = [e for e in ev if isinstance(e, dict) and "error" in e]
        if i < 4:
            assert finish == {0: "length"} and not errors, (i, ev[-3:])
        else:
            assert not finish and len(errors) == 1, (i, ev[-3:])
            assert errors[0]["error"]["code"] == 503
            assert "shut down" in errors[0]["error"]["message"]
    assert "Traceback" not in text and "CancelledError" not in text, text[-3000:]
    assert "jaxserve stopped" in text


def _stream_to(url: str, body: dict, outs: dict, i: int, first: threading.Event) -> None:
    lines = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=AUTH,
                          timeout=120) as r:
            for line in r.iter_lines():
                lines.append(line)
                if line.startswith("data: "):
                    first.set()
    except httpx.HTTPError as e:  # a cut stream: recorded, the assertions report it
        lines.append(f"cut: {e!r}")
    finally:
        outs[i] = sse_events(lines) + [ln for ln in lines if ln.startswith("cut: ")]
        first.set()


# ---- #20: nothing silently ignored -----------------------------------------------------------
@pytest.mark.parametrize("path,extra,param", [
    ("/v1/chat/completions", {"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/completions", {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"max_tokenz": 4}, "max_tokenz"),
])
def test_unimplemented_fields_are_400_naming_them(http, path, extra, param):
    body = {"prompt": "x"} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "x"}]}
    r = http.post(path, json={**body, "max_tokens": 2, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    ok = http.post(path, json={**body, "max_tokens": 2, "tools": [], "tool_choice": "none"}
                   if path != "/v1/completions" else {**body, "max_tokens": 2})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_truncate_prompt_tokens_keeps_the_last_tokens(http, engine, path):
    """vLLM's truncate_prompt_tokens: a prompt longer than max_model_len is served from its last
    k tokens (without it, the same prompt is a 400)."""
    long = engine.max_model_len + 50
    body = ({"prompt": [5 + i % 100 for i in range(long)]} if path == "/v1/completions" else
            {"messages": [{"role": "user", "content": "x " * long}]})
    r = http.post(path, json={**body, "max_tokens": 2})
    assert r.status_code == 400, r.text
    r = http.post(path, json={**body, "max_tokens": 2, "truncate_prompt_tokens": 7})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 7


# ---- #20: a stop string that spans tokens never reaches a stream -------------------------------
def _spanning_stop(engine, prompt: str) -> tuple[str, str]:
    """(greedy text, a 3-character stop string that starts in one generated token and ends in
    the next, occurring first there)."""
    tok = engine.tokenizer
    out = run_async(collect(engine, prompt, SamplingParams(temperature=0, max_tokens=40,
                                                           ignore_eos=True),
                          f"ref-{time.monotonic_ns()}"))
    text, ids = out.outputs[0].text, out.outputs[0].token_ids
    for k in range(2, len(ids) - 1):
        head = tok.decode(ids[:k])
        nxt = tok.decode(ids[:k + 1])
        if not (text.startswith(nxt) and len(head) >= 2 and len(nxt) > len(head)):
            continue
        stop = text[len(head) - 2:len(head) + 1]
        if text.find(stop) == len(head) - 2 and stop.isprintable() and "\ufffd" not in stop:
            return text, stop
    pytest.skip("no token boundary with a clean 3-character stop string")


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_stop_string_across_tokens_never_streamed(server, http, engine, route):
    """Before: the stream showed the stop string's first characters (they came with an
    earlier token) and the final text cut them: stream != non-stream."""
    if route == "completions":
        path, base = "/v1/completions", {"prompt": "Once upon a time"}
        text, stop = _spanning_stop(engine, "Once upon a time")
    else:
        path = "/v1/chat/completions"
        base = {"messages": [{"role": "user", "content": "Tell me a story"}]}
        from jaxserve.engine.tokenizer import apply_chat_template
        ids = apply_chat_template(engine.tokenizer, base["messages"])
        text, stop = _spanning_stop(engine, {"prompt_token_ids": ids})
    body = {**base, "temperature": 0, "max_tokens": 40, "ignore_eos": True, "stop": [stop]}
    full = http.post(path, json=body).json()["choices"][0]
    final = full["text"] if route == "completions" else full["message"]["content"]
    assert final == text[:text.find(stop)] and full["finish_reason"] == "stop"
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    pieces = []
    for e in events[:-1]:
        for ch in e["choices"]:
            pieces.append(ch["text"] if route == "completions" else ch["delta"].get("content")
                          or "")
    streamed = "".join(pieces)
    assert streamed == final, (streamed, final, stop)


# ---- #20: /ping and /load ------------------------------------------------------------------------
def test_ping_and_load(server, http):
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200
    assert httpx.get(server.url + "/ping").status_code == 200  # no key, like /health
    assert http.get("/load").json() == {"server_load": 0}
    out: dict = {}
    started = threading.Event()
    t = threading.Thread(target=_stream_completion, args=(server, {
        "prompt": "load", "max_tokens": 200, "temperature": 0, "ignore_eos": True}, out, "s",
        started))
    t.start()
    assert started.wait(60)
    busy = http.get("/load").json()["server_load"]
    t.join(60)
    assert busy == 1 and out["s"][-1] == "[DONE]"
    assert http.get("/load").json() == {"server_load": 0}
