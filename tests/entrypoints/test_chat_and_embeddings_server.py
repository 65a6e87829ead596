"""One server, one decoder, chat and ``/v1/embeddings`` at once: the generative engine core pools
its final hidden state at each input's last token (LAST, normalized) beside the chats' decode;
the vectors equal HF's, the chats equal the same server's answers alone."""
from __future__ import annotations

import concurrent.futures as cf

import numpy as np
import openai
import pytest

from jaxserve.entrypoints.cli import build_parser, engine_config_from_args
from jaxserve.entrypoints.openai.app import build_app

from tests.server_process import ServerThread

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow

TEXTS = ["the capital of France", "a much longer document " * 12, "rain tomorrow?"]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    from jaxserve.engine.core_client import EngineCoreClient

    config = engine_config_from_args(build_parser().parse_args([
        "serve", str(tiny_llama_dir), "--max-model-len", "256", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "32"]))
    engine = EngineCoreClient(config, ready_timeout_s=300)
    with ServerThread(build_app(engine)) as srv:
        srv.engine = engine
        yield srv
    engine.close()


def _hf_vectors(path, tokenizer, texts):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for t in texts:
            ids = tokenizer(t)["input_ids"]
            h = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]
            out.append(h.numpy() / np.linalg.norm(h.numpy()))
    return out


def test_chat_and_embeddings_together(server, tiny_llama_dir):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    model = client.models.list().data[0].id

    def chat(i):
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"count to {i}"}],
            max_tokens=24, temperature=0)
        return r.choices[0].message.content

    alone = [chat(i) for i in range(4)]
    with cf.ThreadPoolExecutor(8) as pool:
        chats = [pool.submit(chat, i) for i in range(4)]
        embeds = [pool.submit(client.embeddings.create, model=model, input=TEXTS)
                  for _ in range(3)]
        chats = [f.result() for f in chats]
        embeds = [f.result() for f in embeds]
    assert chats == alone
    want = _hf_vectors(tiny_llama_dir, server.engine.tokenizer, TEXTS)
    for r in embeds:
        assert [d.index for d in r.data] == [0, 1, 2]
        for d, w in zip(r.data, want):
            np.testing.assert_allclose(d.embedding, w, atol=5e-5)
        assert r.usage.prompt_tokens == sum(len(server.engine.tokenizer(t)["input_ids"])
                                            for t in TEXTS)
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=model, input=TEXTS[0], dimensions=3)
    assert "dimensions" in str(e.value)
