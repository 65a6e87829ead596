"""Multi-LoRA through the real server with the official openai client: adapters are models in
``/v1/models`` (parent = the base), a request's ``model`` picks its adapter (greedy text equal
to HF + PEFT merged), runtime load/unload behind ``JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING``, the
``lora_requests_info`` metric, bad adapters refused with a 400 naming them; and the production
guide's command, flag for flag, answering chats to its three adapters."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
openai = pytest.importorskip("openai")

from jaxserve.entrypoints.cli import build_parser, engine_config_from_args  # noqa: E402
from jaxserve.entrypoints.openai.app import build_app  # noqa: E402
from jaxserve.testing.lora_adapters import (make_peft_adapter, merged_hf_model,  # noqa: E402
                                            write_random_adapter)
from jaxserve.testing.tiny_model import make_tiny_model  # noqa: E402
from tests.server_process import ServerThread, free_port, stop, wait_healthy  # noqa: E402

NEW = 8
PROMPT = [21, 57, 99, 140, 33, 8, 301, 77, 45]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora-server")
    base = make_tiny_model("llama", d / "base")
    return dict(
        base=base,
        qv=make_peft_adapter(base, d / "qv", r=8, target_modules=["q_proj", "v_proj"], seed=1),
        mlp=make_peft_adapter(base, d / "mlp", r=4, target_modules=["gate_proj", "down_proj"],
                              std=0.3, seed=2),
        late=make_peft_adapter(base, d / "late", r=16, target_modules=["o_proj", "up_proj"],
                               seed=3, use_rslora=True),
        dir=d,
    )


@pytest.fixture(scope="module")
def server(files):
    from jaxserve.engine.async_llm import AsyncLLM

    os.environ["JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    args = build_parser().parse_args(
        ["serve", str(files["base"]), "--served-model-name", "tiny", "--max-model-len", "128",
         "--max-num-seqs", "8", "--max-num-batched-tokens", "32", "--min-token-bucket", "32",
         "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--lora-modules",
         f"qv={files['qv']}", f'{{"name": "mlp", "path": "{files["mlp"]}"}}'])
    engine = AsyncLLM(engine_config_from_args(args))
    try:
        app = build_app(engine, served_model_names=["tiny"], lora_modules=args.lora_modules)
        asyncio.run(app.state.serving.models_registry.load_startup_adapters())
        with ServerThread(app) as srv:
            srv.engine = engine
            yield srv
    finally:
        os.environ.pop("JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING", None)
        asyncio.run(engine.shutdown())


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def hf_text(files, adapter, tokenizer):
    model = merged_hf_model(files["base"], None if adapter is None else files[adapter])
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False,
                         eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    return tokenizer.decode(out, skip_special_tokens=True)


def complete(client, model):
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.model == model and r.usage.completion_tokens == NEW
    return r.choices[0].text


def test_models_and_adapters_match_hf(server, client, files):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"tiny", "qv", "mlp"}
    assert cards["qv"].parent == "tiny" and cards["mlp"].parent == "tiny"
    assert cards["qv"].root == str(files["qv"]) and cards["tiny"].parent is None
    tok = server.engine.tokenizer
    texts = {m: complete(client, m) for m in ("tiny", "qv", "mlp")}
    for m, text in texts.items():
        assert text == hf_text(files, None if m == "tiny" else m, tok), m
    assert len(set(texts.values())) == 3
    chat = client.chat.completions.create(model="qv", messages=[{"role": "user",
                                                                  "content": "hi"}],
                                          max_tokens=4)
    assert chat.model == "qv" and chat.choices[0].message.content is not None
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist"):
        complete(client, "nope")
    metrics = httpx.get(server.url + "/metrics").text
    assert 'jaxserve:lora_requests_info{max_lora="2"' in metrics


def test_runtime_load_and_unload(server, client, files, tmp_path):
    url = server.url + "/v1"
    r = httpx.post(url + "/load_lora_adapter",
                   json={"lora_name": "late", "lora_path": str(files["late"])})
    assert r.status_code == 200 and "late" in r.text
    assert complete(client, "late") == hf_text(files, "late", server.engine.tokenizer)
    again = httpx.post(url + "/load_lora_adapter",
                       json={"lora_name": "late", "lora_path": str(files["late"])})
    assert again.status_code == 400 and "already been loaded" in again.text
    big = write_random_adapter(tmp_path / "big", {"model.layers.0.self_attn.q_proj": (64, 64)},
                               r=32, target_modules=["q_proj"])
    r = httpx.post(url + "/load_lora_adapter", json={"lora_name": "big", "lora_path": str(big)})
    assert r.status_code == 400
    assert "LoRA adapter 'big': rank 32 exceeds max_lora_rank 16" in r.json()["error"]["message"]
    shapes = {"model.layers.0.self_attn.q_proj": (48, 64)}  # another base model's width
    other = write_random_adapter(tmp_path / "other", shapes, r=4, target_modules=["q_proj"])
    r = httpx.post(url + "/load_lora_adapter", json={"lora_name": "other",
                                                      "lora_path": str(other)})
    assert r.status_code == 400 and "'other'" in r.text and "shape mismatch" in r.text
    assert {m.id for m in client.models.list().data} == {"tiny", "qv", "mlp", "late"}
    r = httpx.post(url + "/unload_lora_adapter", json={"lora_name": "late"})
    assert r.status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete(client, "late")
    r = httpx.post(url + "/unload_lora_adapter", json={"lora_name": "late"})
    assert r.status_code == 404 and "cannot be found" in r.text


GUIDE = ("python -m vllm.entrypoints.openai.api_server --model MODEL --enable-lora "
         "--lora-modules korean-chat=/path/to/korean-lora code-assist=/path/to/code-lora "
         "medical-qa=/path/to/medical-lora --max-loras 3 --max-lora-rank 64")


def _serve(argv, log: Path, port: int) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, *argv, "--port", str(port),
                             "--max-num-batched-tokens", "32", "--min-token-bucket", "32",
                             "--max-model-len", "128", "--max-num-seqs", "4"],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


@pytest.mark.slow  # a `jaxserve serve` process with the engine core in its own process
def test_guide_command_serves_three_adapters(files):
    d = files["dir"]
    paths = {}
    for i, name in enumerate(("korean", "code", "medical")):  # the guide's rank-64 adapters
        paths[name] = make_peft_adapter(files["base"], d / f"{name}-lora", r=64 if i == 0 else 8,
                                        target_modules=["q_proj", "v_proj", "down_proj"],
                                        seed=20 + i)
    words = GUIDE.replace("MODEL", str(files["base"])).replace("/path/to", str(d)).split()
    assert words[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    argv = ["-m", "jaxserve.entrypoints.openai.api_server", *words[3:]]
    port = free_port()
    log = d / "guide.log"
    proc = _serve(argv, log, port)
    try:
        wait_healthy(port, [proc], [log], timeout=400)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                               max_retries=0, timeout=120)
        ids = {m.id for m in client.models.list().data}
        assert {"korean-chat", "code-assist", "medical-qa"} <= ids
        answers = {}
        for name in ("korean-chat", "code-assist", "medical-qa"):
            r = client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "Hello there"}],
                max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
            assert r.model == name and r.usage.completion_tokens == 6
            answers[name] = r.choices[0].message.content
        assert len(set(answers.values())) == 3  # three adapters, three answers
    finally:
        stop(proc)


@pytest.mark.slow
def test_bad_lora_module_stops_the_server(files, tmp_path):
    big = write_random_adapter(tmp_path / "huge", {"model.layers.0.self_attn.q_proj": (64, 64)},
                               r=32, target_modules=["q_proj"])
    port = free_port()
    log = tmp_path / "bad.log"
    proc = _serve(["-m", "jaxserve.entrypoints.cli", "serve", str(files["base"]),
                   "--enable-lora", "--max-lora-rank", "16", "--lora-modules",
                   f"huge={big}"], log, port)
    try:
        assert proc.wait(400) != 0
    finally:
        stop(proc)
    assert "LoRA adapter 'huge': rank 32 exceeds max_lora_rank 16" in log.read_text()
