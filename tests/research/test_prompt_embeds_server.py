"""``prompt_embeds`` in ``/v1/completions`` (``--enable-prompt-embeds``): vLLM's base64
``torch.save`` format and base64 ``.npy``, equal to the token prompt they embed; bad payloads
are a 400 naming the field."""
from __future__ import annotations

import asyncio
import base64
import io

import httpx
import msgspec
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.core_process import _REQUEST_DECODER, AddRequest, encode_request
from jaxserve.entrypoints.cli import build_parser, engine_config_from_args
from jaxserve.entrypoints.openai.app import build_app
from tests.server_process import ServerThread

MODEL = "tiny"
PROMPT = [5, 17, 33, 9, 250, 77, 3, 8]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def server(model_dir):
    from jaxserve.engine.async_llm import AsyncLLM

    flags = ["serve", model_dir, "--served-model-name", MODEL, "--max-model-len", "128",
             "--max-num-seqs", "8", "--max-num-batched-tokens", "32", "--min-token-bucket",
             "32", "--num-gpu-blocks-override", "96", "--enable-prompt-embeds"]
    eng = AsyncLLM(engine_config_from_args(build_parser().parse_args(flags)))
    srv = ServerThread(build_app(eng, served_model_names=[MODEL])).__enter__()
    yield srv
    srv.__exit__(None, None, None)
    asyncio.run(eng.shutdown())


def _b64_torch(x):
    buf = io.BytesIO()
    torch.save(torch.tensor(x), buf)
    return base64.b64encode(buf.getvalue()).decode()


def _b64_npy(x):
    buf = io.BytesIO()
    np.save(buf, x)
    return base64.b64encode(buf.getvalue()).decode()


def _post(srv, **body):
    return httpx.post(srv.url + "/v1/completions", timeout=120, json={
        "model": MODEL, "max_tokens": 5, "temperature": 0, "logprobs": 2, **body})


def test_completions_prompt_embeds(server, model_dir):
    from pathlib import Path
    [path] = Path(model_dir).glob("*.safetensors")
    table = load_file(path)["model.embed_tokens.weight"].astype(np.float32)
    want = _post(server, prompt=PROMPT).json()["choices"][0]
    r = _post(server, prompt_embeds=[_b64_torch(table[PROMPT]), _b64_npy(table[PROMPT])],
              prompt=[PROMPT[:3]])
    assert r.status_code == 200, r.text
    body = r.json()
    choices = body["choices"]
    assert len(choices) == 3
    for c in choices[:2]:  # the embeddings first, as vLLM orders them
        assert c["text"] == want["text"]
        np.testing.assert_allclose(c["logprobs"]["token_logprobs"],
                                   want["logprobs"]["token_logprobs"], atol=1e-5)
    assert body["usage"]["prompt_tokens"] == 2 * len(PROMPT) + 3
    for bad, why in (("@@@", "base64"), (_b64_npy(np.zeros((2, 5), np.float32)), "shape"),
                     (_b64_npy(np.zeros(4, np.float32)), "shape")):
        r = _post(server, prompt_embeds=bad)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "prompt_embeds"


def test_core_process_message_carries_embeds():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    buf = io.BytesIO()
    np.save(buf, x)
    msg = AddRequest("r", [0, 0, 0], SamplingParams(), prompt_embeds=buf.getvalue())
    back = _REQUEST_DECODER.decode(encode_request(msg))
    np.testing.assert_array_equal(np.load(io.BytesIO(back.prompt_embeds)), x)
    assert isinstance(msgspec.msgpack.encode(msg), bytes)

