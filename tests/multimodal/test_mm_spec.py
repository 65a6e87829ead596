"""Speculative decoding with images on the tiny random Qwen 3.5 VLM: greedy tokens equal HF
``generate`` with n-gram and MTP proposals, and the MTP head reads an image prompt as the
model does (image embeddings at the placeholders, M-RoPE positions): its drafts equal the
torch head's chain over HF's own hidden states and merged embeddings."""
from __future__ import annotations

import numpy as np
import pytest

from jaxserve.testing.multimodal import IMAGE, PROMPT_HEAD, PROMPT_TAIL, make_image

pytest.importorskip("torch")

N = 24


@pytest.fixture(scope="module")
def vlm_mtp(tmp_path_factory):
    from jaxserve.testing.qwen3_5 import make_tiny_qwen3_5

    return make_tiny_qwen3_5(tmp_path_factory.mktemp("vlm-mtp") / "qwen3_5-vl", vl=True,
                             mtp=True)


@pytest.fixture(scope="module")
def hf(vlm_mtp):
    from jaxserve.testing.multimodal import HFReference

    return HFReference(vlm_mtp)


def _cases():
    """One image whose run the 32-token budget splits, and two images; text after each."""
    return [(PROMPT_HEAD + "Please describe this: " + IMAGE + " in detail, please." + PROMPT_TAIL,
             [make_image(96, 64, 0)]),
            (PROMPT_HEAD + "Compare " + IMAGE + " with " + IMAGE + " now." + PROMPT_TAIL,
             [make_image(64, 96, 1), make_image(40, 96, 2)])]


def _llm(path, spec):
    from jaxserve.entrypoints.llm import LLM

    return LLM(str(path), dtype="float32", max_num_batched_tokens=32, min_token_bucket=32,
               max_num_seqs=4, max_model_len=256, block_size=8, enforce_eager=True,
               speculative_config=spec)


def _generate(llm):
    from jaxserve.core.sampling_params import SamplingParams

    prompts = [{"prompt": p, "multi_modal_data": {"image": ims}} for p, ims in _cases()]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def reference(hf):
    return [hf.greedy(p, ims, N) for p, ims in _cases()]


def test_ngram_with_images_equals_hf(vlm_mtp, reference):
    llm = _llm(vlm_mtp, dict(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3,
                             prompt_lookup_min=1))
    assert llm.llm_engine.runner.mm is not None  # images are served with speculation on
    assert _generate(llm) == reference
    assert llm.llm_engine.stats()["spec_decode_num_accepted_tokens"] > 0


def test_mtp_with_images_drafts_are_the_heads_chain_and_greedy_equals_hf(vlm_mtp, hf,
                                                                           reference):
    import torch

    from jaxserve.testing.qwen3_5 import TorchMtpHead

    llm = _llm(vlm_mtp, dict(method="mtp", num_speculative_tokens=2))
    runner = llm.llm_engine.runner
    seen: list[tuple[list[int], list[int]]] = []
    keys: dict[tuple, np.ndarray] = {}

    def record(req, drafts):
        if len(req.all_token_ids) == len(req.prompt_token_ids) + 1:  # right after the prompt
            # the head's keys of every prompt position, written chunk by chunk
            k_pages = np.asarray(runner.kv_pages[runner.kv_config.mtp_layer][0])
            pos = np.arange(len(req.prompt_token_ids))
            keys[tuple(req.all_token_ids)] = k_pages[:, np.asarray(req.block_ids)[pos // 8],
                                                     pos % 8]
        seen.append((list(req.all_token_ids), list(drafts)))
        return drafts

    llm.llm_engine.proposer.override = record
    assert _generate(llm) == reference
    head = TorchMtpHead(vlm_mtp)

    def image_kwargs(kw, n):  # HF's image arguments for n tokens: the prompt's, then text
        types = torch.zeros((1, n), dtype=kw["mm_token_type_ids"].dtype)
        types[:, :kw["mm_token_type_ids"].shape[1]] = kw["mm_token_type_ids"]
        return dict(kw, mm_token_type_ids=types)

    checked = 0
    for prompt, images in _cases():
        ids, kw = hf.inputs(hf.tok.encode(prompt), images)
        [(tokens, k)] = [(t, k) for t, k in keys.items() if list(t[:len(ids)]) == ids]
        # image embeddings and M-RoPE positions reach the head's keys of the image positions
        np.testing.assert_allclose(k, head.keys(list(tokens), image_kwargs(kw, len(tokens))),
                                   atol=2e-4, rtol=0)
        mine = [(t, d) for t, d in seen if t[:len(ids)] == ids][:3]
        assert len(mine) == 3
        for tokens, drafts in mine:
            want = head.drafts(tokens, len(drafts), image_kwargs(kw, len(tokens)))
            assert drafts == want, (len(tokens), drafts, want)
            checked += len(drafts) == 2
    assert checked >= 4
