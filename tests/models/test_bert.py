"""The BERT encoder family and the pooling engine on tiny random checkpoints, against Hugging
Face (hidden states, a cross-encoder's logits) and sentence-transformers (the whole module
pipeline: Transformer, Pooling, Dense, Normalize)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxserve import LLM
from jaxserve.config import engine_config_from_kwargs
from jaxserve.core.pooling_params import PoolerConfig, PoolingParams
from jaxserve.errors import InvalidRequestError

TEXTS = ["the cat sat on the mat", "a dog", "what is the capital of france ? paris is the "
         "capital of france and the city is big", "rain", "the red car ran fast on the road "
         "from paris to london"]


@pytest.fixture(scope="module")
def st_dir(tmp_path_factory):
    from jaxserve.testing.tiny_bert import make_tiny_st_embedder

    return make_tiny_st_embedder(tmp_path_factory.mktemp("st_embedder"))


@pytest.fixture(scope="module")
def ce_dir(tmp_path_factory):
    from jaxserve.testing.tiny_bert import make_tiny_cross_encoder

    return make_tiny_cross_encoder(tmp_path_factory.mktemp("cross_encoder"))


@pytest.fixture(scope="module")
def embedder(st_dir):
    return LLM(str(st_dir), max_num_batched_tokens=256, max_num_seqs=8)


def test_st_pipeline_matches_sentence_transformers(embedder, st_dir):
    from sentence_transformers import SentenceTransformer

    assert embedder.llm_engine.pooling_info.pooling_type == "MEAN"  # from 1_Pooling/config.json
    ref = SentenceTransformer(str(st_dir), device="cpu").encode(TEXTS)
    got = np.stack([o.outputs.data for o in embedder.embed(TEXTS)])
    assert got.shape == ref.shape == (len(TEXTS), 16)  # after the Dense module 32 -> 16
    np.testing.assert_allclose(got, ref, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # Normalize


def test_packed_steps_compile_nothing_after_warmup(embedder):
    runner = embedder.llm_engine.runner
    compiled = runner.num_compiles
    assert compiled == runner.compiles_at_warmup <= len(runner.buckets)  # one per bucket
    many = [" ".join(TEXTS[i % len(TEXTS)] for _ in range(1 + i % 4)) for i in range(20)]
    steps = embedder.llm_engine.num_steps
    outs = embedder.embed(many, truncate_prompt_tokens=-1)
    assert runner.num_compiles == compiled
    # 20 prompts under max_num_seqs 8: at least three steps, several prompts a step
    assert 3 <= embedder.llm_engine.num_steps - steps < 20
    alone = embedder.embed(many[7], truncate_prompt_tokens=-1)[0].outputs.data  # packed with others or alone: the same
    np.testing.assert_allclose(outs[7].outputs.data, alone, atol=1e-5)


@pytest.mark.parametrize("pooling", ["CLS", "LAST", "ALL"])
def test_pooler_config_override_against_hf_hidden_states(st_dir, pooling):
    from transformers import AutoTokenizer, BertModel

    llm = LLM(str(st_dir), pooler_config={"pooling_type": pooling, "normalize": False},
              max_num_batched_tokens=64, max_num_seqs=4, enforce_eager=True)
    llm.llm_engine.dense = []  # the encoder's own output, before the ST Dense module
    tok = AutoTokenizer.from_pretrained(str(st_dir))
    hf = BertModel.from_pretrained(str(st_dir)).eval()
    task = "token_embed" if pooling == "ALL" else "embed"
    outs = llm.encode(TEXTS[:3], PoolingParams(task=task))
    for text, out in zip(TEXTS[:3], outs):
        with torch.no_grad():
            h = hf(**tok(text, return_tensors="pt")).last_hidden_state[0].numpy()
        want = {"CLS": h[0], "LAST": h[-1], "ALL": h}[pooling]
        np.testing.assert_allclose(out.outputs.data, want, atol=1e-5)


def test_cross_encoder_scores_match_hf(ce_dir):
    from transformers import AutoTokenizer, BertForSequenceClassification

    llm = LLM(str(ce_dir), max_num_batched_tokens=128, max_num_seqs=8, enforce_eager=True)
    assert llm.runner_type == "pooling"  # auto: a *ForSequenceClassification architecture
    query, docs = "what is the capital", ["paris is the capital", "a dog sat", "rain", "the sun"]
    got = [o.outputs.score for o in llm.score(query, docs)]
    tok = AutoTokenizer.from_pretrained(str(ce_dir))
    hf = BertForSequenceClassification.from_pretrained(str(ce_dir)).eval()
    with torch.no_grad():
        logits = hf(**tok([query] * len(docs), docs, return_tensors="pt",
                          padding=True)).logits[:, 0].numpy()
    np.testing.assert_allclose(got, 1 / (1 + np.exp(-logits)), atol=1e-5)
    raw = llm.encode([query], PoolingParams(task="score", use_activation=False))
    assert raw[0].outputs.data.shape == (1,)
    with pytest.raises(InvalidRequestError, match="runner 'generate'"):
        llm.generate("hello")
    with pytest.raises(InvalidRequestError, match="does not embed"):
        llm.embed("hello")


def test_classifier_probs_match_hf_softmax(tmp_path):
    from transformers import AutoTokenizer, BertForSequenceClassification

    from jaxserve.testing.tiny_bert import make_tiny_cross_encoder

    d = make_tiny_cross_encoder(tmp_path / "cls3", seed=3, num_labels=3)
    llm = LLM(str(d), max_num_batched_tokens=64, max_num_seqs=4, enforce_eager=True)
    got = np.stack([o.outputs.probs for o in llm.classify(TEXTS[:3])])
    tok = AutoTokenizer.from_pretrained(str(d))
    hf = BertForSequenceClassification.from_pretrained(str(d)).eval()
    with torch.no_grad():
        want = torch.softmax(hf(**tok(TEXTS[:3], return_tensors="pt", padding=True)).logits,
                             -1).numpy()
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_bad_input_is_an_error_naming_the_field(embedder):
    long = " ".join(["cat"] * 100)  # > max_seq_length 48
    with pytest.raises(InvalidRequestError, match="maximum context length") as e:
        embedder.embed(long)
    assert e.value.param == "input"
    assert len(embedder.embed(long, truncate_prompt_tokens=-1)[0].prompt_token_ids) == 48
    with pytest.raises(InvalidRequestError, match="prompts is empty"):
        embedder.embed([])
    with pytest.raises(InvalidRequestError, match="matryoshka"):
        embedder.embed("cat", dimensions=8)
    with pytest.raises(InvalidRequestError, match="classification head"):
        embedder.classify("cat")
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens"):
        embedder.embed("cat", truncate_prompt_tokens=1000)
    assert not embedder.llm_engine.has_unfinished_requests()


def test_runner_and_pooler_config_flags():
    c = engine_config_from_kwargs("m", task="embed")
    assert (c.runner, c.pooling_task) == ("pooling", "embed")
    assert engine_config_from_kwargs("m", task="score").pooling_task == "score"
    with pytest.raises(ValueError, match="contradicts"):
        engine_config_from_kwargs("m", task="embed", runner="generate")
    with pytest.raises(ValueError, match="runner must be one of"):
        engine_config_from_kwargs("m", runner="embed")
    p = PoolerConfig.parse('{"pooling_type": "mean", "normalize": true}')
    assert (p.pooling_type, p.normalize) == ("MEAN", True)
    with pytest.raises(ValueError, match="pooler_config.pool_type"):
        PoolerConfig.parse({"pool_type": "MEAN"})
    with pytest.raises(ValueError, match="pooling_type"):
        PoolerConfig.parse({"pooling_type": "MAX"})


def test_step_pooling_keeps_tagged_tokens_and_returned_columns():
    from jaxserve.core.pooling_params import PoolingModelInfo, postprocess

    info = PoolingModelInfo(hidden_size=4, pooling_type="STEP", normalize=False,
                            step_tag_id=7, returned_token_ids=(1, 3))
    hidden = np.arange(20, dtype=np.float32).reshape(5, 4)  # five tokens
    out = postprocess(hidden, [7, 2, 7, 3, 7], PoolingParams(task="encode"), info)
    np.testing.assert_array_equal(out, hidden[[0, 2, 4]][:, [1, 3]])
    with pytest.raises(InvalidRequestError, match="token_embed"):
        from jaxserve.core.pooling_params import check_params
        check_params(PoolingParams(task="embed"), info)
