"""Decoders that pool, on tiny random Qwen3 checkpoints against Hugging Face: a last-token
embedder (Qwen3-Embedding style), ``Qwen3ForSequenceClassification`` and the Qwen3-Reranker
recipe (vLLM's ``hf_overrides``: the LM head's rows of two tokens as the classifier)."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from jaxserve import LLM

PROMPTS = ["The capital of France is Paris.", "hello", "a b c d e f g h i j k l m n o p",
           "Query: what is jax? Document: a numerical library"]


@pytest.fixture(scope="module")
def qwen3_dir(tiny_model_factory):
    return tiny_model_factory("qwen3")


def _hf_tokenizer(d):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(d))


def test_qwen3_last_token_embedder_matches_hf(qwen3_dir):
    from transformers import AutoModel

    llm = LLM(str(qwen3_dir), runner="pooling", enforce_eager=True, max_model_len=64,
              max_num_batched_tokens=64)
    info = llm.llm_engine.pooling_info
    assert (info.pooling_type, info.normalize) == ("LAST", True)
    got = [o.outputs.data for o in llm.embed(PROMPTS)]
    tok = _hf_tokenizer(qwen3_dir)
    hf = AutoModel.from_pretrained(str(qwen3_dir)).eval()
    for p, g in zip(PROMPTS, got):
        with torch.no_grad():
            h = hf(**tok(p, return_tensors="pt")).last_hidden_state[0, -1].numpy()
        np.testing.assert_allclose(g, h / np.linalg.norm(h), atol=1e-4)


def test_qwen3_sequence_classification_matches_hf(qwen3_dir, tmp_path):
    from transformers import AutoConfig, Qwen3ForSequenceClassification

    cfg = AutoConfig.from_pretrained(str(qwen3_dir))
    cfg.architectures, cfg.num_labels = ["Qwen3ForSequenceClassification"], 3
    cfg.pad_token_id = 0
    torch.manual_seed(0)
    hf = Qwen3ForSequenceClassification(cfg).eval()
    d = tmp_path / "qwen3_cls"
    hf.save_pretrained(str(d))
    for f in qwen3_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, d / f.name)
    llm = LLM(str(d), enforce_eager=True, max_model_len=64, max_num_batched_tokens=64)
    assert llm.runner_type == "pooling"  # auto: a *ForSequenceClassification
    tok = _hf_tokenizer(d)
    raw = llm.encode(PROMPTS, pooling_params=__import__(
        "jaxserve.core.pooling_params", fromlist=["PoolingParams"]).PoolingParams(
        task="classify", use_activation=False))
    for p, out in zip(PROMPTS, raw):
        with torch.no_grad():
            want = hf(**tok(p, return_tensors="pt")).logits[0].numpy()
        np.testing.assert_allclose(out.outputs.data, want, atol=1e-4)
    probs = llm.classify(PROMPTS[:1])[0].outputs.probs
    np.testing.assert_allclose(np.sum(probs), 1.0, atol=1e-5)


def test_qwen3_reranker_recipe_matches_hf_yes_no_logits(qwen3_dir):
    from transformers import AutoModelForCausalLM

    tok = _hf_tokenizer(qwen3_dir)
    no, yes = tok.convert_ids_to_tokens([40, 41])  # two single tokens of the tiny vocabulary
    llm = LLM(str(qwen3_dir), runner="pooling", enforce_eager=True, max_model_len=64,
              max_num_batched_tokens=64, hf_overrides={
                  "architectures": ["Qwen3ForSequenceClassification"],
                  "classifier_from_token": [no, yes], "is_original_qwen3_reranker": True})
    query, docs = "what is the capital", ["Paris is the capital.", "bananas", "a city"]
    got = [o.outputs.score for o in llm.score(query, docs)]
    hf = AutoModelForCausalLM.from_pretrained(str(qwen3_dir)).eval()
    want = []
    for doc in docs:
        ids = tok(query, doc, return_tensors="pt")
        with torch.no_grad():
            logits = hf(**ids).logits[0, -1]
        want.append(torch.softmax(logits[[40, 41]], -1)[1].item())  # P(yes) of {no, yes}
    np.testing.assert_allclose(got, want, atol=1e-4)
