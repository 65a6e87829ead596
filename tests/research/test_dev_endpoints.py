"""vLLM's dev endpoints (``/sleep``, ``/wake_up``, ``/is_sleeping``) and ``/update_weights``:
on ``jaxserve serve`` with the engine core in its own process and ``JAXSERVE_SERVER_DEV_MODE=1``
they sleep, wake (identical outputs) and swap weights from a path (outputs equal a fresh
engine of that checkpoint), need the API key, and refuse a completion while asleep with 503;
without the flag they are 404 (an in-process ``AsyncLLM`` app)."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import pytest

from tests.research.test_weight_update import ENGINE, perturbed, write_checkpoint
from tests.server_process import ServerThread, free_port, stop, wait_healthy

KEY = "dev-key"
FLAGS = ["--max-model-len", "128", "--max-num-seqs", "8", "--max-num-batched-tokens", "32",
         "--min-token-bucket", "8", "--dtype", "float32", "--uvicorn-log-level", "warning"]
PROMPT = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def checkpoints(tiny_llama_dir, tmp_path_factory):
    """(base dir, new dir, greedy of the base, greedy of the new), from in-process LLMs."""
    from jaxserve import LLM, SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(tiny_llama_dir), **ENGINE)
    r = llm.llm_engine.runner
    new = write_checkpoint(tiny_llama_dir, tmp_path_factory.mktemp("dev") / "new",
                           perturbed(r.param_names(), r._state_leaves, seed=7))
    old_out = llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0].token_ids
    new_out = LLM(str(new), **ENGINE).generate([PROMPT], sp, use_tqdm=False)[0] \
        .outputs[0].token_ids
    return tiny_llama_dir, new, old_out, new_out


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    from tests.engine.test_core_process import _env

    base = checkpoints[0]
    port = free_port()
    log_path = tmp_path_factory.mktemp("devsrv") / "log.txt"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", str(base), *FLAGS,
             "--port", str(port), "--api-key", KEY], stdout=log, stderr=subprocess.STDOUT,
            env=_env(JAXSERVE_SERVER_DEV_MODE="1"))
    try:
        wait_healthy(port, [proc], [log_path], timeout=300)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120,
                          headers={"Authorization": f"Bearer {KEY}"}) as c:
            yield c
    finally:
        stop(proc, timeout=30)


def _complete(c) -> httpx.Response:
    return c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8,
                                           "temperature": 0, "ignore_eos": True})


def test_sleep_wake_and_update_weights_over_http(server, checkpoints):
    base, new, _, _ = checkpoints
    before = _complete(server).json()["choices"][0]["text"]
    assert server.get("/is_sleeping").json() == {"is_sleeping": False}
    for level in (1, 2):
        assert server.post(f"/sleep?level={level}").status_code == 200
        assert server.get("/is_sleeping").json() == {"is_sleeping": True}
        r = _complete(server)
        assert r.status_code == 503 and "sleeping" in r.json()["error"]["message"]
        assert server.post("/wake_up?tags=kv_cache").status_code == 200
        assert server.get("/is_sleeping").json() == {"is_sleeping": True}  # weights still out
        assert server.post("/wake_up?tags=weights").status_code == 200
        assert server.get("/is_sleeping").json() == {"is_sleeping": False}
        assert _complete(server).json()["choices"][0]["text"] == before
    r = server.post("/update_weights", json={"path": str(new)})
    assert r.status_code == 200 and r.json() == {"updated": True, "pending": False}
    after = _complete(server).json()["choices"][0]["text"]
    assert after != before
    assert server.post("/update_weights", json={"path": str(base)}).status_code == 200
    assert _complete(server).json()["choices"][0]["text"] == before


def test_update_weights_output_equals_a_fresh_engine(server, checkpoints):
    from jaxserve.loaders.model_loader import load_tokenizer

    _, new, _, new_out = checkpoints
    tokenizer = load_tokenizer(new)
    assert server.post("/update_weights", json={"path": str(new)}).status_code == 200
    r = _complete(server)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == tokenizer.decode(new_out, skip_special_tokens=True)


@pytest.mark.parametrize("method, path, body, field", [
    ("post", "/sleep?level=3", None, "level"),
    ("post", "/sleep?level=x", None, "level"),
    ("post", "/wake_up?tags=gpu", None, "tags"),
    ("post", "/update_weights", {"path": "/nonexistent/ckpt"}, "weights"),
    ("post", "/update_weights", {}, "path"),
    ("post", "/update_weights", {"path": "/x", "reload": True}, "reload"),
    ("post", "/update_weights", {"path": "/x", "in_flight": "later"}, "in_flight"),
])
def test_bad_dev_requests_are_400_naming_the_field(server, method, path, body, field):
    r = getattr(server, method)(path, **({"json": body} if body is not None else {}))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    assert server.get("/is_sleeping").json() == {"is_sleeping": False}


def test_dev_endpoints_need_the_api_key(server):
    url = str(server.base_url)
    for path in ("/sleep", "/wake_up", "/update_weights"):
        assert httpx.post(url + path, timeout=30).status_code == 401
    assert httpx.get(url + "/is_sleeping", timeout=30).status_code == 401


def test_dev_endpoints_are_404_without_the_flag_and_run_on_asyncllm_with_it(
        checkpoints, monkeypatch):
    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.entrypoints.cli import build_parser, engine_config_from_args
    from jaxserve.entrypoints.openai.app import build_app

    base = checkpoints[0]
    monkeypatch.delenv("JAXSERVE_SERVER_DEV_MODE", raising=False)
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    eng = AsyncLLM(engine_config_from_args(build_parser().parse_args(
        ["serve", str(base), *FLAGS[:-2]])))
    try:
        with ServerThread(build_app(eng)) as srv:
            for path in ("/sleep", "/wake_up", "/update_weights"):
                assert httpx.post(srv.url + path, timeout=30).status_code == 404
            assert httpx.get(srv.url + "/is_sleeping", timeout=30).status_code == 404
        monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")  # vLLM's name works too
        with ServerThread(build_app(eng)) as srv:
            assert httpx.post(srv.url + "/sleep?level=1", timeout=60).status_code == 200
            assert httpx.get(srv.url + "/is_sleeping", timeout=30).json()["is_sleeping"]
            assert httpx.post(srv.url + "/wake_up", timeout=60).status_code == 200
            assert not httpx.get(srv.url + "/is_sleeping", timeout=30).json()["is_sleeping"]
    finally:
        asyncio.run(eng.shutdown())
