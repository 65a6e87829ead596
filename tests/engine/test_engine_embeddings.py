"""Embeddings from the generative engine (engine/decoder_pooling.py): a decoder's normalized final
hidden state at each prompt's last token equals HF's, through chunked prefill and the prefix
cache, mixed with generation in the same steps; no page is left behind."""
import numpy as np
import pytest

from jaxserve.core.pooling_params import PoolingParams
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.errors import InvalidRequestError

torch = pytest.importorskip("torch")

PROMPTS = [[5, 9, 13], list(range(3, 70)), [7] * 40 + [11, 12], list(range(100, 133))]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    from jaxserve import LLM

    return LLM(str(tiny_llama_dir), max_model_len=256, max_num_seqs=8,
               max_num_batched_tokens=32, min_token_bucket=32)


@pytest.fixture(scope="module")
def hf_vectors(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            h = hf(torch.tensor([p]), output_hidden_states=True).hidden_states[-1][0, -1].numpy()
            out.append(h / np.linalg.norm(h))
    return out


def test_embeddings_equal_hf_last_token(llm, hf_vectors):
    compiles = llm.llm_engine.stats()["num_compiles"]
    outs = llm.embed(PROMPTS)  # 67 and 42 tokens: chunked by the 32-token budget
    for o, want in zip(outs, hf_vectors):
        got = np.asarray(o.outputs.embedding)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=2e-5)
    assert llm.llm_engine.stats()["num_compiles"] == compiles


def test_prefix_cache_serves_a_repeated_document(llm, hf_vectors):
    bm = llm.llm_engine.block_manager
    hits = bm.prefix_cache_hits
    [again] = llm.embed([PROMPTS[1]])
    assert bm.prefix_cache_hits > hits  # its full pages came from the cache
    np.testing.assert_allclose(again.outputs.embedding, hf_vectors[1], atol=2e-5)


def test_generation_and_embeddings_share_steps(llm, hf_vectors):
    engine = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    llm.llm_engine.reset_prefix_cache()
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"g{i}", p, sp)
        engine.add_request(f"e{i}", p, PoolingParams(task="embed"))
    got, steps_with_both = {}, 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        kinds = {o.request_id[0] for o in outs}
        steps_with_both += kinds == {"g", "e"}
        for o in outs:
            if o.finished:
                got[o.request_id] = o
    assert steps_with_both >= 1
    for i in range(len(PROMPTS)):
        assert got[f"g{i}"].outputs[0].token_ids == alone[i]
        np.testing.assert_allclose(got[f"e{i}"].outputs.embedding, hf_vectors[i], atol=2e-5)
    assert engine.get_num_unfinished_requests() == 0
    assert engine.block_manager.num_used_pages == 0  # nothing leaked
    assert engine.stats()["num_running"] == 0


def test_options_and_bad_inputs(llm, hf_vectors):
    [plain] = llm.embed([PROMPTS[0]], PoolingParams(task="embed", normalize=False))
    assert abs(np.linalg.norm(plain.outputs.embedding) - 1.0) > 1e-3
    got = np.asarray(plain.outputs.embedding)
    np.testing.assert_allclose(got / np.linalg.norm(got), hf_vectors[0], atol=2e-5)
    with pytest.raises(InvalidRequestError) as e:
        llm.classify(["hello"])
    assert e.value.param == "runner"
    with pytest.raises(InvalidRequestError) as e:
        llm.embed([PROMPTS[0]], dimensions=3)
    assert e.value.param == "dimensions"
    with pytest.raises(InvalidRequestError) as e:
        llm.embed([list(range(300))])
    assert e.value.param == "input"
    [cut] = llm.embed([list(range(3, 300))], truncate_prompt_tokens=67)
    np.testing.assert_allclose(cut.outputs.embedding, llm.embed([list(range(233, 300))])[0]
                               .outputs.embedding, atol=2e-5)
    scores = llm.score("a b c", ["a b c", "x y z"])
    assert scores[0].outputs.score == pytest.approx(1.0, abs=1e-5)
